"""The README documents every fallback kind (with a fix), and only real ones."""
import pathlib
import re

from specularch.records import FALLBACK_KINDS

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_fallback_kinds_table_matches_the_code():
    text = README.read_text()
    section = text[text.index("## Fallback kinds"):]
    section = section[:section.index("\n## ", 5)]
    rows = re.findall(r"^\| `([a-z_]+)` \| (.+?) \| (.+?) \|$", section, flags=re.M)
    documented = {kind for kind, _, _ in rows}
    assert documented == set(FALLBACK_KINDS), (documented ^ set(FALLBACK_KINDS))
    assert all(what.strip() and fix.strip() for _, what, fix in rows)


def test_configuration_table_matches_the_options():
    from specularch.config import OPTIONS
    text = README.read_text()
    section = text[text.index("## Configuration"):]
    section = section[:section.index("\n## ", 5)]
    rows = re.findall(r"^\| `([a-z_]+)` \| (.+?) \| (.+?) \| .+ \|$", section, flags=re.M)
    assert {name for name, _, _ in rows} == set(OPTIONS), {name for name, _, _ in rows} ^ set(OPTIONS)
    for name, env, default in rows:
        option = OPTIONS[name]
        assert env.strip("` ") == (option.env or "—"), (name, env, option.env)
        if isinstance(option.default, bool):
            assert default == ("on" if option.default else "off"), (name, default)
        elif isinstance(option.default, float):
            assert default == f"{option.default:g}", (name, default, option.default)
        elif isinstance(option.default, (int, str)):
            assert default.strip("`") == str(option.default), (name, default, option.default)
