"""The global switch: ``SPECULARCH=1 python train.py`` optimizes an unmodified program.

``from_environment()`` is run at interpreter start-up through the ``specularch_startup.pth``
file that the package installs and the torch-free ``specularch_boot`` module (only when the
``SPECULARCH`` variable is set; otherwise the .pth line imports nothing), at once or, when
torch is not importable yet, right after torch is imported. ``activate()`` turns the frame
hook on in the main thread and lets ``policy.choose`` pick the frames to optimize. Threads
started later are not hooked (the hook is per thread): call ``specularch.startup.activate()``
in a thread to cover it.
"""
from __future__ import annotations

import atexit
import sys

from . import dispatch, frames
from .frames import policy
from .config import ConfigError, config
from .config import check_environment as check_variables
from .fx_lower import list_backends
from .explain import explain_state

_active = False


def activate(report_at_exit: bool = False) -> bool:
    """Turn the global switch on in this thread (idempotent). Returns whether it is on."""
    global _active
    if frames.hook_unavailable_reason() is not None:
        print(f"specularch: global switch unavailable: {frames.hook_unavailable_reason()}",
              file=sys.stderr)
        return False
    frames.set_auto_target(policy.choose)
    frames.enable_globally()
    if not _active:  # switch the hook off before interpreter teardown empties modules
        atexit.register(frames.disable_globally)
    if report_at_exit and not _active:
        atexit.register(_print_report_unless_printed)
    _active = True
    return True


def check_environment() -> None:
    """Raise ``ConfigError`` for the first bad ``SPECULARCH*`` variable, the backend name
    (against the registered backends) included."""
    errors, _ = check_variables(backends=list_backends())
    if errors:
        raise ConfigError(errors[0])


def from_environment() -> None:
    """Called at start-up (``specularch_boot``) when ``SPECULARCH`` is set: check every
    variable, then activate if the switch is on."""
    check_environment()
    if config.enabled:
        activate(report_at_exit=config.report)


def report() -> str:
    """Reports of every code object the global switch (or optimize) ran."""
    states = [s for s in dispatch.all_states() if s.stats.calls]
    if not states:
        return "specularch: nothing was optimized (no frame matched the policy; see specularch/frames/policy.py)"
    return "\n\n".join(str(explain_state(s)) for s in states)


_printed = False


def print_report() -> None:
    global _printed
    _printed = True
    print("\n" + report(), file=sys.stderr)


def _print_report_unless_printed() -> None:
    # `SPECULARCH_REPORT=1 python -m specularch explain ...`: explain has printed it already.
    if not _printed:
        print_report()
