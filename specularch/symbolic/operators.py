"""Python operator semantics over values: arithmetic, comparison, identity, truth,
subscripts, membership and iteration.

Rule of thumb: anything touching a tensor becomes a graph node (``tracer.call_op``);
anything made only of constants is computed right now with real Python; containers built
during capture are handled item by item; anything else is ``Unsupported``.
"""
from __future__ import annotations

import operator

import torch
import torch.nn as nn

from ..guards import DictKeysGuard
from ..guards.sources import ModuleDictSource
from ..records import Unsupported
from .exceptions import python_error
from .values import symint
from .rolled import objects as rolled_objects
from .speculation import item_args, untracked
from .values.symint import SymV
from .values.scalar import ScalarV
from .models import MODELS
from .values import (ConstV, DictV, DictViewV, FuncV, GradModeV, IterV, ListV, MethodV, ModuleSliceV, NewObjV, ObjV, SetV,
                     TensorV, TupleV, UntrackedContainerV, Value, contains_tensor, is_const, kind)
from ..guards.sources import AttrSource
from .attrs import load_attr
from .calls import call

# BINARY_OP's argument -> (operator, symbol); 13.. are the in-place forms (dis._nb_ops order).
_NB = [(operator.add, "+"), (operator.and_, "&"), (operator.floordiv, "//"),
       (operator.lshift, "<<"), (operator.matmul, "@"), (operator.mul, "*"),
       (operator.mod, "%"), (operator.or_, "|"), (operator.pow, "**"), (operator.rshift, ">>"),
       (operator.sub, "-"), (operator.truediv, "/"), (operator.xor, "^")]
_INPLACE = [operator.iadd, operator.iand, operator.ifloordiv, operator.ilshift, operator.imatmul,
            operator.imul, operator.imod, operator.ior, operator.ipow, operator.irshift,
            operator.isub, operator.itruediv, operator.ixor]
BINARY_OPS = [op for op, _ in _NB] + _INPLACE
COMPARE_OPS = {"<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
               ">": operator.gt, ">=": operator.ge}

_SEQUENCE_MODULES = (nn.Sequential, nn.ModuleList, nn.ParameterList)


def concrete_op(tracer, fn, *values: Value) -> Value:
    """Apply ``fn`` to constant values now; an exception means eager would raise too."""
    try:
        result = fn(*[v.concrete() for v in values])
    except Unsupported:  # forcing a lazy string (printing.StrV) falls back with its own kind
        raise
    except Exception as e:
        raise python_error(e.with_traceback(None), f"{getattr(fn, '__name__', fn)} raised "
                           f"{type(e).__name__} during capture: {e}") from None
    return tracer.wrap_python(result)


def _no_item_values(*values: Value) -> None:
    for v in values:
        if isinstance(v, ScalarV):
            v.concrete()  # raises: computing on `.item()` reads tensor data in Python


def binary(tracer, op, a: Value, b: Value) -> Value:
    text = MODELS.format_binary(op, a, b)  # "%.4f" % loss.item(), "loss " + s: formatted at commit
    if text is not None:
        return text
    number = MODELS.deferred_binary(op, a, b)  # running = 0.9 * running + r.item(): computed at commit
    if number is not None:
        return number
    if isinstance(a, TensorV) or isinstance(b, TensorV):  # `.item()` values: item_args.py
        return tracer.call_op("call_function", op, [a, b], {})
    _no_item_values(a, b)
    made = MODELS.stdlib_binary(tracer, op, a, b)  # a deque or Counter operand
    if made is not None:
        return made
    if (isinstance(a, SymV) or isinstance(b, SymV)) and op in symint.ARITHMETIC \
            and symint.is_symbolic_operand(a) and symint.is_symbolic_operand(b):
        return symint.arithmetic(tracer, op, a, b)
    if is_const(b) and is_const(a):  # (b first: a rolled loop's `outputs += [y]` reads no item of a)
        if op in _INPLACE and isinstance(a, (ListV, DictV, SetV)):
            return _inplace_container(tracer, op, a, b)
        return concrete_op(tracer, op, a, b)
    if isinstance(a, (TupleV, ListV)) and isinstance(b, (TupleV, ListV, ConstV)):
        return _sequence_op(tracer, op, a, b)
    if contains_tensor(a) or contains_tensor(b):
        if isinstance(a, (TupleV, ListV)) or isinstance(b, (TupleV, ListV)):
            return _sequence_op(tracer, op, a, b)
    raise Unsupported("unsupported_call",
                      f"operator {op.__name__} on {kind(a)} and {kind(b)} is not supported")


def _sequence_op(tracer, op, a, b) -> Value:
    if op in (operator.add, operator.iadd) and isinstance(b, (TupleV, ListV, ConstV)):
        b_items = b.items if not isinstance(b, ConstV) else [tracer.wrap_python(x) for x in b.value]
        if op is operator.iadd and isinstance(a, ListV):
            ensure_local(tracer, a, "+=")
            a.items.extend(b_items)
            return a
        if isinstance(a, ListV):
            return ListV(a.items + list(b_items))
        return TupleV(a.items + list(b_items))
    if op in (operator.mul, operator.imul) and isinstance(b, ConstV) and isinstance(b.value, int):
        if op is operator.imul and isinstance(a, ListV):  # ``lst *= 2``: the list itself, as eager
            ensure_local(tracer, a, "*=")
            a.items[:] = a.items * b.value
            return a
        items = a.items * b.value
        return ListV(items) if isinstance(a, ListV) else TupleV(items)
    raise Unsupported("unsupported_call", f"operator {op.__name__} on {kind(a)} and {kind(b)}")


def _inplace_container(tracer, op, a, b) -> Value:
    ensure_local(tracer, a, f"{op.__name__}")
    result = concrete_op(tracer, op, a, b)
    if isinstance(a, ListV):
        a.items[:] = result.items
    elif isinstance(a, DictV):
        a.items.clear()
        a.items.update(result.items)
    else:
        a.items.clear()
        a.items.update(result.items)
    return a


def ensure_local(tracer, container: Value, what: str) -> None:
    """Before mutating ``container``: if it existed before the call, log it in the shadow
    heap so its final contents are committed after the call succeeds."""
    if container.source is None:
        return
    if isinstance(container, (ListV, DictV)):
        tracer.heap.touch_container(container, tracer.where())
        return
    raise Unsupported("side_effect",
                      f"`{what}` mutates {container.source}, which existed before the call")


def compare(tracer, symbol: str, a: Value, b: Value) -> Value:
    op = COMPARE_OPS[symbol]
    if isinstance(a, TensorV) or isinstance(b, TensorV):  # `.item()` values: item_args.py
        return tracer.call_op("call_function", op, [a, b], {})
    assumed = item_args.speculated(tracer, op, [a, b], mergeable=True)  # `t.item() == EOS`
    if isinstance(assumed, TensorV):  # (gone both ways: a merged branch's predicate)
        return assumed
    if assumed is not None:
        return ConstV(assumed)
    _no_item_values(a, b)
    if (isinstance(a, SymV) or isinstance(b, SymV)) and symint.is_symbolic_operand(a) \
            and symint.is_symbolic_operand(b):
        return symint.compare(tracer, op, a, b)
    if symbol in ("==", "!=") and _sizes_sequences(a, b):  # hx.size() != (1, batch, 128)
        same = _sequences_equal(tracer, a, b)
        return ConstV(same if symbol == "==" else not same)
    if symbol in ("==", "!=") and _values_view(a, b):  # dict_values compare by identity
        same = a is b
        return ConstV(same if symbol == "==" else not same)
    if is_const(a) and is_const(b):
        return concrete_op(tracer, op, a, b)
    if symbol in ("==", "!=") and _identity_comparable(a) and _identity_comparable(b):
        same = identical(a, b)
        return ConstV(same if symbol == "==" else not same)
    raise Unsupported("unsupported_call", f"comparison {symbol} of {kind(a)} and {kind(b)}")


def _sequence_items(v: Value) -> tuple[type, list] | None:
    """(tuple or list, the items as values) of a tuple/list value or constant, else None."""
    if isinstance(v, (TupleV, ListV)):
        return (list if isinstance(v, ListV) else tuple), v.items
    if isinstance(v, ConstV) and isinstance(v.value, (tuple, list)):
        return (list if isinstance(v.value, list) else tuple), [ConstV(i) for i in v.value]
    return None


def _sizes_sequences(a: Value, b: Value) -> bool:
    """Two tuples (``torch.Size`` is one) or two lists of numbers, some of them symbolic:
    compared item by item, so that only the items decide (each by a guard, an in-graph check,
    or nothing when equal for every size), not every size of both."""
    sa, sb = _sequence_items(a), _sequence_items(b)
    if sa is None or sb is None or sa[0] is not sb[0]:
        return False
    items = sa[1] + sb[1]
    return any(isinstance(i, SymV) for i in items) and all(symint.is_symbolic_operand(i) for i in items)


def _sequences_equal(tracer, a: Value, b: Value) -> bool:
    """Python's ``==`` of two sequences: equal lengths, then each pair until one differs.
    Where every item can be read from the frame (input sizes), the whole comparison is one
    guard: its outcome, not which item differed, decides the graph."""
    xs, ys = _sequence_items(a)[1], _sequence_items(b)[1]
    if len(xs) != len(ys):
        return False
    whole = symint.sequence_guard(tracer, xs, ys)
    if whole is not None:
        return whole
    for x, y in zip(xs, ys):
        if isinstance(x, SymV) or isinstance(y, SymV):
            same = symint.compare(tracer, operator.eq, x, y).value
        else:
            same = x.value == y.value
        if not same:
            return False
    return True


def _values_view(*values: Value) -> bool:
    return any(isinstance(v, DictViewV) and v.kind == "values" for v in values)


def _identity_comparable(v: Value) -> bool:
    if isinstance(v, ConstV):
        return True
    if isinstance(v, ObjV):
        return type(v.obj).__eq__ is object.__eq__ or isinstance(v.obj, type)
    return isinstance(v, (FuncV,))


def identical(a: Value, b: Value) -> bool:
    """Python's ``a is b`` for values."""
    for v in (a, b):
        if isinstance(v, rolled_objects.RowV):
            v.concrete()  # an item of a rolled loop: identity would be one iteration's
    if a is b:
        return True
    if isinstance(a, (ConstV, ObjV, TensorV)) and isinstance(b, (ConstV, ObjV, TensorV)):
        return a.concrete() is b.concrete()
    return False


def _untracked(*values: Value) -> None:
    for v in values:
        if isinstance(v, UntrackedContainerV):
            v.concrete()  # raises RelaxationRefused: its whole contents are needed after all


def truth(tracer, v: Value) -> bool:
    assumed = item_args.speculated(tracer, operator.truth, [v])
    if assumed is not None:
        return assumed
    _no_item_values(v)
    _untracked(v)
    if isinstance(v, ConstV):
        return bool(v.value)
    if isinstance(v, TensorV):
        return tracer.assume_truth(v)
    if isinstance(v, SymV):
        return bool(v.concrete())
    if isinstance(v, (TupleV, ListV)):
        return len(v.items) > 0
    if isinstance(v, (DictV, SetV)):
        return len(v.items) > 0
    if isinstance(v, DictViewV):
        return len(v.mapping.items) > 0
    if isinstance(v, ObjV):
        obj = v.obj
        if isinstance(obj, (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList)):
            return len(module_items(tracer, v)) > 0
        cls = type(obj)
        if isinstance(obj, nn.Module) or not (hasattr(cls, "__bool__") or hasattr(cls, "__len__")):
            return True
        if isinstance(obj, (type, type(len))):
            return True
        raise Unsupported("unsupported_call", f"truth value of a {cls.__name__} object")
    if isinstance(v, (FuncV, MethodV, GradModeV)):  # (grad-mode objects define no __bool__)
        return True
    if isinstance(v, NewObjV):
        if hasattr(v.cls, "__bool__") or hasattr(v.cls, "__len__"):
            name = "__bool__" if hasattr(v.cls, "__bool__") else "__len__"
            return truth(tracer, call(tracer, load_attr(tracer, None, v, name), [], {}))
        return True
    raise Unsupported("unsupported_call", f"truth value of {kind(v)}")


def unary(tracer, op, v: Value) -> Value:
    number = MODELS.deferred_unary(op, v)  # -v, abs(v) of a `.item()` value: computed at commit
    if number is not None:
        return number
    _no_item_values(v)
    if isinstance(v, TensorV):
        return tracer.call_op("call_function", op, [v], {})
    if isinstance(v, SymV) and op is operator.neg:
        return symint.negate(tracer, v)
    if is_const(v):
        return concrete_op(tracer, op, v)
    raise Unsupported("unsupported_call", f"{op.__name__} of {kind(v)}")


# ---- subscripts --------------------------------------------------------------------------
def getitem(tracer, container: Value, key: Value) -> Value:
    if isinstance(container, UntrackedContainerV):
        return untracked.getitem(tracer, container, key)
    if isinstance(container, TensorV):
        return tracer.call_op("call_function", operator.getitem, [container, key], {})
    if isinstance(key, TensorV):
        raise Unsupported("data_dependent_value", "indexing a Python container with a tensor")
    if isinstance(container, (TupleV, ListV)):
        k = key.concrete()
        MODELS.deque_check_key(container, k)  # a deque takes no slices
        try:
            picked = container.items[k]
        except Exception as e:
            raise python_error(e.with_traceback(None),
                               f"indexing raised {type(e).__name__}: {e}") from None
        if isinstance(k, slice):
            if isinstance(container, ListV):
                return ListV(picked)
            return TupleV(picked, torch.Size if container.cls is torch.Size else tuple)
        return picked
    if isinstance(container, DictV):
        k = key.concrete()
        if k not in container.items:
            return MODELS.missing_item(tracer, container, k)  # defaultdict; KeyError otherwise
        return container.items[k]
    if isinstance(container, ConstV) and is_const(key):
        return concrete_op(tracer, operator.getitem, container, key)
    if isinstance(container, ObjV) and isinstance(container.obj, nn.Module):
        return _module_getitem(tracer, container, key.concrete())
    if isinstance(container, ObjV) and _generic(container.obj) and _annotation(key) is not None:
        # `list[int]`, `typing.List[int]` (torch.jit.annotate(list[int], []) in
        # ConvTranspose's output_size): a type annotation, made as Python makes it
        return ObjV(container.obj[_annotation(key)])
    raise Unsupported("unsupported_call", f"subscript of {kind(container)}")


_GENERIC_BUILTINS = (list, tuple, dict, set, frozenset, type)


def _annotation(key: Value):
    """The type (or tuple of types) a subscript names, else None."""
    if isinstance(key, ObjV) and (isinstance(key.obj, type) or _generic(key.obj)):
        return key.obj
    if isinstance(key, ConstV) and (key.value is None or isinstance(key.value, type)):
        return key.value
    if isinstance(key, TupleV):
        items = [_annotation(i) for i in key.items]
        return None if any(i is None for i in items) else tuple(items)
    return None


def _generic(obj) -> bool:
    """A built-in collection type or a ``typing`` object: subscripting it only makes an
    annotation (no user ``__class_getitem__`` runs)."""
    return obj in _GENERIC_BUILTINS or getattr(type(obj), "__module__", None) == "typing" \
        or getattr(obj, "__module__", None) == "typing"


def _module_getitem(tracer, mod: ObjV, key) -> Value:
    m = mod.obj
    if isinstance(m, nn.ModuleDict) and isinstance(key, str):
        _guard_keys(tracer, mod, "_modules")
        return tracer.wrap(m._modules[key], _table(mod, "_modules", key))
    if isinstance(m, _SEQUENCE_MODULES) and isinstance(key, (int, slice)):
        items = module_items(tracer, mod)
        if isinstance(key, slice):
            return ModuleSliceV(items[key], callable=isinstance(m, nn.Sequential))
        try:
            return items[key]
        except IndexError:
            raise Unsupported("exception_handling", f"index {key} out of range for {type(m).__name__}") from None
    raise Unsupported("unsupported_call", f"subscript {key!r} of {type(m).__name__}")


def _table(mod: ObjV, table: str, key: str):
    return None if mod.source is None else ModuleDictSource(mod.source, table, key)


def _guard_keys(tracer, mod: ObjV, table: str) -> None:
    if mod.source is not None:
        entries = getattr(mod.obj, table)  # (an OrderedDict after `del seq[i]` / `seq.pop()`)
        tracer.add_guard(DictKeysGuard, AttrSource(mod.source, table), type(entries), tuple(entries))


def module_items(tracer, mod: ObjV) -> list[Value]:
    """Children of a Sequential/ModuleList/ParameterList (guarding their names)."""
    m = mod.obj
    table = "_parameters" if isinstance(m, nn.ParameterList) else "_modules"
    _guard_keys(tracer, mod, table)
    entries = getattr(m, table)
    return [tracer.wrap(v, _table(mod, table, k)) for k, v in entries.items()]


def setitem(tracer, container: Value, key: Value, value: Value) -> None:
    if isinstance(container, UntrackedContainerV):
        untracked.setitem(tracer, container, key, value)
        return
    if isinstance(container, TensorV):
        tracer.call_op("call_function", operator.setitem, [container, key, value], {},
                       keep_node=True)
        return
    if isinstance(container, ListV):
        ensure_local(tracer, container, "item assignment")
        k = key.concrete()
        MODELS.deque_check_key(container, k)
        if isinstance(k, slice):  # `l[1:3] = iterable`: assign its items
            value = consume(tracer, value)
        try:
            container.items[k] = value
        except Exception as e:
            raise Unsupported("exception_handling", f"item assignment raised {type(e).__name__}") from None
        return
    if isinstance(container, DictV):
        ensure_local(tracer, container, "item assignment")
        if not is_const(key):
            raise Unsupported("unsupported_call", "dict keys must be constants")
        container.items[key.concrete()] = value
        return
    raise Unsupported("side_effect", f"item assignment on {kind(container)}")


def delitem(tracer, container: Value, key: Value) -> None:
    _untracked(container)
    if isinstance(container, (ListV, DictV)):
        ensure_local(tracer, container, "del")
        MODELS.deque_check_key(container, key.concrete())
        try:
            del container.items[key.concrete()]
        except Exception as e:
            raise Unsupported("exception_handling", f"del raised {type(e).__name__}") from None
        return
    raise Unsupported("side_effect", f"del of an item of {kind(container)}")


def contains(tracer, item: Value, container: Value) -> bool:
    if isinstance(container, UntrackedContainerV):
        return untracked.contains(tracer, item, container)
    if isinstance(container, DictV):
        return item.concrete() in container.items
    if isinstance(container, DictViewV):  # the dict as it is now
        if container.kind == "keys":
            return contains(tracer, item, container.mapping)
        return contains(tracer, item, ListV(container.current()))
    if isinstance(container, (TupleV, ListV)):
        if is_const(item) and all(is_const(i) for i in container.items):
            return item.concrete() in [i.concrete() for i in container.items]
        if any(identical(item, i) for i in container.items):
            return True
        if contains_tensor(item) or contains_tensor(container):
            raise Unsupported("data_dependent_branch", "`in` comparing tensors by value")
        return item.concrete() in [i.concrete() for i in container.items]
    if isinstance(container, SetV) or (isinstance(container, ConstV) and is_const(item)):
        return item.concrete() in container.concrete()
    if isinstance(container, ObjV) and isinstance(container.obj, nn.ModuleDict):
        _guard_keys(tracer, container, "_modules")
        return item.concrete() in container.obj._modules
    raise Unsupported("unsupported_call", f"`in` on {kind(container)}")


# ---- iteration ---------------------------------------------------------------------------
def iterate(tracer, v: Value) -> IterV:
    _untracked(v)
    if isinstance(v, IterV):
        return v
    if isinstance(v, TupleV):
        return IterV(list(v.items))
    if isinstance(v, ListV):
        return IterV([], source=_list_items(v))
    if isinstance(v, (DictV, SetV)):
        return IterV([], source=_keys(v))
    if isinstance(v, DictViewV):
        return IterV([], source=_view_items(v))
    if isinstance(v, ConstV):
        try:
            return IterV([tracer.wrap_python(x) for x in v.value])
        except TypeError as e:
            raise Unsupported("exception_handling", f"{e}") from None
    if isinstance(v, TensorV):
        if v.example.dim() == 0:
            raise Unsupported("exception_handling", "iteration over a 0-d tensor")
        parts = tracer.call_op("call_method", "unbind", [v], {}, by_user=False)
        return IterV([] if isinstance(parts, ConstV) else list(parts.items))  # `()` of no rows
    if isinstance(v, ObjV):
        m = v.obj
        if isinstance(m, _SEQUENCE_MODULES):
            return IterV(module_items(tracer, v))
        if isinstance(m, (nn.ModuleDict, nn.ParameterDict)):
            table = "_modules" if isinstance(m, nn.ModuleDict) else "_parameters"
            _guard_keys(tracer, v, table)
            return IterV([ConstV(k) for k in getattr(m, table)])
    raise Unsupported("unsupported_call", f"iterating over {kind(v)}")


def _list_items(v: ListV):
    """A list iterator: reads ``v`` by index when asked, so what the list holds then counts."""
    i = 0
    while i < len(v.items):
        yield v.items[i]
        i += 1


def _keys(v: Value):
    """A dict or set iterator over the keys it has now; changing them before the iterator is
    used up raises in eager (RuntimeError), so the call runs eagerly."""
    keys = list(v.items)

    def check():
        if list(v.items) != keys:
            raise Unsupported("exception_handling",
                              f"RuntimeError: {type(v.items).__name__} changed during iteration")

    def gen():
        for k in keys:
            check()
            yield ConstV(k)
        check()
    return gen()


def _view_items(v: DictViewV):
    """An iterator over a dict view, made now: its keys as they are now (a key added or
    removed before it is used up makes eager raise, as for the dict itself); values are read
    when each item is handed out."""
    d, keys = v.mapping, _keys(v.mapping)  # the keys are taken now, not at the first next()

    def gen():
        for k in keys:
            if v.kind == "keys":
                yield k
            elif v.kind == "values":
                yield d.items[k.value]
            else:
                yield TupleV([k, d.items[k.value]])
    return gen()


def lazy(tracer, v: Value):
    """The items of ``iter(v)`` (taken now, as Python does), one at a time when asked for."""
    it = iterate(tracer, v)
    while (item := it.next()) is not None:
        yield item


def consume(tracer, v: Value) -> list[Value]:
    """The items ``v`` still yields (``list(v)``, ``sum(v)``, ``a, b = v``, ...). An iterator
    is used up, as in eager: items ``next()`` already took are not yielded again, and a
    second ``list(it)`` is empty."""
    return iterate(tracer, v).rest()


def length(tracer, v: Value) -> int:
    _untracked(v)
    if isinstance(v, (TupleV, ListV)):
        return len(v.items)
    if isinstance(v, (DictV, SetV)):
        return len(v.items)
    if isinstance(v, DictViewV):
        return len(v.mapping.items)
    if isinstance(v, ConstV):
        return len(v.value)
    if isinstance(v, TensorV):
        if v.example.dim() == 0:
            raise Unsupported("exception_handling", "len() of a 0-d tensor")
        return tracer.sym_size(v, 0).concrete()
    if isinstance(v, ObjV) and isinstance(v.obj, (nn.Sequential, nn.ModuleList, nn.ParameterList,
                                                  nn.ModuleDict, nn.ParameterDict)):
        if isinstance(v.obj, (nn.ModuleDict, nn.ParameterDict)):
            return len(iterate(tracer, v).items)
        return len(module_items(tracer, v))
    raise Unsupported("unsupported_call", f"len() of {kind(v)}")

