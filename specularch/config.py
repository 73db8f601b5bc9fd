"""All of specularch's configuration, in one place.

Each option has a name, a default, help text, a kind (what values it takes) and (where users
expect one) an environment variable. Options are read as attributes (``config.cache_limit``),
set with ``config.cache_limit = 2`` and changed for a block with
``with config.patch(cache_limit=2): ...``; a value set from Python is checked by the same
kind as the variable's text, so a wrong value is a ``ConfigError`` at once, not a failure in
some later call. Core code never reads ``os.environ``; this module reads every variable at
once, at specularch's first use (the first read of any option, or ``optimize()``).
"""
from __future__ import annotations

import contextlib
import difflib
import math
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable


class ConfigError(ValueError):
    """A configuration value (an environment variable or one set from Python) is not allowed.

    Example: ``SPECULARCH_CACHE_LIMIT=lots`` raises
    ``ConfigError: SPECULARCH_CACHE_LIMIT='lots' is not valid: expected a positive integer``
    at specularch's first use, and ``specularch.config.cache_limit = -1`` raises
    ``ConfigError: specularch.config.cache_limit=-1 (int) is not valid: expected a positive
    int``. Fix the value, or unset the variable to get the default.
    """


class UnknownOptionError(ConfigError, AttributeError):
    """``config.cach_limit`` / ``config.patch(cach_limit=2)``: no such option (an
    AttributeError too, so ``getattr(config, name, default)`` keeps working)."""


@dataclass(frozen=True)
class Kind:
    """The values one option takes. ``parse`` reads its variable's text, ``check`` takes a
    Python value and returns what is stored (a variable's parsed text goes through ``check``
    too); both raise ValueError or TypeError for a value that is not allowed. ``expected`` and
    ``expected_value`` say what is allowed, for the variable and from Python."""

    expected: str
    expected_value: str
    parse: Callable[[str], Any]
    check: Callable[[Any], Any]


def _int_at_least(low: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):  # True is an int to Python
            raise TypeError
        if value < low:
            raise ValueError
        return int(value)
    return check


def _positive_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError
    if not 0 < value < math.inf:
        raise ValueError
    return float(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError
    return value


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


def _comma_list(text: str) -> frozenset:
    return frozenset(t.strip() for t in text.split(",") if t.strip())


def _names(value: Any) -> frozenset:
    """A set of non-empty strings; one string is refused (it is not split, nor iterated)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (set, frozenset, list, tuple)):
        raise TypeError
    if not all(isinstance(n, str) and n for n in value):
        raise ValueError
    return frozenset(value)


LOG_TOPICS = ("graphs", "guards", "fallbacks", "recompiles", "relaxations")


def _log_topics(value: Any) -> frozenset:
    topics = _names(value)
    if "all" in topics:
        return frozenset(LOG_TOPICS)
    if not topics <= set(LOG_TOPICS):
        raise ValueError
    return topics


def _backend_name(value: Any) -> str:
    # Whether it is registered is checked where the registry is known (``_check_registered``,
    # ``check_environment(backends=...)``): this module runs before torch can be imported.
    if not isinstance(value, str):
        raise TypeError
    if not value.strip():
        raise ValueError
    return value


_FLAG_TEXT = "one of 1/0/true/false/yes/no/on/off"
POSITIVE_INT = Kind("a positive integer", "a positive int", int, _int_at_least(1))
NON_NEGATIVE_INT = Kind("a non-negative integer", "a non-negative int", int,
                        _int_at_least(0))
POSITIVE_MIB = Kind("a positive number of MiB", "a positive int or float (MiB)", float,
                    _positive_number)
FLAG = Kind(_FLAG_TEXT, "True or False", _flag, _bool)
FUNCTION_NAMES = Kind("a comma-separated list of function names",
                      "a set (or list/tuple) of function names (str)", _comma_list, _names)
LOG = Kind(f"a comma-separated list of {', '.join(LOG_TOPICS)} (or all)",
           f"a set (or list/tuple) of {', '.join(map(repr, LOG_TOPICS))} (or {{'all'}})",
           _comma_list, _log_topics)
TEMPLATE_MODES = ("batched", "exact", "off")


def _template_mode(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError
    if value not in TEMPLATE_MODES:
        raise ValueError
    return value


def _cache_dir(value: Any) -> str:
    # An absolute directory only: a relative one would follow the working directory.
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError
    if value.lower() in ("auto", "off"):
        return value.lower()
    if not (os.path.isabs(value) or value.startswith("~")):
        raise ValueError
    return value


CACHE_DIR = Kind("an absolute directory, auto or off",
                 "an absolute directory (str or path), 'auto' or 'off'", str.strip, _cache_dir)
TEMPLATES = Kind("one of batched/exact/off", "'batched', 'exact' or 'off'", str.strip,
                 _template_mode)
POSITIVE_SECONDS = Kind("a positive number of seconds", "a positive int or float (seconds)", float,
                        _positive_number)
BACKEND = Kind("a backend name", "a registered backend name (str; specularch.list_backends())",
               str, _backend_name)


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    help: str
    env: str | None
    kind: Kind

    @property
    def expected(self) -> str:
        return self.kind.expected

    def parse(self, text: str) -> Any:
        """The value of the variable's ``text`` (ValueError/TypeError if it is not allowed)."""
        return self.kind.check(self.kind.parse(text))


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in [
        Option("backend", "auto", "Backend that compiles captured graphs (see "
               "specularch.list_backends()); 'auto': tiered, each graph starts on 'fx' and a hot "
               "one is compiled in the background by the compiling backends and kept on the "
               "fastest, measured on live calls (specularch/tiering/).", "SPECULARCH_BACKEND",
               BACKEND),
        Option("tier_min_hits", 10, "With backend 'auto': calls of a graph before it may be "
               "compiled in the background (tier_min_seconds must be reached too).",
               "SPECULARCH_TIER_MIN_HITS", POSITIVE_INT),
        Option("tier_min_seconds", 0.2, "With backend 'auto': CPU seconds a graph's calls must "
               "have taken in all before it is compiled in the background (small graphs stay on "
               "'fx').", "SPECULARCH_TIER_MIN_SECONDS", POSITIVE_SECONDS),
        Option("tier_trial_calls", 5, "With backend 'auto': calls per side and round when a "
               "compiled candidate is timed against the graph's current tier on live calls "
               "(3 rounds, interleaved; medians).", "SPECULARCH_TIER_TRIAL_CALLS", POSITIVE_INT),
        Option("tune_malloc", True, "Before the first graph of a compiling backend runs (with "
               "backend 'auto': before the first compiled candidate is timed), fix glibc "
               "malloc's mmap and trim thresholds at the top of glibc's own adaptive range (32 "
               "and 64 MiB), where its adaptation left compiled code paging memory in on every "
               "call; not where the program set MALLOC_*_ variables or preloaded another "
               "allocator (specularch/_glibc_malloc.py).", "SPECULARCH_TUNE_MALLOC", FLAG),
        Option("profile_calls", 3, "Calls of an optimized function that run eagerly while "
               "argument facts are recorded, before the first capture.", "SPECULARCH_PROFILE_CALLS",
               NON_NEGATIVE_INT),
        Option("cache_limit", 8, "Graphs kept per code object; past this the frame runs eagerly "
               "and a 'cache_limit' fallback is recorded.", "SPECULARCH_CACHE_LIMIT", POSITIVE_INT),
        Option("inline_depth", 48, "Deepest chain of inlined Python calls in one capture.",
               "SPECULARCH_INLINE_DEPTH", POSITIVE_INT),
        Option("max_instructions", 200_000, "Bytecode instructions one capture may execute "
               "symbolically (bounds unrolled loops).", "SPECULARCH_MAX_INSTRUCTIONS", POSITIVE_INT),
        Option("templates", "batched", "Recursion templates and rolled loops: 'batched' "
               "(instances of one recursion path run together by wavefront, and what a rolled "
               "loop's body computes only for the values it appends runs once after the loop on "
               "all iterations; equal to eager within float rounding), 'exact' (templates and "
               "rolled loops in eager's exact order; bit-identical), 'off' (unroll each "
               "recursive structure into its own graph).", "SPECULARCH_TEMPLATES", TEMPLATES),
        Option("strict", False, "Raise SpecularchStrictError instead of falling back to eager "
               "or recompiling (for CI).", "SPECULARCH_STRICT", FLAG),
        Option("enabled", False, "Optimize the program globally (the frames the policy picks; "
               "see specularch/frames/policy.py). Read at start-up from the environment.", "SPECULARCH",
               FLAG),
        Option("step_names", frozenset({"train_step", "training_step", "train_one_step", "step_fn",
                                        "eval_step"}),
               "Function names the global switch optimizes as training/eval steps.",
               "SPECULARCH_STEP_NAMES", FUNCTION_NAMES),
        Option("report", False, "With the global switch, print the explain() report of everything "
               "optimized when the program exits.", "SPECULARCH_REPORT", FLAG),
        Option("log", frozenset(), "What to log through the `specularch` logger (INFO level).",
               "SPECULARCH_LOG", LOG),
        Option("warn_fallbacks", True, "Log one WARNING (logger `specularch`) the first time "
               "each kind of fallback happens at a user line, unless `fallbacks` is logged "
               "anyway; expected assumption failures are not warned about.",
               "SPECULARCH_WARN_FALLBACKS", FLAG),
        Option("raise_internal_errors", False, "Re-raise specularch's own bugs instead of "
               "falling back (for developing specularch).", "SPECULARCH_RAISE_INTERNAL", FLAG),
        Option("distributed_bucket_mb", 25.0, "Size in MiB of the gradient buckets a distributed "
               "training step all-reduces during backward (like DDP's bucket_cap_mb; the first "
               "bucket is at most 1 MiB). Every rank must use the same value.",
               "SPECULARCH_BUCKET_MB", POSITIVE_MIB),
        Option("compile_cache_dir", "auto", "Directory of the persistent compile cache: "
               "TorchScript graphs saved there, Inductor's packages and own on-disk caches, and the "
               "candidates tiering rejected, so a second run starts with the first run's "
               "compiled code and skips its losers; 'auto' is "
               "$XDG_CACHE_HOME/specularch (default ~/.cache/specularch), 'off' disables it.",
               "SPECULARCH_CACHE_DIR", CACHE_DIR),
        Option("max_fallback_records", 32, "Distinct fallback records kept per code object.",
               None, POSITIVE_INT),
    ]
}


# Whether the program chose Inductor's cache directory itself: read when specularch is
# imported, since importing Inductor sets the variable to its default directory.
INDUCTOR_DIR_CHOSEN = "TORCHINDUCTOR_CACHE_DIR" in os.environ


def cache_directory() -> str | None:
    """``config.compile_cache_dir`` as a path (``auto`` resolved), or None when it is off."""
    value = config.compile_cache_dir
    if value == "off":
        return None
    if value == "auto":
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "specularch")
    return os.path.abspath(os.path.expanduser(value))


def _option(name: str) -> Option:
    option = OPTIONS.get(name)
    if option is None:
        close = difflib.get_close_matches(name, OPTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownOptionError(f"specularch.config has no option {name!r}{hint}; "
                                 f"options: {', '.join(sorted(OPTIONS))}")
    return option


def checked(name: str, value: Any) -> Any:
    """``value`` as option ``name`` stores it (a list of log topics becomes a frozenset), or
    ``ConfigError`` naming the option and what it allows."""
    option = _option(name)
    try:
        value = option.kind.check(value)
    except (TypeError, ValueError):
        raise ConfigError(f"specularch.config.{name}={value!r} ({type(value).__name__}) is not "
                          f"valid: expected {option.kind.expected_value}") from None
    if option.kind is BACKEND:
        _check_registered(value)
    return value


def _check_registered(name: str) -> None:
    from specularch.fx_lower import list_backends  # (absolute: also loaded as a bare file)
    backends = list_backends()
    if name not in backends:
        raise ConfigError(f"specularch.config.backend={name!r} is not valid: expected one of "
                          f"{', '.join(sorted(backends))} (specularch.list_backends(); "
                          f"register_backend() adds one)")


class _Config(threading.local):
    """Attribute access to the options; values set with ``patch`` are per thread, values
    assigned (``config.strict = True``) are for every thread."""

    def __init__(self) -> None:
        self.__dict__["_overrides"] = []

    def _base(self, name: str) -> Any:
        try:
            return _BASE_VALUES[name]
        except KeyError:
            load_environment()
            return _BASE_VALUES[name]

    def __getattr__(self, name: str) -> Any:
        _option(name)
        for layer in reversed(self._overrides):
            if name in layer:
                return layer[name]
        return self._base(name)

    def __setattr__(self, name: str, value: Any) -> None:
        _BASE_VALUES[name] = checked(name, value)

    @contextlib.contextmanager
    def patch(self, **values: Any):
        """Temporarily change options in this thread: ``with config.patch(strict=True): ...``."""
        layer = {name: checked(name, value) for name, value in values.items()}
        self._overrides.append(layer)
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


def load_environment() -> None:
    """Read every option's variable now: the first read of any option (and ``optimize()``)
    does, so a bad ``SPECULARCH_*`` value is one ``ConfigError`` at specularch's first use,
    whichever option that use reads, the same one-line message the global switch prints (and
    again at each use until it is fixed). An unknown ``SPECULARCH_*`` name is warned about
    once. Options already assigned from Python keep their value."""
    if len(_BASE_VALUES) == len(OPTIONS):
        return
    errors, unknown = check_environment()
    if errors:
        raise ConfigError(errors[0])
    for line in unknown:
        warnings.warn(line, stacklevel=2)
    for option in OPTIONS.values():
        if option.name not in _BASE_VALUES:
            _BASE_VALUES[option.name] = _from_env(option)


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


def backend_error(name: str, backends) -> str:
    """The message for ``SPECULARCH_BACKEND=name`` when ``name`` is not in ``backends``."""
    return (f"SPECULARCH_BACKEND={name!r} is not valid: expected one of "
            f"{', '.join(sorted(backends))} (specularch.list_backends()). "
            f"Unset it to use the default ({OPTIONS['backend'].default!r}).")


def check_environment(environ=None, backends=None) -> tuple[list[str], list[str]]:
    """``(errors, warnings)`` for the ``SPECULARCH*`` variables of ``environ`` (default
    ``os.environ``), one line each: a value an option rejects, a ``SPECULARCH_BACKEND`` not in
    ``backends`` (checked only when given), a ``SPECULARCH_*`` name no option has (a typo).

    Imports nothing but the standard library: the start-up module runs it before torch can be
    imported (see specularch_boot.py).
    """
    environ = os.environ if environ is None else environ
    by_env = {o.env: o for o in OPTIONS.values() if o.env}
    errors, warnings_ = [], []
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
            warnings_.append(f"specularch: ignoring unknown variable {name}{hint}")
    backend = environ.get("SPECULARCH_BACKEND")
    if backends is not None and backend is not None and backend not in backends:
        errors.append(backend_error(backend, backends))
    return errors, warnings_


config = _Config()
