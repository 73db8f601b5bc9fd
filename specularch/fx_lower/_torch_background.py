"""Compat: compiling on a thread beside the user's program. While a compile runs on the
background thread, two process-wide effects of torch's tracing are skipped on that thread only:
``torch.fx``'s module patches (``torch.fx._symbolic_trace._new_patcher``) and the random-number
state AOT autograd and Inductor put back after tracing (``torch.random.set_rng_state``,
``torch.cuda.set_rng_state``). Both are replaced once, by wrappers that call the original on
every other thread. And ``torch.fx``'s "is tracing" flag, a module global that
``Tracer.trace`` sets while it runs, is answered per thread: a ``torch.compile``'d function
the user's thread calls while the background thread traces would otherwise raise
("Detected that you are using FX to symbolically trace a dynamo-optimized function").
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch


_BACKGROUND = threading.local()  # .active: this thread compiles beside the user's program
_PATCHER_INSTALLED = threading.Lock()


@contextlib.contextmanager
def background_tracing(later: Callable[[Callable[[], None]], None] | None = None):
    """Compiling on a thread beside the user's program. ``torch.fx``'s tracer (which
    ``make_fx``, AOT autograd and Inductor run) patches ``nn.Module.__call__`` and
    ``__getattr__`` process-wide while it traces, so the user's thread would meanwhile call
    every module through the tracer (and a captured graph's guards on ``Module.__call__``
    would fail). On this thread the patches are skipped: ``make_fx``'s tracer traces at the
    dispatcher and inlines every module (its ``call_module`` calls ``forward``, its
    ``getattr`` returns the attribute), so they change nothing it records. Other threads'
    traces patch as before.

    Likewise AOT autograd and Inductor save the global random-number state before tracing
    and put it back after (``torch._dynamo.utils.preserve_rng_state``, which calls
    ``torch.random.set_rng_state``): from this thread that would rewind the generator under
    draws the user's thread made meanwhile, so on this thread putting it back is skipped.
    Graphs that draw random numbers come here only flattened (fake tensors, never run), so
    tracing them draws none (``tiering/policy.py``).
    Also keeps ``script_aten_graph`` off the process-wide warning filters
    (``warnings.catch_warnings`` is not thread-safe). ``later(job)`` runs ``job()`` on the
    background thread afterwards (``compile_later``: what a compiled form built here may ask
    of that thread once it meets what it was not compiled for)."""
    _install_thread_aware_patcher()
    _install_thread_aware_rng_restore()
    _install_thread_aware_tracing_flag()
    _BACKGROUND.active, _BACKGROUND.later = True, later
    try:
        yield
    finally:
        _BACKGROUND.active, _BACKGROUND.later = False, None


def compiling_in_background() -> bool:
    """This thread compiles beside the user's program (``background_tracing``)."""
    return getattr(_BACKGROUND, "active", False)


def compile_later() -> Callable[[Callable[[], None]], None] | None:
    """While compiling in the background: how to run a compile job on that thread later
    (``job()`` must enter ``background_tracing`` itself), or None."""
    return getattr(_BACKGROUND, "later", None)


def _install_thread_aware_rng_restore() -> None:
    with _PATCHER_INSTALLED:
        for module in (torch.random, torch.cuda):
            original = module.set_rng_state
            if getattr(original, "__specularch__", False):
                continue

            def set_rng_state(*args, _original=original, **kwargs):
                if getattr(_BACKGROUND, "active", False):
                    return None
                return _original(*args, **kwargs)
            set_rng_state.__specularch__ = True
            module.set_rng_state = set_rng_state


_TRACING = threading.local()  # .depth: ``Tracer.trace`` calls running on this thread

# What ``is_fx_tracing`` and ``is_fx_symbolic_tracing`` of ``torch.fx._symbolic_trace`` say,
# per thread: their code is replaced (not the functions, which ``torch.compile`` binds when it
# wraps a function), and runs in that module's globals.
_PER_THREAD = """
def is_fx_tracing():
    is_fx_tracing_warning()
    return _specularch_tracing_here()

def is_fx_symbolic_tracing():
    return _specularch_tracing_here() and not torch.compiler.is_compiling()
"""


def _tracing_here() -> bool:
    return getattr(_TRACING, "depth", 0) > 0


def _install_thread_aware_tracing_flag() -> None:
    from torch.fx import _symbolic_trace as st
    with _PATCHER_INSTALLED:
        if getattr(st.Tracer.trace, "__specularch__", False):
            return
        original = st.Tracer.trace

        def trace(self, *args, **kwargs):
            _TRACING.depth = getattr(_TRACING, "depth", 0) + 1
            try:
                return original(self, *args, **kwargs)
            finally:
                _TRACING.depth -= 1
        trace.__specularch__, trace.__wrapped__ = True, original
        trace.__doc__, trace.__name__, trace.__qualname__ = original.__doc__, "trace", original.__qualname__
        st._specularch_tracing_here = _tracing_here
        made: dict = {}
        exec(_PER_THREAD, made)
        for name in ("is_fx_tracing", "is_fx_symbolic_tracing"):
            getattr(st, name).__code__ = made[name].__code__
        st.Tracer.trace = trace


def _install_thread_aware_patcher() -> None:
    from torch.fx import _symbolic_trace as st
    with _PATCHER_INSTALLED:
        if getattr(st._new_patcher, "__specularch__", False):
            return
        original = st._new_patcher

        class NoPatches(st._Patcher):
            def patch(self, *args, **kwargs) -> None:
                pass

            def patch_method(self, *args, **kwargs) -> None:
                pass

        @contextlib.contextmanager
        def no_patches():
            yield NoPatches()

        def new_patcher():
            return no_patches() if getattr(_BACKGROUND, "active", False) else original()
        new_patcher.__specularch__ = True
        st._new_patcher = new_patcher
