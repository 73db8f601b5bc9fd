"""The code base is lint-clean: ``ruff check`` with the rules in pyproject.toml (pyflakes and a few
error classes; an undefined name in a rarely taken branch once became an internal_error fallback)."""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    try:
        import ruff  # noqa: F401  (installed by the 'test' extra)
    except ImportError:
        exe = shutil.which("ruff")
        if exe is None:
            pytest.fail("ruff is not installed: pip install '.[test]' installs it")
        return [exe]
    return [sys.executable, "-m", "ruff"]


def test_ruff_check_is_clean():
    out = subprocess.run([*_ruff(), "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
