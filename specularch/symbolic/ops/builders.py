"""Opcode family: building containers (tuples, lists, sets, dicts, comprehension appends)
and unpacking them (``a, b = ...``, ``a, *rest = ...``)."""
from __future__ import annotations

from ...records import Unsupported
from ..operators import consume
from .registry import handles
from ..values import ConstV, DictV, ListV, SetV, TupleV, UntrackedContainerV, is_const


def _tuple(items):
    if all(type(i) is ConstV for i in items):  # not a lazy string (printing.StrV): kept lazy
        return ConstV(tuple(i.value for i in items))
    return TupleV(list(items))


@handles("BUILD_TUPLE")
def _build_tuple(frame, ins):
    frame.push(_tuple(frame.popn(ins.arg)))


@handles("BUILD_LIST")
def _build_list(frame, ins):
    frame.push(ListV(frame.popn(ins.arg)))


@handles("BUILD_SET")
def _build_set(frame, ins):
    items = frame.popn(ins.arg)
    if not all(is_const(i) for i in items):
        raise Unsupported("unsupported_call", "a set of tensors or objects")
    frame.push(SetV({i.concrete() for i in items}))


@handles("BUILD_MAP")
def _build_map(frame, ins):
    flat = frame.popn(2 * ins.arg)
    items = {}
    for k, v in zip(flat[::2], flat[1::2]):
        if not is_const(k):
            raise Unsupported("unsupported_call", "a dict key that is not a constant")
        items[k.concrete()] = v
    frame.push(DictV(items))


@handles("BUILD_CONST_KEY_MAP")
def _build_const_key_map(frame, ins):
    keys = frame.pop().concrete()
    values = frame.popn(ins.arg)
    frame.push(DictV(dict(zip(keys, values))))


@handles("LIST_APPEND")
def _list_append(frame, ins):
    value = frame.pop()
    frame.stack[-ins.arg].items.append(value)


@handles("SET_ADD")
def _set_add(frame, ins):
    value = frame.pop()
    if not is_const(value):
        raise Unsupported("unsupported_call", "a set of tensors or objects")
    frame.stack[-ins.arg].items.add(value.concrete())


@handles("MAP_ADD")
def _map_add(frame, ins):
    value, key = frame.pop(), frame.pop()
    if not is_const(key):
        raise Unsupported("unsupported_call", "a dict key that is not a constant")
    frame.stack[-ins.arg].items[key.concrete()] = value


@handles("LIST_EXTEND")
def _list_extend(frame, ins):
    source = frame.pop()
    frame.stack[-ins.arg].items.extend(consume(frame.tracer, source))


@handles("SET_UPDATE")
def _set_update(frame, ins):
    source = frame.pop()
    items = consume(frame.tracer, source)
    if not all(is_const(i) for i in items):
        raise Unsupported("unsupported_call", "a set of tensors or objects")
    frame.stack[-ins.arg].items.update(i.concrete() for i in items)


@handles("DICT_UPDATE", "DICT_MERGE")
def _dict_update(frame, ins):
    source = frame.pop()
    target = frame.stack[-ins.arg]
    if isinstance(source, ConstV) and isinstance(source.value, dict):
        source = DictV({k: frame.tracer.wrap_python(v) for k, v in source.value.items()})
    if isinstance(source, UntrackedContainerV):
        source.concrete()  # raises RelaxationRefused: ``**d`` needs all of its items after all
    if not isinstance(source, DictV):
        raise Unsupported("unsupported_call", f"** unpacking of {source!r}")
    if ins.opname == "DICT_MERGE":
        dup = set(target.items) & set(source.items)
        if dup:
            raise Unsupported("exception_handling", f"TypeError: got multiple values for keyword argument {dup.pop()!r}")
    target.items.update(source.items)


@handles("LIST_TO_TUPLE")
def _list_to_tuple(frame, ins):
    frame.push(_tuple(frame.pop().items))


@handles("UNPACK_SEQUENCE")
def _unpack_sequence(frame, ins):
    items = consume(frame.tracer, frame.pop())
    if len(items) != ins.arg:
        raise Unsupported("exception_handling",
                          f"ValueError: expected {ins.arg} values to unpack, got {len(items)}")
    frame.stack.extend(reversed(items))


@handles("UNPACK_EX")
def _unpack_ex(frame, ins):
    before, after = ins.arg & 0xFF, ins.arg >> 8
    items = consume(frame.tracer, frame.pop())
    if len(items) < before + after:
        raise Unsupported("exception_handling", "ValueError: not enough values to unpack")
    middle = ListV(items[before:len(items) - after])
    ordered = items[:before] + [middle] + items[len(items) - after:]
    frame.stack.extend(reversed(ordered))


