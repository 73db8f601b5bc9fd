"""The commit as generated code: rebuild records become expressions, write records become
statements, and the helpers those statements call are handed to the entry's namespace.

Discarding is the absence of this code: the entry returns before its commit when a guard or
an in-graph assertion fails, so nothing the call wrote reaches a real object.
"""
from __future__ import annotations

import builtins
import types
from typing import Any, Callable

import torch

from ..fx_lower._torch_foreach import foreach_copy_
from ..guards.guard import const_name
from .rebuild import Rebuild
from .checks import NAMESPACE as _CHECK_NAMESPACE
from .replay import NAMESPACE as _FOREACH_NAMESPACE, replay_lines
from .writes import ReplayTensor, SetGrad, UpdateTensor, Write

_TENSOR_WRITES = (UpdateTensor, ReplayTensor)


def _literal(value: Any) -> bool:
    if type(value) in (int, str, bool, type(None)):
        return True
    if type(value) is float:
        return value == value and value not in (float("inf"), float("-inf"))
    return False


class Renderer:
    """What rendering one entry shares: source names, constants, and the statements that
    build objects made in the call (``prelude``) and numbers (``numbers``) before the commit."""

    def __init__(self, namer, consts: dict[str, Any]):
        self.namer = namer
        self.consts = consts
        self.prelude: list[str] = []   # statements run after the graph, before the commit
        self.numbers: list[str] = []   # numbers computed after the graph, before the prelude
        self.clocks: dict[int, tuple] = {}  # clock reads: seq -> (function, "before"/"after")
        self.checks: list[str] = []    # run before the commit's first write (checks.py)
        self._made: dict[Any, str] = {}

    def const(self, value: Any) -> str:
        return const_name(self.consts, value)

    def literal(self, value: Any) -> str:
        return repr(value) if _literal(value) else self.const(value)

    key = literal  # a dict key: a constant, written inline when it prints as itself

    def expr(self, record: Rebuild) -> str:
        return record.render(self)

    def bound(self, record: Rebuild) -> str:
        """``record``'s value, computed once among the checks (``v0 = R[3]``): a check and
        its write see the same object, and no value is built twice."""
        return self.once(("value", id(record)), "v", lambda r: r.expr(record), self.checks)

    def once(self, key: Any, prefix: str, make: Callable[["Renderer"], str], into: list) -> str:
        """A local bound once per ``key`` (``t0 = [...]``), so two uses are one object."""
        if key not in self._made:
            text = make(self)
            var = f"{prefix}{len(self._made)}"
            into.append(f"{var} = {text}")
            self._made[key] = var
        return self._made[key]


def check_lines(render: Renderer, writes: list[Write]) -> list[str]:
    """What runs before the commit's other writes: the values of the writes that can raise,
    the checks that they will not (``checks.py``), then the gradient assignments, which undo
    themselves when torch refuses one. Either failure leaves every object as it was."""
    stored: set = set()
    for w in writes:
        line = w.check(render, stored)
        if line is not None:
            render.checks.append(line)
    grads = [w for w in writes if isinstance(w, SetGrad)]
    return render.checks + (grad_commit(render, grads) if grads else [])


def commit_lines(render: Renderer, writes: list[Write], plain_tensors: bool) -> list[str]:
    """The commit: every write in program order, the tensor updates first as one block (the
    gradients were assigned by ``check_lines``, whose lines run first)."""
    lines = [w.render(render) for w in writes if not isinstance(w, (*_TENSOR_WRITES, SetGrad))]
    tensors = [w for w in writes if isinstance(w, _TENSOR_WRITES)]
    if tensors:
        lines[:0] = tensor_commit(render, tensors, plain_tensors)
    return lines


def grad_commit(render: Renderer, writes: list) -> list[str]:
    """The gradient assignments, in program order, before any other write: torch refuses a
    wrong one without writing it, and ``checks.set_grads`` then puts back the ones it made.
    They commute with the other writes: those read no ``.grad`` at commit (every source was
    read before the graph)."""
    targets = "".join(f"{render.expr(w.target)}, " for w in writes)
    values = "".join(f"{render.expr(w.value)}, " for w in writes)
    return [f"SET_GRADS(({targets}), ({values}))"]


def tensor_commit(render: Renderer, writes: list, plain: bool) -> list[str]:
    """The copies of the graph's final values into the tensors written in place
    (``UpdateTensor``), then the in-place ops the commit replays itself (``ReplayTensor``).
    The order between the two does not matter: a replay reads no memory the commit writes
    (``symbolic/commit_inplace.py``)."""
    copies = [w for w in writes if isinstance(w, UpdateTensor)]
    replays = [w for w in writes if isinstance(w, ReplayTensor)]
    return (_copy_lines(render, copies, plain) if copies else []) + replay_lines(render, replays, plain)


def _copy_lines(render: Renderer, writes: list[UpdateTensor], plain: bool) -> list[str]:
    """The statements that copy the graph's final values into the tensors written in place.

    Each write leaves its target's autograd version counter where eager leaves it: ``bumps``
    higher (the in-place ops eager ran on it, counted at capture). ``copy_`` bumps it once; a
    tensor eager wrote without a bump (batch_norm's running stats) is copied through ``.data``
    (same memory, its own counter), so a graph that autograd saved it for (the first call of
    a siamese model) still runs backward."""
    targets = values = ""
    extra: list[str] = []
    for w in writes:
        target = render.expr(w.target)
        targets += f"{target}.data, " if w.bumps == 0 else f"{target}, "
        values += f"{render.expr(w.value)}, "
        extra += [target] * max(w.bumps - 1, 0)
    copy = "FOREACH_COPY_ALL" if plain else "COPY_ALL"
    lines = [f"{copy}(({targets}), ({values}))"]
    if extra:
        lines.append(f"BUMP_VERSIONS(({', '.join(extra)}, ))")
    return lines


def _new_object(cls: type, attrs: dict) -> Any:
    """An object created during the call, rebuilt with the attributes it ended up with."""
    obj = cls.__new__(cls)
    for name, value in attrs.items():
        if isinstance(getattr(cls, name, None), types.MemberDescriptorType):
            object.__setattr__(obj, name, value)  # a __slots__ field
        else:
            obj.__dict__[name] = value
    return obj


def as_inference(t: torch.Tensor) -> torch.Tensor:
    """``t`` (computed by the graph under no_grad where eager ran ``inference_mode()``) as
    the inference tensor eager returns: the same storage, sizes and strides, no copy."""
    if t.is_inference():
        return t
    if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_conj() or t.is_neg():
        raise TypeError("as_inference: not a plain strided tensor")  # the call runs eagerly
    with torch.inference_mode():
        out = torch.empty(0, dtype=t.dtype, device=t.device)
        return out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def _replace_dict(target: dict, items: dict) -> None:
    target.clear()
    target.update(items)


def _copy_all(targets: tuple, values: tuple) -> None:
    with torch.no_grad():
        for target, value in zip(targets, values):
            target.copy_(value)


def _foreach_copy_all(targets: tuple, values: tuple) -> None:
    """``_copy_all`` as one call: ``_foreach_copy_`` runs ``copy_`` per pair in order on CPU
    (each target's version counter bumped, dtypes converted, values broadcast) without a
    Python loop; used when every tensor of the graph is a plain Tensor or Parameter (a
    subclass would see one foreach call instead of its own ``copy_``)."""
    with torch.no_grad():
        foreach_copy_(targets, values)


# The names the rendered records call, for the entry's namespace.
COMMIT_NAMESPACE: dict[str, Any] = dict(
    NEW=_new_object, REPLACE_DICT=_replace_dict, COPY_ALL=_copy_all,
    FOREACH_COPY_ALL=_foreach_copy_all, BUMP_VERSIONS=torch.autograd.graph.increment_version,
    AS_INFERENCE=as_inference, PRINT=builtins.print, FORMAT=builtins.format,
    STR=str, REPR=repr, ASCII=ascii, NO_GRAD=torch.no_grad, **_FOREACH_NAMESPACE,
    **_CHECK_NAMESPACE)
