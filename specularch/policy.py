"""Which frames the global switch (``SPECULARCH=1``) optimizes, so the rest of the program
pays nothing beyond a one-time skip mark per code object:

1. the ``forward`` of a user-defined ``nn.Module`` (not one of torch's own) that is called
   from non-module code — the outermost model call. Modules called inside another module's
   forward are inlined into that forward's graph instead;
2. functions whose name is in ``config.step_names`` (default ``train_step``,
   ``training_step``, ``train_one_step``, ``step_fn``, ``eval_step``): training/eval steps.

The decision is taken the first time the frame hook sees a code object and kept.
"""
from __future__ import annotations

import os
import types

import torch
import torch.nn as nn

from .config import config

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(__file__) + os.sep


def _user_code(code: types.CodeType) -> bool:
    f = code.co_filename
    return not (f.startswith(_TORCH_DIR) or f.startswith(_OWN_DIR) or f.startswith("<"))


def choose(frame, code: types.CodeType):
    """The function to optimize for this frame, or None (skip it from now on)."""
    if not _user_code(code) or code.co_flags & 0x2A0:  # generators/coroutines
        return None
    if code.co_name in config.step_names:
        return _function_for(frame, code)
    if code.co_name == "forward" and code.co_argcount >= 1:
        self = frame.f_locals.get(code.co_varnames[0])
        if isinstance(self, nn.Module) and _called_from_non_module_code(frame):
            return _function_for(frame, code)
    return None


def _called_from_non_module_code(frame) -> bool:
    caller = frame.f_back
    while caller is not None and caller.f_code.co_filename.startswith(_TORCH_DIR):
        caller = caller.f_back  # skip nn.Module.__call__ machinery
    if caller is None:
        return True
    first = caller.f_code.co_varnames[:1]
    self = caller.f_locals.get(first[0]) if first else None
    return not (caller.f_code.co_name == "forward" and isinstance(self, nn.Module))


def _function_for(frame, code: types.CodeType):
    return types.FunctionType(code, frame.f_globals, code.co_name, None, frame.closure)
