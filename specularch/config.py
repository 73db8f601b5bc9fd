"""All of specularch's configuration, in one place.

Each option has a name, a default, help text and (where users expect one) an environment
variable. Options are read as attributes (``config.cache_limit``) and can be changed for a
block with ``with config.patch(cache_limit=2): ...``. Core code never reads ``os.environ``;
this module does, once per option, when the option is first read.
"""
from __future__ import annotations

import contextlib
import difflib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable


class ConfigError(ValueError):
    """A configuration value (usually from an environment variable) is not allowed.

    Example: ``SPECULARCH_CACHE_LIMIT=lots`` raises
    ``ConfigError: SPECULARCH_CACHE_LIMIT='lots' is not valid: expected a positive integer``.
    Fix the variable's value, or unset it to get the default.
    """


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError
    return value


LOG_TOPICS = ("graphs", "guards", "fallbacks", "recompiles", "relaxations")


def _log_topics(text: str) -> frozenset:
    topics = frozenset(t.strip() for t in text.split(",") if t.strip())
    if "all" in topics:
        return frozenset(LOG_TOPICS)
    if not topics <= set(LOG_TOPICS):
        raise ValueError
    return topics


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    help: str
    env: str | None = None
    parse: Callable[[str], Any] = str
    expected: str = "a string"


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in [
        Option("backend", "fx", "Backend that compiles captured graphs (see specularch.list_backends()).",
               "SPECULARCH_BACKEND", str, "a backend name"),
        Option("profile_calls", 3, "Calls of an optimized function that run eagerly while "
               "argument facts are recorded, before the first capture.", "SPECULARCH_PROFILE_CALLS",
               _non_negative_int, "a non-negative integer"),
        Option("cache_limit", 8, "Graphs kept per code object; past this the frame runs eagerly "
               "and a 'cache_limit' fallback is recorded.", "SPECULARCH_CACHE_LIMIT",
               _positive_int, "a positive integer"),
        Option("inline_depth", 48, "Deepest chain of inlined Python calls in one capture.",
               "SPECULARCH_INLINE_DEPTH", _positive_int, "a positive integer"),
        Option("max_instructions", 200_000, "Bytecode instructions one capture may execute "
               "symbolically (bounds unrolled loops).", "SPECULARCH_MAX_INSTRUCTIONS",
               _positive_int, "a positive integer"),
        Option("strict", False, "Raise SpecularchStrictError instead of falling back to eager "
               "or recompiling (for CI).", "SPECULARCH_STRICT", _flag, "one of 1/0/true/false/yes/no/on/off"),
        Option("enabled", False, "Optimize the program globally (the frames the policy picks; "
               "see specularch/policy.py). Read at start-up from the environment.", "SPECULARCH",
               _flag, "one of 1/0/true/false/yes/no/on/off"),
        Option("step_names", frozenset({"train_step", "training_step", "train_one_step", "step_fn",
                                        "eval_step"}),
               "Function names the global switch optimizes as training/eval steps.",
               "SPECULARCH_STEP_NAMES", lambda t: frozenset(n.strip() for n in t.split(",") if n.strip()),
               "a comma-separated list of function names"),
        Option("report", False, "With the global switch, print the explain() report of everything "
               "optimized when the program exits.", "SPECULARCH_REPORT", _flag,
               "one of 1/0/true/false/yes/no/on/off"),
        Option("log", frozenset(), "What to log through the `specularch` logger (INFO level).",
               "SPECULARCH_LOG", _log_topics,
               f"a comma-separated list of {', '.join(LOG_TOPICS)} (or all)"),
        Option("warn_fallbacks", True, "Log one WARNING (logger `specularch`) the first time "
               "each kind of fallback happens at a user line, unless `fallbacks` is logged "
               "anyway; expected assumption failures are not warned about.",
               "SPECULARCH_WARN_FALLBACKS", _flag, "one of 1/0/true/false/yes/no/on/off"),
        Option("raise_internal_errors", False, "Re-raise specularch's own bugs instead of "
               "falling back (for developing specularch).", "SPECULARCH_RAISE_INTERNAL", _flag,
               "one of 1/0/true/false/yes/no/on/off"),
        Option("distributed_bucket_mb", 25.0, "Size in MiB of the gradient buckets a distributed "
               "training step all-reduces during backward (like DDP's bucket_cap_mb; the first "
               "bucket is at most 1 MiB). Every rank must use the same value.",
               "SPECULARCH_BUCKET_MB", _positive_float, "a positive number of MiB"),
        Option("max_fallback_records", 32, "Distinct fallback records kept per code object.",
               None, _positive_int, "a positive integer"),
    ]
}


class _Config(threading.local):
    """Attribute access to the options; values set with ``patch`` are per thread."""

    def __init__(self) -> None:
        self.__dict__["_overrides"] = []

    def _base(self, name: str) -> Any:
        option = OPTIONS[name]
        cache = _BASE_VALUES
        if name not in cache:
            cache[name] = _from_env(option)
        return cache[name]

    def __getattr__(self, name: str) -> Any:
        if name not in OPTIONS:
            raise AttributeError(f"specularch.config has no option {name!r}; options: {sorted(OPTIONS)}")
        for layer in reversed(self._overrides):
            if name in layer:
                return layer[name]
        return self._base(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in OPTIONS:
            raise AttributeError(f"specularch.config has no option {name!r}; options: {sorted(OPTIONS)}")
        _BASE_VALUES[name] = value

    @contextlib.contextmanager
    def patch(self, **values: Any):
        """Temporarily change options in this thread: ``with config.patch(strict=True): ...``."""
        for name in values:
            if name not in OPTIONS:
                raise AttributeError(f"specularch.config has no option {name!r}; options: {sorted(OPTIONS)}")
        self._overrides.append(values)
        try:
            yield self
        finally:
            self._overrides.pop()

    def describe(self) -> str:
        lines = []
        for o in OPTIONS.values():
            env = f" [{o.env}]" if o.env else ""
            lines.append(f"{o.name} = {getattr(self, o.name)!r}{env}: {o.help}")
        return "\n".join(lines)


_BASE_VALUES: dict[str, Any] = {}


def _from_env(option: Option) -> Any:
    if option.env is None or option.env not in os.environ:
        return option.default
    return _parse_env(option, os.environ[option.env])


def _parse_env(option: Option, text: str) -> Any:
    try:
        return option.parse(text)
    except (ValueError, TypeError):
        raise ConfigError(f"{option.env}={text!r} is not valid: expected {option.expected}. "
                          f"Unset it to use the default ({_as_variable(option.default)}).") from None


def _as_variable(default) -> str:
    """A default as the variable would spell it: a set as its comma-separated names."""
    if isinstance(default, frozenset):
        return repr(",".join(sorted(default))) if default else "none"
    return repr(default)


def check_environment(environ=None, backends=None) -> tuple[list[str], list[str]]:
    """``(errors, warnings)`` for the ``SPECULARCH*`` variables of ``environ`` (default
    ``os.environ``), one line each: a value an option rejects, a ``SPECULARCH_BACKEND`` not in
    ``backends`` (checked only when given), a ``SPECULARCH_*`` name no option has (a typo).

    Imports nothing but the standard library: the start-up module runs it before torch can be
    imported (see specularch_boot.py).
    """
    environ = os.environ if environ is None else environ
    by_env = {o.env: o for o in OPTIONS.values() if o.env}
    errors, warnings = [], []
    for name in sorted(environ):
        option = by_env.get(name)
        if option is not None:
            try:
                _parse_env(option, environ[name])
            except ConfigError as e:
                errors.append(str(e))
        elif name.startswith("SPECULARCH_"):
            close = difflib.get_close_matches(name, by_env, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f"; known: {', '.join(sorted(by_env))}"
            warnings.append(f"specularch: ignoring unknown variable {name}{hint}")
    backend = environ.get("SPECULARCH_BACKEND")
    if backends is not None and backend is not None and backend not in backends:
        errors.append(f"SPECULARCH_BACKEND={backend!r} is not valid: expected one of "
                      f"{', '.join(sorted(backends))} (specularch.list_backends()). "
                      f"Unset it to use the default ({OPTIONS['backend'].default!r}).")
    return errors, warnings


config = _Config()
