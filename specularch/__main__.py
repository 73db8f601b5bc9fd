"""``python -m specularch explain script.py [args...]``: run a script under the global
switch and print the report of everything specularch optimized when it exits."""
from __future__ import annotations

import argparse
import os
import runpy
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specularch")
    sub = parser.add_subparsers(dest="command", required=True)
    explain = sub.add_parser("explain", help="run a script optimized and report what happened",
                             usage="python -m specularch explain [-h] script [args ...]")
    # ``script`` is optional to argparse only so that a missing one is not reported as
    # "required: script, args" (argparse counts an empty REMAINDER as missing).
    explain.add_argument("script", nargs="?")
    explain.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    options = parser.parse_args(argv)
    if options.script is None:
        explain.error("the following arguments are required: script")
    if not os.path.exists(options.script):  # as `python script.py` says it, before anything runs
        print(f"python -m specularch explain: can't open file {options.script!r}: "
              "no such file", file=sys.stderr)
        return 2
    from . import startup
    from .config import ConfigError
    try:
        startup.check_environment()
    except ConfigError as e:
        print(f"specularch: {e}", file=sys.stderr)
        return 2
    if not startup.activate():
        return 1
    sys.argv = [options.script, *options.args]
    # As ``python script.py`` does: the script's folder, not the current one, comes first.
    sys.path[0] = os.path.dirname(os.path.realpath(options.script))
    try:
        runpy.run_path(options.script, run_name="__main__")
    finally:
        startup.print_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
