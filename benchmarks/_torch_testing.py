"""PyTorch's own module-test database (``torch.testing._internal.common_modules.module_db``),
reached through this one file: it is a private torch API, so a torch upgrade that changes it
touches only this module. Needs ``expecttest`` (``pip install -e .[test]``).

What the corpus needs from it, as plain data: per module class its name, whether training and
eval differ, why torch's own ``TestModule.test_forward`` skips it on CPU (if it does), and the
samples (constructor args, forward args) its ``module_inputs_func`` makes.
"""
from __future__ import annotations

import dataclasses
import unittest
from typing import Any, Callable, Iterator

import torch

# The torch test that the corpus mirrors: its skips and expected failures are ours too.
TEST_CLASS, TEST_NAME = "TestModule", "test_forward"


@dataclasses.dataclass
class Sample:
    """One module input of torch's tests: build ``module_cls(*ctor_args, **ctor_kwargs)``,
    call it with ``(*args, **kwargs)``."""
    desc: str
    ctor_args: tuple
    ctor_kwargs: dict
    args: tuple
    kwargs: dict


@dataclasses.dataclass
class ModuleEntry:
    name: str                       # "nn.Linear"
    module_cls: type
    train_and_eval_differ: bool
    info: Any                       # the ModuleInfo itself, for ``samples``


def module_entries(names: set[str] | None = None) -> list[ModuleEntry]:
    """Every ``ModuleInfo`` of torch's ``module_db`` (or those whose class name, with or
    without ``nn.``, is in ``names``)."""
    from torch.testing._internal.common_modules import module_db
    entries = []
    for info in module_db:
        short = info.module_cls.__name__
        if names is None or short in names or info.name in names:
            entries.append(ModuleEntry(info.name, info.module_cls,
                                       bool(info.train_and_eval_differ), info))
    return entries


def training_modes(entry: ModuleEntry) -> list[bool]:
    """Like torch's ``@modules``: train and eval when they differ, else train only."""
    return [True, False] if entry.train_and_eval_differ else [True]


def cpu_skip_reason(entry: ModuleEntry, training: bool,
                    dtype: torch.dtype = torch.float32) -> str | None:
    """Why torch's own ``test_forward`` does not run ``entry`` on CPU in ``dtype`` (skipped or
    expected to fail), or None when it runs."""
    info = entry.info
    if dtype not in info.supported_dtypes("cpu"):
        return f"{dtype} is not among its CPU dtypes"
    params = {"module_info": info, "training": training, "dtype": dtype}
    for decorator in info.get_decorators(TEST_CLASS, TEST_NAME, "cpu", dtype, params):
        reason = _skips_on_cpu(decorator, dtype)
        if reason:
            return reason
    return None


def _skips_on_cpu(decorator: Callable, dtype: torch.dtype) -> str | None:
    from torch.testing._internal import common_device_type as cdt
    if isinstance(decorator, cdt.skipIf):  # skipCPUIf, skipCUDAIf, skipMeta, ...: per device
        types = decorator.device_type
        on_cpu = types is None or types == "cpu" or (not isinstance(types, str) and "cpu" in types)
        dep = decorator.dep
        return f"skipped: {decorator.reason}" if on_cpu and dep is True else None
    if isinstance(decorator, cdt.expectedFailure):
        if decorator.device_type == "cpu" and decorator.dtype in (None, dtype):
            return "expected to fail on CPU"
        return None
    marked = decorator(lambda: None) if callable(decorator) else None
    if getattr(marked, "__unittest_skip__", False):
        return f"skipped: {getattr(marked, '__unittest_skip_why__', '')}"
    if getattr(marked, "__unittest_expecting_failure__", False) or decorator is unittest.expectedFailure:
        return "expected to fail"
    return None


def samples(entry: ModuleEntry, training: bool, requires_grad: bool = True,
            dtype: torch.dtype = torch.float32) -> Iterator[Sample]:
    """The CPU samples of ``entry``'s ``module_inputs_func`` that have a forward input."""
    for module_input in entry.info.module_inputs_func(entry.info, device="cpu", dtype=dtype,
                                                      requires_grad=requires_grad,
                                                      training=training):
        forward = module_input.forward_input
        if forward is None:
            continue
        ctor = module_input.constructor_input
        yield Sample(module_input.desc, tuple(ctor.args), dict(ctor.kwargs),
                     tuple(forward.args), dict(forward.kwargs))
