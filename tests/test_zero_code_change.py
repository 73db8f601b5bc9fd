"""Zero-code-change use: the SPECULARCH=1 start-up switch and its policy, the CLI report, and
the pytest plugin (on / compare modes, the skip marker, the comparison fixture, a broken
backend caught by compare mode)."""
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

pytest_plugins = ["pytester"]

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.body(x))

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def train_step(x, y):
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    for i in range(8):
        loss = train_step(torch.randn(5, 4), torch.randn(5, 2))
    print("final", round(loss, 6))
    print("loaded", "specularch" in sys.modules or "specularch_boot" in sys.modules)
    print("hook", torch._C._dynamo.eval_frame.get_eval_frame_callback() is not None)
""")


ROOT = pathlib.Path(__file__).resolve().parents[1]

# Start-up as site.py does it, for the repo's own .pth: ``site.addsitedir`` on a folder holding
# a copy of it, then the unmodified script. The runner starts with ``-S`` so that an installed
# copy of the .pth in site-packages does not run first; the test process's own site-packages
# folders (a venv's included: under ``-S`` a venv's interpreter does not know it is in one, so
# ``site.getsitepackages()`` there names the base interpreter's) join sys.path without their
# .pth files, before the copy is processed ("now") or after it ("later": a venv with
# --system-site-packages, a user-site install, where torch becomes importable only later).
RUNNER = textwrap.dedent("""
    import json, os, runpy, site, sys
    pth_dir, torch_path, script = sys.argv[1:4]
    packages = [p for p in json.loads(os.environ.pop("TEST_SITE_PACKAGES")) if p not in sys.path]
    if torch_path == "now":
        sys.path.extend(packages)
    site.addsitedir(pth_dir)
    print("torch at start-up:", "torch" in sys.modules, file=sys.stderr)
    if torch_path == "later":
        sys.path.extend(packages)
    sys.argv = sys.argv[3:]
    runpy.run_path(script, run_name="__main__")
""")


def _env(env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULARCH")}
    env.update(env_extra)
    return env


def _run(tmp_path, env_extra, *argv, executable=sys.executable):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run([executable, *argv, str(script)], env=_env(env_extra),
                          capture_output=True, text=True, timeout=300)


def _run_with_pth(tmp_path, env_extra, torch_path="now"):
    """The script started with the repo's specularch_startup.pth processed by site.py."""
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    (site_dir / "specularch_startup.pth").write_text((ROOT / "specularch_startup.pth").read_text())
    (tmp_path / "runner.py").write_text(RUNNER)
    env = _env({"PYTHONPATH": str(ROOT), "TEST_SITE_PACKAGES": json.dumps(_site_packages()),
                **env_extra})  # PYTHONPATH: specularch_boot, as installed
    return _run(tmp_path, env, "-S", str(tmp_path / "runner.py"), str(site_dir), torch_path)


def _site_packages() -> list[str]:
    """The site-packages folders this test process imports from (a venv's and, with
    --system-site-packages, the base interpreter's), as site.py put them on sys.path."""
    return [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")
            and os.path.isdir(p)]


def _pth_installed() -> bool:
    return any((pathlib.Path(p) / "specularch_startup.pth").exists() for p in _site_packages())


def test_unset_variable_changes_nothing(tmp_path):
    out = _run(tmp_path, {})
    assert out.returncode == 0, out.stderr
    assert "loaded False" in out.stdout and "hook False" in out.stdout


def test_unset_variable_imports_nothing_through_the_pth(tmp_path):
    out = _run_with_pth(tmp_path, {})
    assert out.returncode == 0, out.stderr
    assert "loaded False" in out.stdout and "hook False" in out.stdout


@pytest.mark.parametrize("torch_path", ["now", "later"])
def test_pth_switch_optimizes_an_unmodified_script(tmp_path, torch_path):
    """torch importable when the .pth runs: the switch is on at once; torch on sys.path only
    later: it turns on when the script imports torch (no 'Error processing line')."""
    plain = _run(tmp_path, {})
    out = _run_with_pth(tmp_path, {"SPECULARCH": "1", "SPECULARCH_LOG": "graphs",
                                   "SPECULARCH_REPORT": "1"}, torch_path)
    assert out.returncode == 0, out.stderr
    assert "Error processing" not in out.stderr, out.stderr
    assert f"torch at start-up: {torch_path == 'now'}" in out.stderr
    assert "[graphs] train_step" in out.stderr, out.stderr
    assert "specularch report for train_step" in out.stderr and "fallbacks: 0" in out.stderr
    assert "hook True" in out.stdout
    assert out.stdout.splitlines()[0] == plain.stdout.splitlines()[0]  # same final loss


BAD_VALUES = [("SPECULARCH", "2"), ("SPECULARCH", "maybe"), ("SPECULARCH_REPORT", "2"),
              ("SPECULARCH_BACKEND", "nope"), ("SPECULARCH_STRICT", "sure"),
              ("SPECULARCH_LOG", "graphz"), ("SPECULARCH_CACHE_LIMIT", "0"),
              ("SPECULARCH_PROFILE_CALLS", "-1"),
              ("SPECULARCH_RAISE_INTERNAL", "2")]


@pytest.mark.parametrize("torch_path", ["now", "later"])
@pytest.mark.parametrize("var, value", BAD_VALUES)
def test_bad_values_stop_the_program_at_startup(tmp_path, var, value, torch_path):
    env = {"SPECULARCH": "1", var: value}
    out = _run_with_pth(tmp_path, env, torch_path)
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""  # stopped before the script did anything
    lines = [l for l in out.stderr.splitlines() if not l.startswith("torch at start-up")]
    assert len(lines) == 1 and lines[0].startswith(f"specularch: {var}={value!r} is not valid: "
                                                   "expected "), out.stderr


def test_unknown_variable_is_warned_about(tmp_path):
    out = _run_with_pth(tmp_path, {"SPECULARCH": "1", "SPECULARCH_BAKEND": "fx"})
    assert out.returncode == 0, out.stderr
    assert "unknown variable SPECULARCH_BAKEND (did you mean SPECULARCH_BACKEND?)" in out.stderr
    assert "hook True" in out.stdout


def test_switch_off_checks_values_but_imports_no_torch(tmp_path):
    out = _run_with_pth(tmp_path, {"SPECULARCH": "0"})
    assert out.returncode == 0 and "loaded True" in out.stdout and "hook False" in out.stdout
    assert "torch at start-up: False" in out.stderr
    out = _run_with_pth(tmp_path, {"SPECULARCH": "0", "SPECULARCH_LOG": "graphz"})
    assert out.returncode == 2 and "SPECULARCH_LOG='graphz' is not valid" in out.stderr


@pytest.mark.skipif(not _pth_installed(), reason="the start-up .pth is not installed in this "
                    "interpreter (pip install . or pip install -e .)")
def test_environment_switch_optimizes_an_unmodified_script(tmp_path):
    plain = _run(tmp_path, {})
    out = _run(tmp_path, {"SPECULARCH": "1", "SPECULARCH_LOG": "graphs", "SPECULARCH_REPORT": "1"})
    assert out.returncode == 0, out.stderr
    assert "[graphs] train_step" in out.stderr, out.stderr
    assert "specularch report for train_step" in out.stderr and "fallbacks: 0" in out.stderr
    assert out.stdout.splitlines()[0] == plain.stdout.splitlines()[0]  # same final loss


@pytest.mark.skipif(not _pth_installed(), reason="the start-up .pth is not installed in this "
                    "interpreter (pip install . or pip install -e .)")
@pytest.mark.parametrize("var, value", [("SPECULARCH", "maybe"), ("SPECULARCH_LOG", "graphz")])
def test_bad_values_name_the_variable(tmp_path, var, value):
    out = _run(tmp_path, {"SPECULARCH": "1", var: value})
    assert out.returncode == 2, out.stderr
    assert f"{var}={value!r} is not valid" in out.stderr, out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("editable", [False, True], ids=["regular", "editable"])
def test_install_in_a_venv_with_system_site_packages(tmp_path, editable):
    """pip install of the repo into a venv whose torch lives in the system site-packages
    (processed after the venv's .pth files): both install kinds ship the .pth, and the
    switch turns on when the script imports torch."""
    src = tmp_path / "src"  # a copy: building writes build/ and *.egg-info next to setup.py
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "specularch_boot.py",
                 "specularch_startup.pth"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "specularch", src / "specularch",  # workloads/ (a link) as files
                    ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    # Built in pip's isolated build environment, as the README's install is: the test's own
    # interpreter may have no ``wheel`` (a fresh venv's setuptools cannot build one without it).
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
                    *(["-e"] if editable else []), str(src)],
                   check=True, timeout=300, capture_output=True)
    site_packages = next((venv / "lib").glob("python3*/site-packages"))
    assert (site_packages / "specularch_startup.pth").exists()
    assert not (site_packages / "models").exists()  # would shadow the user's own models package
    if not editable:
        assert (site_packages / "specularch" / "workloads" / "lenet.py").is_file()
    if sys.prefix != sys.base_prefix:
        # The tests run in a venv: a venv made from it sees the *base* interpreter's packages,
        # which lack torch. A .pth sorted after specularch's hands it this venv's folders, so
        # torch becomes importable after specularch_startup.pth ran, as with system packages.
        (site_packages / "zz_test_parent_site_packages.pth").write_text(
            "\n".join(_site_packages()) + "\n")
    plain = _run(tmp_path, {})
    out = _run(tmp_path, {"SPECULARCH": "1", "SPECULARCH_LOG": "graphs"}, executable=python)
    assert out.returncode == 0 and "Error processing" not in out.stderr, out.stderr
    assert "[graphs] train_step" in out.stderr and "hook True" in out.stdout, out.stderr
    assert out.stdout.splitlines()[0] == plain.stdout.splitlines()[0]
    bad = _run(tmp_path, {"SPECULARCH": "1", "SPECULARCH_BACKEND": "nope"}, executable=python)
    assert bad.returncode == 2 and "SPECULARCH_BACKEND='nope' is not valid" in bad.stderr


def test_cli_explain_reports_what_was_optimized(tmp_path):
    out = _run(tmp_path, {}, "-m", "specularch", "explain")
    assert out.returncode == 0, out.stderr
    assert "specularch report for train_step" in out.stderr
    assert "graphs: 1" in out.stderr and "fallbacks: 0" in out.stderr
    plain = _run(tmp_path, {})
    assert out.stdout.splitlines()[0] == plain.stdout.splitlines()[0]


def test_cli_explain_puts_the_script_folder_on_sys_path(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "helpers.py").write_text("def double(x):\n    return x * 2\n")
    (folder / "main.py").write_text("import helpers\nprint(helpers.double(21))\n")
    out = subprocess.run([sys.executable, "-m", "specularch", "explain", str(folder / "main.py")],
                         cwd=tmp_path, env=_env({}), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "42"


def test_cli_explain_stops_on_a_bad_value(tmp_path):
    out = _run(tmp_path, {"SPECULARCH_BACKEND": "nope"}, "-m", "specularch", "explain")
    assert out.returncode == 2 and out.stdout == ""
    assert "SPECULARCH_BACKEND='nope' is not valid" in out.stderr



def test_cli_explain_of_a_missing_script_says_so_and_runs_nothing(tmp_path):
    out = subprocess.run([sys.executable, "-m", "specularch", "explain", "missing.py"],
                         cwd=tmp_path, env=_env({}), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == ("python -m specularch explain: can't open file 'missing.py': "
                                  "no such file")


@pytest.mark.skipif(not _pth_installed(), reason="the start-up .pth is not installed in this "
                    "interpreter (pip install . or pip install -e .)")
def test_cli_explain_with_report_variable_prints_the_report_once(tmp_path):
    out = _run(tmp_path, {"SPECULARCH": "1", "SPECULARCH_REPORT": "1"}, "-m", "specularch", "explain")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("specularch report for train_step") == 1, out.stderr


def test_bad_log_variable_names_its_default_as_the_variable_spells_it(tmp_path):
    out = _run_with_pth(tmp_path, {"SPECULARCH": "1", "SPECULARCH_LOG": "graph"})
    assert out.returncode == 2
    assert "Unset it to use the default (none)." in out.stderr, out.stderr

LOGGING_SCRIPT = textwrap.dedent("""
    import logging
    import torch
    import specularch

    def step(x):
        return x.sin() + 1

    with specularch.config.patch(log=frozenset({"graphs"}), profile_calls=0):
        specularch.optimize(step)(torch.ones(2))
    logging.basicConfig(level=logging.DEBUG, format="user %(name)s %(message)s")
    logging.getLogger("app").debug("debug reaches the program's handler")
    print(logging.getLogger().level, len(logging.getLogger("specularch").handlers))
""")


def test_log_leaves_the_root_logger_to_the_program(tmp_path):
    """SPECULARCH_LOG output before the program sets up logging does not stop the program's
    own later basicConfig from working."""
    script = tmp_path / "logs.py"
    script.write_text(LOGGING_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], env=_env({}), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "specularch: [graphs] step" in out.stderr
    assert "user app debug reaches the program's handler" in out.stderr, out.stderr
    assert out.stdout.split() == [str(logging.DEBUG), "1"]


SUITE = textwrap.dedent("""
    import pytest
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return torch.tanh(self.fc(x)) * 2

    def test_model_runs():
        torch.manual_seed(0)
        m = Model()
        for _ in range(5):
            out = m(torch.randn(4, 3))
        assert out.shape == (4, 2)

    @pytest.mark.specularch_skip
    def test_skipped_by_marker():
        assert torch.ones(2).sum() == 2

    def test_fixture(specularch_compare):
        reports = specularch_compare(lambda x: x.sin() + 1, torch.randn(3), backends=["fx"])
        assert reports[0].graphs
""")

BROKEN_BACKEND = textwrap.dedent("""
    import specularch

    def broken(gm, example_inputs):
        def run(*args):
            return tuple(o + 1e-3 if o.is_floating_point() else o for o in gm.forward(*args))
        return run

    specularch.register_backend("broken", broken, help="adds 1e-3 to every output (test only)",
                                replace=True)
""")


def test_plugin_compare_mode_passes_a_correct_suite(pytester):
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("--specularch=compare", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*specularch*", "*optimized code objects:*", "*mismatches: 0*"])


def test_plugin_compare_mode_catches_a_broken_backend_selected_by_env(pytester, monkeypatch):
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeconftest(BROKEN_BACKEND)
    monkeypatch.setenv("SPECULARCH_BACKEND", "broken")
    result = pytester.runpytest_subprocess("--specularch=compare", "-p", "no:cacheprovider",
                                           "-k", "model_runs")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*SpecularchMismatch*Model.forward differs from eager*",
                                 "*mismatches: 1*"])


def test_plugin_off_by_default(pytester):
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "model_runs")
    result.assert_outcomes(passed=1)
    assert "optimized code objects" not in result.stdout.str()


@pytest.mark.slow
def test_project_model_suite_passes_in_compare_mode():
    """A real third-party-style suite: the project's own models/ tests, every optimized call
    checked against eager on copies of the state it touches."""
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "pytest", str(root / "tests" / "test_models.py"),
                          "--specularch=compare", "-q", "-p", "no:cacheprovider"],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "mismatches: 0" in out.stdout
    # the workloads (shipped inside the specularch package) count as user code
    optimized = re.search(r"optimized code objects: (\d+), graphs: (\d+)", out.stdout)
    assert optimized and int(optimized[1]) > 0 and int(optimized[2]) > 0, out.stdout[-3000:]


def test_cli_explain_without_a_script_names_only_the_script_as_missing(capsys):
    from specularch.__main__ import main
    with pytest.raises(SystemExit) as exit_info:
        main(["explain"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith("error: the following arguments are required: script"), err
