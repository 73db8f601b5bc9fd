"""Builtins and other C callables, modelled over values.

``BUILTINS`` maps a builtin object to a handler ``(tracer, args, kwargs) -> Value``. Pure
functions of constants (``math``, ``operator``, ``str`` methods, ...) are computed right
away; the few that touch tensors are graph nodes or a clear ``Unsupported``.
"""
from __future__ import annotations

import builtins
import cmath
import functools
import math
import operator
import random
import types

import torch

from ...guards import HasAttrGuard
from ...records import Unsupported
from ..exceptions import python_error
from .. import operators as ops
from ..rolled import lists as rolled_lists, loops as rolled_loops, rows as rolled_rows
from ..values.rolled import RolledListV
from ..values import symint
from ..values.symint import SymV
from ..values import (ConstV, DictV, FuncV, IterV, ListV, MethodV, NewObjV, ObjV, PartialV, SetV,
                     SuperV, TensorV, TupleV, Value, contains_tensor, is_const)
from ..models import MODELS, provides
from ..attrs import load_attr, store_attr
from ..calls import call
from ..frame import read_cell

BUILTINS: dict = {}
MODELS.register("BUILTINS", BUILTINS)  # calls.py looks callees up in it


def model(*objs):
    def register(fn):
        for obj in objs:
            BUILTINS[obj] = fn
        return fn
    return register


def _all_const(args, kwargs) -> bool:
    return all(is_const(a) for a in args) and all(is_const(v) for v in kwargs.values())


def _concrete_call(tracer, fn, args, kwargs) -> Value:
    try:
        result = fn(*[a.concrete() for a in args], **{k: v.concrete() for k, v in kwargs.items()})
    except Unsupported:  # forcing a lazy string (printing.StrV) falls back with its own kind
        raise
    except Exception as e:
        raise python_error(e.with_traceback(None), f"{getattr(fn, '__name__', fn)}() raised "
                           f"{type(e).__name__}: {e}") from None
    return tracer.wrap_python(result)


@model(len)
def _len(tracer, fn, args, kwargs):
    if isinstance(args[0], RolledListV):
        return args[0].length
    if isinstance(args[0], TensorV) and args[0].dynamic and args[0].example.dim():
        return tracer.sym_size(args[0], 0)
    return ConstV(ops.length(tracer, args[0]))


@model(isinstance)
def _isinstance(tracer, fn, args, kwargs):
    value, classes = args
    cls = _classes(classes)
    if isinstance(value, (ObjV, ConstV, TensorV)):
        return ConstV(isinstance(value.concrete(), cls))
    return ConstV(issubclass(value.python_type(), cls))


@model(issubclass)
def _issubclass(tracer, fn, args, kwargs):
    return ConstV(issubclass(_classes(args[0]), _classes(args[1])))


def _classes(v: Value):
    if isinstance(v, (ObjV, ConstV)):
        return v.concrete()
    if isinstance(v, TupleV) and all(isinstance(i, (ObjV, ConstV)) for i in v.items):
        return tuple(i.concrete() for i in v.items)
    raise Unsupported("unsupported_call", "isinstance()/issubclass() with a non-constant class")


@model(type)
def _type(tracer, fn, args, kwargs):
    if len(args) != 1:
        raise Unsupported("unsupported_call", "type() with 3 arguments creates a class")
    v = args[0]
    return ObjV(v.python_type() if not isinstance(v, (ObjV, ConstV)) else type(v.concrete()))


@model(getattr)
def _getattr(tracer, fn, args, kwargs):
    obj, name = args[0], args[1].concrete()
    if len(args) == 2:
        return load_attr(tracer, tracer.frames[-1], obj, name)
    _guard_hasattr(tracer, obj, name)
    try:
        return load_attr(tracer, tracer.frames[-1], obj, name)
    except Unsupported as e:
        if e.kind == "exception_handling" and "attribute" in e.explanation:
            return args[2]
        raise


@model(hasattr)
def _hasattr(tracer, fn, args, kwargs):
    obj, name = args[0], args[1].concrete()
    _guard_hasattr(tracer, obj, name)
    try:
        load_attr(tracer, tracer.frames[-1], obj, name)
        return ConstV(True)
    except Unsupported as e:
        if e.kind == "exception_handling" and "attribute" in e.explanation:
            return ConstV(False)
        raise


def _guard_hasattr(tracer, obj: Value, name: str) -> None:
    if isinstance(obj, ObjV) and obj.source is not None:
        hook = _python_lookup_hook(type(obj.obj))
        if hook is not None:  # (it would run here, in capture, and in every guard check)
            raise Unsupported("unsupported_call", f"hasattr()/getattr() with a default on a "
                              f"{type(obj.obj).__name__}, whose {hook} is Python code")
        tracer.add_guard(HasAttrGuard, obj.source, name=name, expected=hasattr(obj.obj, name))


def _python_lookup_hook(cls: type) -> str | None:
    """``__getattr__`` or ``__getattribute__`` where ``cls`` defines one in Python (other than
    ``nn.Module``'s, a lookup in its tables), or None."""
    for hook in ("__getattr__", "__getattribute__"):
        fn = getattr(cls, hook, None)
        if isinstance(fn, types.FunctionType) and fn is not getattr(torch.nn.Module, hook, None):
            return hook
    return None


@model(setattr, delattr)
def _setattr(tracer, fn, args, kwargs):
    """``setattr(o, "name", v)`` / ``delattr(o, "name")``: ``o.name = v`` / ``del o.name``."""
    if kwargs or len(args) != (3 if fn is setattr else 2) or not isinstance(args[1], ConstV) \
            or type(args[1].value) is not str:
        return _impure(tracer, fn, args, kwargs)
    store_attr(tracer, args[0], args[1].value, args[2] if fn is setattr else None)
    return ConstV(None)


@model(input, open, id, exec, eval, compile, globals, locals, vars, breakpoint, __import__)
def _impure(tracer, fn, args, kwargs):
    label = getattr(fn, "__name__", "this builtin")
    raise Unsupported("unsupported_call", f"{label}() has effects outside the graph (I/O, "
                      "identity or namespace access) and is not captured")


@model(print)
def _print(tracer, fn, args, kwargs):
    from .printing import deferred_print
    return deferred_print(tracer, args, kwargs)


@model(min, max)
def _minmax(tracer, fn, args, kwargs):
    items = args if len(args) > 1 else ops.consume(tracer, args[0])
    if not kwargs and len(items) > 1 and any(isinstance(i, SymV) for i in items) \
            and all(symint.is_symbolic_operand(i) for i in items):
        # `max(x.size(1) - 1, 1)`: decided by comparisons (guarded), as Python does it,
        # the first extreme item kept; not by every item's value
        beats = operator.gt if fn is max else operator.lt
        best = items[0]
        for item in items[1:]:
            if symint.compare(tracer, beats, item, best).value:
                best = item
        return best
    if _all_const(items, kwargs):
        return _concrete_call(tracer, fn, [ListV(list(items))], kwargs)
    key = kwargs.get("key")
    if key is not None and not (isinstance(key, ConstV) and key.value is None) and items:
        keys = _sort_keys(tracer, items, key)
        # Python returns the first item whose key is extreme
        best = fn(range(len(items)), key=lambda i: keys[i])
        return items[best]
    number = deferred.builtin(fn, list(items), kwargs)  # max(best, v.item()): at commit
    if number is not None:
        return number
    if any(isinstance(i, TensorV) for i in items):
        raise Unsupported("data_dependent_branch",
                          f"{fn.__name__}() of tensors compares tensor values in Python; "
                          f"use torch.{'maximum' if fn is max else 'minimum'}")
    raise Unsupported("unsupported_call", f"{fn.__name__}() of non-constant values")


@model(abs)
def _abs(tracer, fn, args, kwargs):
    return ops.unary(tracer, operator.abs, args[0])


@model(sum)
def _sum(tracer, fn, args, kwargs):
    start = args[1] if len(args) > 1 else kwargs.get("start", ConstV(0))
    acc = start
    for item in ops.consume(tracer, args[0]):
        acc = ops.binary(tracer, operator.add, acc, item)
    return acc


@model(int, float, complex, str, repr, ascii, bytes, format, chr, ord, hash, round, divmod,
       pow, bin, hex, oct)
def _scalar(tracer, fn, args, kwargs):
    from . import printing
    text = printing.builtin(fn, args, kwargs)  # str(loss.item()): formatted at commit
    if text is not None:
        return text
    number = deferred.builtin(fn, args, kwargs)  # round(loss.item(), 4): computed at commit
    if number is not None:
        return number
    if fn in (int, float, round) and args and isinstance(args[0], SymV) and not kwargs \
            and len(args) <= 2 and _all_const(args[1:], {}) \
            and type(args[0].value) in (int, float):  # int(random.random() * 4): still symbolic
        if type(args[0].value) is int and fn is not float and len(args) == 1:
            return args[0]  # int(n), round(n) of an int: n itself
        return symint.convert(tracer, fn, args[0], *[a.value for a in args[1:]])
    if _all_const(args, kwargs):
        return _concrete_call(tracer, fn, args, kwargs)
    if fn is float and len(args) == 1 and not kwargs and isinstance(args[0], TensorV) \
            and not args[0].example.dtype.is_complex:
        # ``Tensor.__float__`` is ``item()`` made a double: the same number as
        # ``float(t.item())`` (an int64 rounds to nearest either way), a deferred number
        from .training import item
        return _scalar(tracer, fn, [item(tracer, args[0])], {})
    if any(isinstance(a, TensorV) for a in args):
        if fn in (round, divmod, pow):
            return tracer.call_op("call_function", fn, args, kwargs)
        raise Unsupported("data_dependent_value",
                          f"{fn.__name__}() of a tensor reads its value into Python")
    if any(printing.refusal_kind(a) == "data_dependent_value" for a in [*args, *kwargs.values()]):
        raise Unsupported("data_dependent_value", f"{fn.__name__}() of a `.item()` value or a "
                          "tensor computes on tensor data in Python")
    raise Unsupported("unsupported_call", f"{fn.__name__}() of {args[0]!r}")


@model(bool)
def _bool(tracer, fn, args, kwargs):
    return ConstV(ops.truth(tracer, args[0]) if args else False)


@model(callable)
def _callable(tracer, fn, args, kwargs):
    v = args[0]
    if isinstance(v, (FuncV, MethodV)):
        return ConstV(True)
    return ConstV(callable(v.concrete()))


@model(list)
def _list(tracer, fn, args, kwargs):
    return ListV(list(ops.consume(tracer, args[0])) if args else [])


@model(tuple)
def _tuple(tracer, fn, args, kwargs):
    items = list(ops.consume(tracer, args[0])) if args else []
    if all(type(i) is ConstV for i in items):  # not a lazy string (printing.StrV): kept lazy
        return ConstV(tuple(i.value for i in items))
    return TupleV(items)


@model(dict)
def _dict(tracer, fn, args, kwargs):
    result: dict = {}
    if args:
        src = args[0]
        if isinstance(src, DictV):
            result.update(src.items)
        else:
            for pair in ops.consume(tracer, src):
                k, v = ops.consume(tracer, pair)
                result[k.concrete()] = v
    result.update(kwargs)
    return DictV(result)


@model(set, frozenset)
def _set(tracer, fn, args, kwargs):
    items = ops.consume(tracer, args[0]) if args else []
    if not all(is_const(i) for i in items):
        raise Unsupported("unsupported_call", "a set of tensors or objects")
    values = {i.concrete() for i in items}
    return SetV(values) if fn is set else ConstV(frozenset(values))


@model(range, slice)
def _range(tracer, fn, args, kwargs):
    rolled = rolled_loops.symbolic_range(tracer, args, kwargs) if fn is range else None
    if rolled is not None:  # `for t in range(n)`: the loop is rolled, n stays symbolic
        return rolled
    if not _all_const(args, kwargs):
        raise Unsupported("data_dependent_value", f"{fn.__name__}() of a tensor value")
    return _concrete_call(tracer, fn, args, kwargs)


@model(enumerate)
def _enumerate(tracer, fn, args, kwargs):
    rolled = rolled_lists.enumerate_list(tracer, args, kwargs) \
        or rolled_rows.enumerate_rows(tracer, args, kwargs)
    if rolled is not None:  # `for k, x in enumerate(xs)` over a list passed whole, a tensor's rows
        return rolled
    start = (args[1] if len(args) > 1 else kwargs.get("start", ConstV(0))).concrete()
    items = ops.lazy(tracer, args[0])
    return IterV([], source=(TupleV([ConstV(start + i), v]) for i, v in enumerate(items)))


@model(zip)
def _zip(tracer, fn, args, kwargs):
    rolled = rolled_lists.zip_lists(tracer, args, kwargs)
    if rolled is not None:  # `for x, y in zip(xs, ys)` over lists passed whole: rolled
        return rolled
    columns = [ops.iterate(tracer, a) for a in args]
    strict = kwargs.get("strict", ConstV(False)).concrete()
    return IterV([], source=_zip_rows(columns, strict))


def _zip_rows(columns: list, strict: bool):
    """zip's rows, pulled as CPython pulls them (left to right, up to the first exhausted)."""
    while columns:
        row = []
        for i, it in enumerate(columns):
            item = it.next()
            if item is None:
                if strict and (i > 0 or any(other.next() is not None for other in columns[1:])):
                    raise Unsupported("exception_handling", "zip(strict=True) of different lengths")
                return
            row.append(item)
        yield TupleV(row)


@model(reversed)
def _reversed(tracer, fn, args, kwargs):
    return IterV(list(reversed(ops.consume(tracer, args[0]))))


@model(sorted)
def _sorted(tracer, fn, args, kwargs):
    return ListV(sort_values(tracer, list(ops.consume(tracer, args[0])), kwargs))


def sort_values(tracer, items: list, kwargs: dict) -> list:
    """``sorted(items, key=..., reverse=...)`` where the sort keys must be constants."""
    key = kwargs.get("key")
    if isinstance(key, ConstV) and key.value is None:
        key = None
    keys = _sort_keys(tracer, items, key)
    reverse = kwargs["reverse"].concrete() if "reverse" in kwargs else False
    order = sorted(range(len(items)), key=lambda i: keys[i], reverse=reverse)
    return [items[i] for i in order]


def _sort_keys(tracer, items: list, key: Value | None) -> list:
    """The Python sort keys of ``items`` (under ``key``). They must be constants, except that
    tuples whose first elements are distinct constants (``sorted(d.items())``) compare by
    those alone, as Python does, even when later elements are tensors."""
    keys = items if key is None else [call(tracer, key, [i], {}) for i in items]
    if all(is_const(k) for k in keys):
        return [k.concrete() for k in keys]
    firsts = [k.items[0] if isinstance(k, TupleV) and k.items else None for k in keys]
    if all(f is not None and is_const(f) for f in firsts):
        values = [f.concrete() for f in firsts]
        if len(set(map(repr, values))) == len(values) and len(set(values)) == len(values):
            return values
    raise Unsupported("data_dependent_branch", "sorting or comparing by tensor values in Python")


@model(iter)
def _iter(tracer, fn, args, kwargs):
    return ops.iterate(tracer, args[0])


@model(next)
def _next(tracer, fn, args, kwargs):
    it = args[0]
    if not isinstance(it, IterV):
        raise Unsupported("unsupported_call", f"next() of {it!r}")
    item = it.next()
    if item is None:
        if len(args) > 1:
            return args[1]
        raise python_error(StopIteration(), "StopIteration during capture")
    return item


@model(map)
def _map(tracer, fn, args, kwargs):
    rows = _zip_rows([ops.iterate(tracer, a) for a in args[1:]], False)
    return IterV([], source=(call(tracer, args[0], row.items, {}) for row in rows))


@model(filter)
def _filter(tracer, fn, args, kwargs):
    items = ops.lazy(tracer, args[1])
    if isinstance(args[0], ConstV) and args[0].value is None:
        return IterV([], source=(i for i in items if ops.truth(tracer, i)))
    return IterV([], source=(i for i in items if ops.truth(tracer, call(tracer, args[0], [i], {}))))


@model(any, all)
def _anyall(tracer, fn, args, kwargs):
    want = fn is any
    it = ops.iterate(tracer, args[0])
    while (item := it.next()) is not None:  # stops where Python stops consuming
        if ops.truth(tracer, item) == want:
            return ConstV(want)
    return ConstV(not want)


@model(super)
def _super(tracer, fn, args, kwargs):
    if args:
        return SuperV(args[0].concrete(), args[1])
    frame = tracer.frames[-1]
    cell = frame.cells.get("__class__")
    if cell is None or frame.code.co_argcount == 0:
        raise Unsupported("unsupported_call", "super() outside a method")
    first = frame.code.co_varnames[0]
    self_v = frame.locals.get(first)
    if self_v is None and first in frame.cells:
        self_v = read_cell(frame, frame.cells[first])
    return SuperV(read_cell(frame, cell).concrete(), self_v)


# math / operator / cmath: pure functions; constants are computed, tensors become nodes.
_PURE_MODULES = {"math", "cmath", "operator", "_operator"}


@provides("call_builtin_like")
def call_builtin_like(tracer, fn: ObjV, args, kwargs) -> Value:
    obj = fn.obj
    from .stdlib import INSTANCE_CALLS
    if type(obj) in INSTANCE_CALLS:
        return INSTANCE_CALLS[type(obj)](tracer, obj, args, kwargs)
    module = getattr(obj, "__module__", None) or ""
    if module in _PURE_MODULES or obj in _PURE_FUNCS:
        if _all_const(args, kwargs):
            return _concrete_call(tracer, obj, args, kwargs)
        if not isinstance(obj, (types.BuiltinFunctionType, types.FunctionType)):
            raise Unsupported("unsupported_call", f"calling a {type(obj).__qualname__} object "
                              "on non-constant values")
        if any(contains_tensor(a) for a in args):
            return tracer.call_op("call_function", obj, args, kwargs)
        number = deferred.math_call(obj, args, kwargs)  # math.sqrt(v.item()): at commit
        if number is not None:
            return number
        raise Unsupported("unsupported_call", f"{obj.__name__}() of non-constant values")
    if isinstance(obj, type):
        return _construct(tracer, obj, args, kwargs, fn.source)
    owner = getattr(obj, "__objclass__", None)
    if isinstance(obj, types.MethodDescriptorType) and owner in (dict, list) and args \
            and args[0].python_type() is owner:  # dict.update(d, x) is d.update(x): it writes d
        from .methods import call_method
        return call_method(tracer, args[0], obj.__name__, list(args[1:]), kwargs)
    if isinstance(obj, (types.MethodDescriptorType, types.BuiltinMethodType)) and _all_const(args, kwargs) \
            and owner in (str, int, float, tuple, bytes):
        return _concrete_call(tracer, obj, args, kwargs)
    name = getattr(obj, "__qualname__", None) or type(obj).__name__
    if isinstance(getattr(obj, "__self__", None), random.Random) or module == "random":
        from .python_random import not_modelled
        raise not_modelled(name)
    raise Unsupported("unsupported_call", f"call to {module + '.' if module else ''}{name}, which "
                      "specularch cannot see into (a C function or an object it does not model)")


_PURE_FUNCS = {math.floor, math.ceil, math.sqrt, cmath.sqrt, builtins.divmod}


def _construct(tracer, cls: type, args, kwargs, cls_source=None) -> Value:
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        fields = cls._fields
        values = list(args)
        for name in fields[len(values):]:
            if name in kwargs:
                values.append(kwargs[name])
            elif name in getattr(cls, "_field_defaults", {}):
                values.append(tracer.wrap_python(cls._field_defaults[name]))
            else:
                raise Unsupported("exception_handling", f"{cls.__name__}() missing field {name!r}")
        return TupleV(values, cls)
    if issubclass(cls, BaseException) and _all_const(args, kwargs):
        return ObjV(_concrete_call(tracer, cls, args, kwargs).concrete())
    if cls is functools.partial:
        return PartialV(args[0], list(args[1:]), dict(kwargs))
    if issubclass(cls, torch.nn.Module):  # a user's module class (torch's: torch_objects)
        raise Unsupported("unsupported_call", f"creating a {cls.__qualname__} module inside the "
                          "optimized function (only torch.nn's own modules are modelled: another "
                          "__init__ may act outside the module)", "Create the module in __init__.")
    reason = _plain_class_problem(cls)
    if reason:
        raise Unsupported("unsupported_call",
                          f"creating a {cls.__qualname__} object inside the optimized function ({reason})")
    obj = NewObjV(cls, {}, cls_source)
    init = cls.__init__
    if init is object.__init__:
        if args or kwargs:
            raise Unsupported("exception_handling", f"TypeError: {cls.__name__}() takes no arguments")
    else:
        call(tracer, tracer.wrap(init, None), [obj, *args], kwargs)
    return obj


@model(object.__init__)
def _object_init(tracer, fn, args, kwargs):
    """``super().__init__()`` reaching ``object``: does nothing to an object made in the call
    (its class's ``__init__``/``__new__`` are Python's own, see ``_plain_class_problem``)."""
    if len(args) != 1 or kwargs or not isinstance(args[0], NewObjV):
        raise Unsupported("unsupported_call", "object.__init__ called on another object or "
                          "with arguments")
    return ConstV(None)


def _plain_class_problem(cls: type) -> str | None:
    """Why instances of ``cls`` cannot be modelled as attribute dicts (None if they can)."""
    if type(cls) is not type:
        return "it has a metaclass"
    if cls.__new__ is not object.__new__:
        return "it defines __new__"
    from .stdlib_objects import frozen_dataclass_hook
    for name in ("__setattr__", "__getattribute__", "__getattr__", "__delattr__"):
        if getattr(cls, name, None) is not getattr(object, name, None) and not (
                name in ("__setattr__", "__delattr__") and frozen_dataclass_hook(cls, name)):
            return f"it defines {name}"
    if any("__slots__" in k.__dict__ for k in cls.__mro__[:-1]) and not _plain_slots(cls):
        return "it uses __slots__ other than plain fields"
    if not isinstance(cls.__init__, types.FunctionType) and cls.__init__ is not object.__init__:
        return "its __init__ is not a Python function"
    return None


def _plain_slots(cls: type) -> bool:
    """Whether every ``__slots__`` name of ``cls`` is a plain field (a member descriptor that
    stores the value): such fields are modelled like ``__dict__`` entries."""
    for klass in cls.__mro__[:-1]:
        slots = klass.__dict__.get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and not isinstance(
                    klass.__dict__.get(name), types.MemberDescriptorType):
                return False
    return True


@provides("slot_write_problem")
def slot_write_problem(cls: type, name: str) -> str | None:
    """Why ``obj.name = ...`` raises for an instance of ``cls`` that has no ``__dict__``
    (all its classes define ``__slots__``) when ``name`` is not one of its slots."""
    if any(isinstance(k.__dict__.get("__dict__"), types.GetSetDescriptorType) for k in cls.__mro__):
        return None
    if isinstance(getattr(cls, name, None), types.MemberDescriptorType):
        return None
    return f"AttributeError: {cls.__name__!r} object has no attribute {name!r}"


@provides("construct_torch_class")
def construct_torch_class(tracer, cls: type, args, kwargs) -> Value:
    from .grad_mode import construct
    ctx = construct(tracer, cls, args, kwargs)
    if ctx is not None:
        return ctx
    if cls in (torch.Size, torch.device) and _all_const(args, kwargs):
        return _concrete_call(tracer, cls, args, kwargs)
    from .torch_objects import construct as construct_torch_object
    made = construct_torch_object(tracer, cls, args, kwargs)
    if made is not None:
        return made
    raise Unsupported("unsupported_call", f"creating a {cls.__module__}.{cls.__qualname__} inside "
                      "the optimized function")


@model(torch.nn.utils.clip_grad_norm_)
def _clip_grad_norm(tracer, fn, args, kwargs):
    from .nn_module import clip_grad_norm
    return clip_grad_norm(tracer, fn, args, kwargs)


@model(torch.nn.utils.clip_grad_value_)
def _clip_grad_value(tracer, fn, args, kwargs):
    from .nn_module import clip_grad_value
    return clip_grad_value(tracer, fn, args, kwargs)


@model(torch.jit.annotate)
def _annotate(tracer, fn, args, kwargs):
    """``torch.jit.annotate(list[int], [])`` (TorchScript's type hint): the value itself."""
    value = args[1] if len(args) > 1 else kwargs.get("the_value")
    if value is None:
        raise Unsupported("unsupported_call", "torch.jit.annotate without its value")
    return value


from . import stdlib  # noqa: E402,F401  (registers functools/itertools/collections models)
from ..speculation import deferred  # noqa: E402  (used above)

model(*deferred.CLOCKS)(deferred.clock)  # time.time & co.: read once, deferred
