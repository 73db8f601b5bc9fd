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
