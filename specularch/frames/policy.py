"""Which frames the global switch (``SPECULARCH=1``) optimizes, so the rest of the program
pays nothing beyond a one-time skip mark per code object:

1. the outermost module call: the ``forward`` of an ``nn.Module`` (user-defined, or one of
   torch's own such as ``nn.Sequential`` or a bare ``nn.Linear``) called while no other
   module call is running. Modules called inside another module's forward, also through
   helper methods (``self.forward_once(x)``), are inlined into that forward's graph;
2. functions whose name is in ``config.step_names`` (default ``train_step``,
   ``training_step``, ``train_one_step``, ``step_fn``, ``eval_step``): training/eval steps.

The frame hook decides per code object, the first time it sees one, and keeps the decision;
but one ``forward`` code serves every instance of its class (every ``nn.Sequential``), both
as an outermost call and nested. So a module ``forward`` first seen called from user code
(outermost or nested) becomes a target, and the dispatcher asks ``is_outermost_call`` at
each call: only outermost calls are optimized, nested ones run the original (they only get
there through an eager run; a graph has them inlined). A forward first seen called by torch's
own code (the layers inside ``nn.Transformer``), torch's parameter-free modules (``ReLU``, a
loss) and everything else are skip-marked once. Torch's wrappers (``DistributedDataParallel``,
``DataParallel``) are never roots and do not count as module calls: the model they wrap is.

Costs (2-vCPU VM): an outermost call walks the frames above it once (~0.1-0.2 µs a frame);
a nested call of a target made while an outer call runs eagerly (profiling, fallback) costs
~3 µs more (trampoline, then the original); a graph runs no nested frames at all.
"""
from __future__ import annotations

import os
import sys
import threading
import types

import torch
import torch.nn as nn
from torch.nn.modules import module as _module

from .. import dispatch, frames
from .._torch_nn import MODULE_CALL_CODE
from . import interceptor as _interceptor
from ..config import config
from ..eager_run import EagerRun

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(__file__) + os.sep
#: The shipped JANUS workloads (a link to the repository's models/) are user code, not ours.
_WORKLOADS_DIR = os.path.join(_OWN_DIR, "workloads") + os.sep
_WRAPPER_DIRS = tuple(os.path.join(_TORCH_DIR, *p) + os.sep
                      for p in (("nn", "parallel"), ("distributed",)))
_WRAPPER_MODULES = ("torch.nn.parallel", "torch.distributed")
_CONTAINERS_FILE = os.path.join(os.path.dirname(_module.__file__), "container.py")
_GENERATED = "<specularch"  # trampolines' file names
_RESUMABLE = 0x20 | 0x80 | 0x100 | 0x200  # generator, coroutine, iterable coro, async gen


def _own(filename: str) -> bool:
    return filename.startswith(_OWN_DIR) and not filename.startswith(_WORKLOADS_DIR)


def _user_code(code: types.CodeType) -> bool:
    f = code.co_filename
    return not (f.startswith(_TORCH_DIR) or _own(f) or f.startswith("<"))


def choose(frame, code: types.CodeType):
    """The function to optimize for this frame, or None (skip it from now on)."""
    if code.co_flags & _RESUMABLE:
        return None
    if code.co_name in config.step_names and _user_code(code):
        return _function_for(frame, code)
    if code.co_name == "forward" and _candidate_forward(frame, code) \
            and _seen_from_user(_caller_of_hooked_frame()):
        fn = _function_for(frame, code)
        # Registered here (the hook registers it again, a no-op) so the dispatcher can be
        # told to optimize only its outermost calls.
        dispatch.per_call_site(frames.register(fn), _run_if_outermost)
        return fn
    return None


class _Running(threading.local):
    depth = 0  # outermost module calls running in this thread


_running = _Running()


def _run_if_outermost(target, slots: tuple, cells) -> object:
    """The dispatcher's handler for a module forward chosen here: optimize the call only if
    it is the outermost module call, else run the original."""
    # While an outermost call runs (eagerly: a graph runs no Python frames), every module
    # call reaching a target is nested: known without looking at the stack.
    if _running.depth or not is_outermost_call(_caller_of_trampoline(target)):
        return EagerRun(None, target, cells)  # the trampoline runs it (recursion depth)
    _running.depth += 1
    try:
        return dispatch.run(dispatch.state_for(target), slots, cells)
    finally:
        _running.depth -= 1


def _caller_of_trampoline(target):
    f = sys._getframe(2)  # <- dispatch <- _glue <- the trampoline's frame, normally
    while f is not None and f.f_code is not target.trampoline:
        f = f.f_back
    return f.f_back if f is not None else None


def _candidate_forward(frame, code: types.CodeType) -> bool:
    """A module forward that may be worth a graph: not specularch's, generated or a torch
    wrapper's code; for torch's own classes, only instances holding parameters or modules."""
    f = code.co_filename
    if _own(f) or f.startswith("<") or f.startswith(_WRAPPER_DIRS):
        return False
    self = _first_local(frame)
    if not isinstance(self, nn.Module):
        return False
    return _user_code(code) or bool(self._parameters or self._modules)


def _caller_of_hooked_frame():
    """The frame that called the one the hook is asking about. The frame handed to the
    callback has not started and has no ``f_back``; the running Python frames are the
    callback's, then the caller's."""
    f = sys._getframe(1)
    while f is not None and f.f_code is not _interceptor._callback.__code__:
        f = f.f_back
    return f.f_back if f is not None else None


def _seen_from_user(caller) -> bool:
    """Outermost, or nested but called by user code: later calls of the same code may be
    outermost (a bare ``nn.Linear`` probe after a model holding Linears). A forward called
    by torch's own code (inside ``nn.Transformer``) is an internal detail: skipped."""
    if is_outermost_call(caller):
        return True
    caller = _above_own_call(caller)
    while caller is not None and caller.f_code.co_filename == _CONTAINERS_FILE:
        caller = _above_own_call(caller.f_back)  # nn.Sequential runs what the user put in it
    return caller is not None and _user_code(caller.f_code)


def is_outermost_call(caller) -> bool:
    """Whether a module's ``forward`` called from the frame ``caller`` runs while no other
    module call runs.

    Every frame above this call's own ``Module.__call__`` frames is looked at: a module call
    (``module(...)`` or a ``forward`` whose first argument is a module) means this one is
    nested, whatever helper methods (``forward_once``) or functions lie in between; torch's
    wrappers (DDP) do not count.
    """
    f = _above_own_call(caller)
    while f is not None:
        code = f.f_code
        if code is MODULE_CALL_CODE or code.co_name == "forward":
            self = _first_local(f)
            if isinstance(self, nn.Module) and not _is_wrapper(self):
                return False
        f = f.f_back
    return True


def _above_own_call(caller):
    """The first frame, from ``caller`` up, above the ``nn.Module.__call__`` frames (and
    torch decorators such as ``torch.no_grad()`` on the forward) of a forward's call.
    Specularch's own frames (a trampoline, the dispatcher running the original) are looked
    through."""
    f = caller
    while f is not None:
        code = f.f_code
        filename = code.co_filename
        if not (_own(filename) or filename.startswith(_GENERATED)):
            if not filename.startswith(_TORCH_DIR):
                return f
            if code is MODULE_CALL_CODE:
                return f.f_back
            if code.co_name == "forward" and isinstance(_first_local(f), nn.Module):
                return f  # a torch module calling ``self.layer.forward(x)`` directly
        f = f.f_back
    return None


def _first_local(frame):
    code = frame.f_code
    if code.co_argcount < 1:
        return None
    return frame.f_locals.get(code.co_varnames[0])


_wrapper_types: dict[type, bool] = {}


def _is_wrapper(module: nn.Module) -> bool:
    cls = type(module)
    known = _wrapper_types.get(cls)
    if known is None:
        known = _wrapper_types[cls] = any(
            getattr(c, "__module__", "").startswith(_WRAPPER_MODULES) for c in cls.__mro__)
    return known


def _function_for(frame, code: types.CodeType):
    return types.FunctionType(code, frame.f_globals, code.co_name, None, frame.closure)
