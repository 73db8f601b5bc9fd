"""Methods of built-in kinds of values: tensors, lists, dicts, tuples, sets, constants, and
the grad-mode context managers (``with torch.no_grad():``)."""
from __future__ import annotations

import random

import torch

from ...records import Unsupported
from ..exceptions import python_error
from . import deque as deque_model, grad_mode, printing, python_random, stdlib_objects, training
from ..speculation import untracked
from ..values.deque import DequeV
from .exit_stack import ExitStackV
from ..operators import consume, contains, ensure_local, identical
from ..tracer import FORBIDDEN_TENSOR_METHODS
from ..values import (ConstV, DictV, DictViewV, GradModeV, IterV, ListV, ObjV, SetV, TensorV, TupleV,
                     UntrackedContainerV, Value, is_const)
from ..models import provides


@provides("call_method")
def call_method(tracer, self_v: Value, name: str, args: list[Value], kwargs: dict[str, Value]) -> Value:
    if isinstance(self_v, TensorV):
        if name == "item" and not args and not kwargs:
            return training.item(tracer, self_v)
        if name == "backward":
            return training.backward(tracer, self_v, args, kwargs)
        if name == "requires_grad_":
            return grad_mode.requires_grad_(tracer, self_v, args, kwargs)
        if name == "numpy":
            raise Unsupported("data_dependent_value", "Tensor.numpy() is not captured: the array "
                              "shares the tensor's memory and NumPy code reads its data in "
                              "Python; return the tensor and call .numpy() outside the "
                              "optimized function")
        if name in FORBIDDEN_TENSOR_METHODS:
            kind = "unsupported_call" if name in ("backward", "register_hook", "retain_grad",
                                                  "requires_grad_", "share_memory_",
                                                  "record_stream") else "data_dependent_value"
            raise Unsupported(kind, f"Tensor.{name}() is not captured"
                              + (" (it reads tensor data into Python)" if kind == "data_dependent_value" else
                                 " (it changes autograd or memory state outside the graph)"))
        if self_v.dynamic and name == "stride":
            raise Unsupported("unsupported_call", "stride() of a tensor whose shape varies between calls")
        return tracer.call_op("call_method", name, [self_v, *args], kwargs, name=name)
    if isinstance(self_v, DequeV):
        return deque_model.call_method(tracer, self_v, name, args, kwargs)
    if isinstance(self_v, ExitStackV):
        return self_v.method(tracer, name, args, kwargs)
    if isinstance(self_v, ListV):
        return _list_method(tracer, self_v, name, args, kwargs)
    if isinstance(self_v, UntrackedContainerV):
        return untracked.call_method(tracer, self_v, name, args, kwargs, consume)
    if isinstance(self_v, DictV):
        return _dict_method(tracer, self_v, name, args, kwargs)
    if isinstance(self_v, SetV):
        return _set_method(tracer, self_v, name, args, kwargs)
    if isinstance(self_v, DictViewV) and name == "isdisjoint" and self_v.kind != "values":
        return ConstV(not any(contains(tracer, item, self_v) for item in consume(tracer, args[0])))
    if isinstance(self_v, TupleV) and name in ("index", "count"):
        return _sequence_query(tracer, self_v, name, args)
    if isinstance(self_v, TupleV) and name == "_replace":
        return stdlib_objects.namedtuple_method(tracer, self_v, name, args, kwargs)
    if isinstance(self_v, TupleV) and name == "_asdict":
        return DictV(dict(zip(self_v.cls._fields, self_v.items)))
    if isinstance(self_v, ConstV):
        return _const_method(tracer, self_v, name, args, kwargs)
    if isinstance(self_v, ObjV):
        from . import nn_module as module_model, optim as optim_model
        if optim_model.is_modelled(self_v.obj, name):
            return optim_model.call(tracer, self_v, name, args, kwargs)
        if isinstance(self_v.obj, torch.nn.Module) and module_model.is_modelled(self_v.obj, name):
            return module_model.call(tracer, self_v, name, args, kwargs)
        if python_random.is_draw(self_v.obj, name):
            python_random.no_arguments(args, kwargs, name)
            return python_random.draw(tracer)
        if isinstance(self_v.obj, random.Random):  # (getrandbits inside random.randint ...)
            raise python_random.not_modelled(f"{type(self_v.obj).__name__}.{name}")
    raise Unsupported("unsupported_call", f"method {name!r} of {type(self_v).__name__}")


def _const_method(tracer, self_v: ConstV, name, args, kwargs) -> Value:
    args = [ListV(a.rest()) if isinstance(a, IterV) else a for a in args]
    text = printing.str_method(self_v, name, args, kwargs)  # "{:.3f}".format(v): at commit
    if text is not None:
        return text
    if not all(is_const(a) for a in args) or not all(is_const(v) for v in kwargs.values()):
        if any(printing.refusal_kind(a) == "data_dependent_value" for a in [*args, *kwargs.values()]):
            raise Unsupported("data_dependent_value",
                              f"{self_v.python_type().__name__}.{name}() formats or reads a tensor "
                              "or a `.item()` value")
        raise Unsupported("unsupported_call", f"{type(self_v.value).__name__}.{name}() with non-constant arguments")
    method = getattr(self_v.value, name)
    try:
        result = method(*[a.concrete() for a in args], **{k: v.concrete() for k, v in kwargs.items()})
    except Unsupported:  # forcing a lazy string (printing.StrV) falls back with its own kind
        raise
    except Exception as e:
        raise python_error(e.with_traceback(None), f"{name}() raised {type(e).__name__}: {e}") from None
    return tracer.wrap_python(result)


def _sequence_query(tracer, seq, name, args) -> Value:
    target = args[0]
    matches = [i for i, item in enumerate(seq.items)
               if identical(item, target) or (is_const(item) and is_const(target)
                                              and item.concrete() == target.concrete())]
    if name == "count":
        return ConstV(len(matches))
    if not matches:
        if not is_const(target):
            raise Unsupported("exception_handling", "ValueError: item not in sequence")
        raise python_error(ValueError(f"{target.concrete()!r} is not in list" if isinstance(seq, ListV)
                                      else "tuple.index(x): x not in tuple"))
    return ConstV(matches[0])


def _list_method(tracer, lst: ListV, name, args, kwargs) -> Value:
    if name in ("index", "count"):
        return _sequence_query(tracer, lst, name, args)
    if name == "copy":
        return ListV(list(lst.items))
    ensure_local(tracer, lst, f"list.{name}")
    items = lst.items
    if name == "append":
        items.append(args[0])
    elif name == "extend":
        items.extend(consume(tracer, args[0]))
    elif name == "insert":
        items.insert(args[0].concrete(), args[1])
    elif name == "pop":
        if not items:
            raise python_error(IndexError("pop from empty list"))
        return items.pop(args[0].concrete() if args else -1)
    elif name == "clear":
        items.clear()
    elif name == "reverse":
        items.reverse()
    elif name == "remove":
        for i, item in enumerate(items):
            if identical(item, args[0]) or (is_const(item) and is_const(args[0])
                                             and item.concrete() == args[0].concrete()):
                del items[i]
                break
        else:
            raise python_error(ValueError("list.remove(x): x not in list"))
    elif name == "sort":
        from .builtins import sort_values
        items[:] = sort_values(tracer, items, kwargs)
    else:
        raise Unsupported("unsupported_call", f"list.{name}")
    return ConstV(None)


def _dict_method(tracer, d: DictV, name, args, kwargs) -> Value:
    items = d.items
    if name == "get":
        key = args[0].concrete()
        return items.get(key, args[1] if len(args) > 1 else ConstV(None))
    if name in ("keys", "values", "items"):  # live views: they read `d` when used
        if args or kwargs:
            raise Unsupported("exception_handling", f"TypeError: dict.{name}() takes no arguments")
        return DictViewV(d, name)
    if name == "copy":
        return d.like(dict(items))
    if name == "__contains__":
        return ConstV(contains(tracer, args[0], d))
    from .stdlib import ordered_dict_method
    done = ordered_dict_method(tracer, d, name, args, kwargs) or stdlib_objects.counter_method(
        tracer, d, name, args, kwargs)
    if done is not None:
        return done
    ensure_local(tracer, d, f"dict.{name}")
    if name == "pop":
        key = args[0].concrete()
        if key in items:
            return items.pop(key)
        if len(args) > 1:
            return args[1]
        raise python_error(KeyError(key), f"KeyError: {key!r}")
    if name == "setdefault":
        return items.setdefault(args[0].concrete(), args[1] if len(args) > 1 else ConstV(None))
    if name == "update":
        if args:
            other = args[0]
            if isinstance(other, DictV):
                items.update(other.items)
            else:
                for pair in consume(tracer, other):
                    k, v = consume(tracer, pair)
                    items[k.concrete()] = v
        items.update(kwargs)
        return ConstV(None)
    if name == "clear":
        items.clear()
        return ConstV(None)
    raise Unsupported("unsupported_call", f"dict.{name}")


def _set_method(tracer, s: SetV, name, args, kwargs) -> Value:
    if not all(is_const(a) for a in args):
        raise Unsupported("unsupported_call", f"set.{name} with non-constant items")
    if name in ("union", "intersection", "difference", "issubset", "issuperset", "copy",
                "symmetric_difference", "isdisjoint"):
        return tracer.wrap_python(getattr(s.items, name)(*[a.concrete() for a in args]))
    ensure_local(tracer, s, f"set.{name}")
    if name in ("add", "discard", "remove", "update", "clear", "difference_update",
                "intersection_update"):
        try:
            getattr(s.items, name)(*[a.concrete() for a in args])
        except KeyError as e:
            raise Unsupported("exception_handling", f"KeyError: {e}") from None
        return ConstV(None)
    raise Unsupported("unsupported_call", f"set.{name}")


# ---- grad-mode context managers -----------------------------------------------------------
def enter_context(tracer, ctx: Value) -> Value:
    if not isinstance(ctx, GradModeV):
        raise Unsupported("unsupported_call", f"`with` on {ctx!r} (only torch.no_grad(), "
                          "enable_grad(), set_grad_enabled(b) and inference_mode(b))")
    grad_mode.enter(tracer, ctx)
    return ConstV(None)


@provides("exit_context")
def exit_context(tracer, ctx: Value) -> Value:
    grad_mode.exit(tracer, ctx)
    return ConstV(None)
