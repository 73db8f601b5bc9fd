"""Start-up of the global switch: ``specularch_startup.pth`` calls ``boot()`` at interpreter
start-up only when the ``SPECULARCH`` variable is set. This module imports only the standard
library, because site-packages directories are processed one after another: in a venv made
with ``--system-site-packages`` or with a user-site install, specularch's .pth runs before
the directory holding torch is on ``sys.path``.

``boot()``:

1. checks every ``SPECULARCH*`` variable (``specularch/config.py``, loaded from its file so
   that the package, which imports torch, is not imported yet); a bad value prints one line
   naming the variable and what is allowed, and exits with code 2;
2. if the switch is on and torch is importable now, turns it on at once; otherwise installs a
   one-shot import hook that turns it on right after torch's own module has run (the
   backend name, which needs the backend registry, is checked then).
"""
from __future__ import annotations

import importlib.util
import os
import sys


_booted = False


def boot() -> None:
    global _booted
    if _booted:  # site.py may process a directory's .pth files twice (venvs)
        return
    _booted = True
    config = _config_module()
    if config is None:
        print("specularch: SPECULARCH is set but the specularch package cannot be found; "
              "running unoptimized", file=sys.stderr)
        return
    errors, warnings = config.check_environment()
    for line in warnings:
        print(line, file=sys.stderr)
    if errors:
        _stop(errors[0], at_startup=True)
    if not config.OPTIONS["enabled"].parse(os.environ["SPECULARCH"]):
        return
    if importlib.util.find_spec("torch") is None:
        sys.meta_path.insert(0, _ActivateAfterTorch())
    else:
        _activate(at_startup=True)


def _config_module():
    """specularch/config.py run from its file under a private name (it imports only the
    standard library), without running the package's ``__init__``."""
    package = importlib.util.find_spec("specularch")
    if package is None or not package.submodule_search_locations:
        return None
    path = os.path.join(list(package.submodule_search_locations)[0], "config.py")
    spec = importlib.util.spec_from_file_location("_specularch_boot_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up while building classes
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def _activate(at_startup: bool) -> None:
    from specularch import startup
    from specularch.config import ConfigError
    try:
        startup.from_environment()
    except ConfigError as e:
        _stop(str(e), at_startup)


def _stop(message: str, at_startup: bool) -> None:
    print(f"specularch: {message}", file=sys.stderr)
    sys.stderr.flush()
    if at_startup:
        # site.py reports a SystemExit raised by a .pth line as a fatal error (exit code 1).
        sys.stdout.flush()
        os._exit(2)
    raise SystemExit(2)


class _ActivateAfterTorch:
    """Meta-path finder used once: the other finders find torch, and its loader is wrapped
    so that the switch turns on right after torch's module has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None  # not importable yet either: keep waiting
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenActivate(spec.loader)
        return spec


class _ThenActivate:
    """torch's own loader, then the switch."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        # torch sees its real loader (importlib.resources, inspect and pickle ask for it).
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _activate(at_startup=False)

    def __getattr__(self, name):
        return getattr(self.loader, name)
