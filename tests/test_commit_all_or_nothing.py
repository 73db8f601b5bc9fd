"""The commit is all-or-nothing (``shadow_heap/checks.py``): a write that would raise at
commit time is found before the first write, so the call runs eagerly over untouched state.

Each program makes writes of every easy kind (a tensor updated in place, an attribute of
another object, a list append) and then one that raises, in eager too, on some calls. The
eager and the optimized copy of one world run the same calls: results, raised exceptions
(type and message) and the state left behind must be equal after every call. Before, the
commit wrote the earlier writes, raised, and the eager rerun wrote them a second time."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import specularch
from specularch.shadow_heap import CommitRefused
from specularch.shadow_heap.checks import set_grads

pytestmark = pytest.mark.usefixtures("no_profiling")


class Counter:
    def __init__(self):
        self.n = 0


class Box:
    def __init__(self):
        self.v = 0.0


class Slotted:
    __slots__ = ("a",)

    def __init__(self):
        self.a = 0.0


@dataclasses.dataclass
class Point:
    x: float = 0.0


@dataclasses.dataclass(frozen=True)
class FrozenPoint:
    x: float = 0.0


class World:
    """The state one copy of a program writes."""

    def __init__(self, target):
        self.t = torch.zeros(3)
        self.log: list = []
        self.count = Counter()
        self.target = target
        self.w = nn.Parameter(torch.ones(2))
        self.w2 = nn.Parameter(torch.ones(3))

    def snapshot(self):
        target = self.target
        attrs = (dict(vars(target)) if hasattr(target, "__dict__") and not isinstance(target, nn.Module)
                 else {n: getattr(target, n, None) for n in getattr(type(target), "__slots__", ())})
        if isinstance(target, nn.Module):
            attrs = {**target.state_dict(), "extra": getattr(target, "extra", None)}
        grad = [None if p.grad is None else p.grad.tolist() for p in (self.w, self.w2)]
        return (self.t.tolist(), self.t._version, list(self.log), self.count.n,
                {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in attrs.items()}, grad)


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as e:
        return ("raised", type(e).__name__, str(e))


def _differential(make_target, program, calls, change=None):
    """``program(world) -> fn(x)``, run on an eager and an optimized world; ``calls``: the
    arguments, ``change(world, i)`` between calls (the same on both)."""
    eager_world, fast_world = World(make_target()), World(make_target())
    eager, fast = program(eager_world), specularch.optimize(program(fast_world), backend="fx")
    for i, x in enumerate(calls):
        if change is not None:
            change(eager_world, i)
            change(fast_world, i)
        want, got = _outcome(eager, x), _outcome(fast, x)
        assert got == want, f"call {i}"
        assert fast_world.snapshot() == eager_world.snapshot(), f"call {i}"
    return specularch.explain(fast)


def _writes_then(last):
    """A program making the easy writes, then ``last(world, x)``."""
    def program(world):
        def step(x):
            world.t.add_(1)
            world.count.n += 1
            world.log.append(world.count.n)
            last(world, x)
            return x.sum().item()
        return step
    return program


def _set_grad(world, x):
    world.w.grad = x * 2


def test_a_gradient_of_the_wrong_shape_raises_with_eagers_state():
    ok, wrong = torch.ones(2), torch.ones(3)
    _differential(Box, _writes_then(_set_grad), [ok, ok, wrong, wrong, ok])


def test_a_gradient_of_another_dtype_raises_with_eagers_state():
    _differential(Box, _writes_then(_set_grad), [torch.ones(2), torch.ones(2, dtype=torch.float64),
                                                 torch.ones(2)])


def _set_two_grads(world, x):
    world.w.grad = x[:2] * 2  # assigned in eager before the second one raises
    world.w2.grad = x * 3


def test_a_second_gradient_of_the_wrong_shape_leaves_the_first_assigned_as_in_eager():
    ok, wrong, wrong_later = torch.ones(3), torch.full((4,), 2.0), torch.full((5,), 3.0)
    _differential(Box, _writes_then(_set_two_grads), [ok, ok, wrong, ok, wrong_later, ok])


def _set_v(world, x):
    world.target.v = x.sum().item()


def _set_x(world, x):
    world.target.x = x.sum().item()


def _raising_setter(box, value):
    if value > 2:
        raise ValueError(f"v too large: {value}")
    box.__dict__["v"] = value


def test_a_property_setter_that_raises_added_after_capture():
    class Cls(Box):
        pass

    def change(world, i):
        if i == 2:  # the same class object: no guard on its identity notices
            type(world.target).v = property(lambda self: self.__dict__["v"], _raising_setter)
    big, small = torch.ones(3), torch.ones(1)
    _differential(Cls, _writes_then(_set_v), [big, big, big, small, big], change)


def test_a_read_only_attribute_added_after_capture():
    class Cls(Box):
        pass

    def change(world, i):
        if i == 2:
            type(world.target).v = property(lambda self: 1.0)
    _differential(Cls, _writes_then(_set_v), [torch.ones(2)] * 4, change)


def _setattr_refusing_large(self, name, value):
    if value > 2:
        raise ValueError(f"{name} too large: {value}")
    object.__setattr__(self, name, value)


def test_a_setattr_that_raises_on_a_value_added_after_capture():
    class Cls(Box):
        pass

    def change(world, i):
        if i == 2:
            type(world.target).__setattr__ = _setattr_refusing_large
    big, small = torch.ones(3), torch.ones(1)
    _differential(Cls, _writes_then(_set_v), [big, big, big, small, big], change)


def test_a_dataclass_made_frozen_after_capture():
    @dataclasses.dataclass
    class P(Point):
        pass

    def change(world, i):
        if i == 2:  # what @dataclass(frozen=True) installs
            type(world.target).__setattr__ = FrozenPoint.__setattr__
    _differential(P, _writes_then(_set_x), [torch.ones(2)] * 4, change)


def test_a_frozen_dataclass():
    _differential(FrozenPoint, _writes_then(_set_x), [torch.ones(2)] * 3)


def _refused_by_capture(report):
    """Capture refuses what the commit would refuse (else every call would capture a graph
    whose commit is refused, then run eagerly)."""
    assert report.fallbacks and not any("commit would fail" in str(f) for f in report.fallbacks)


def _set_b(world, x):
    world.target.b = x.sum().item()


def test_a_new_attribute_on_an_object_with_slots_and_no_dict():
    report = _differential(Slotted, _writes_then(_set_b), [torch.ones(2)] * 4)
    _refused_by_capture(report)


def _delete_v(world, x):
    del world.target.v


def test_deleting_a_class_attribute_through_an_instance():
    class Cls(Box):
        v = 1.0  # `del obj.v` finds no `v` on the object itself

    def change(world, i):
        world.target.__dict__.pop("v", None)
    _refused_by_capture(report=_differential(Cls, _writes_then(_delete_v), [torch.ones(2)] * 3, change))


def test_deleting_an_attribute_that_is_gone():
    def change(world, i):
        if i in (1, 3):
            world.target.v = 5.0
    _differential(Box, _writes_then(_delete_v), [torch.ones(2)] * 5, change)


def _set_weight(world, x):
    world.target.extra = x * 1


def test_a_module_attribute_that_became_a_parameter():
    def change(world, i):
        if i == 2:
            del world.target.extra
            world.target.register_parameter("extra", nn.Parameter(torch.zeros(2)))
    def linear():
        torch.manual_seed(0)
        return nn.Linear(2, 2)
    _differential(linear, _writes_then(_set_weight), [torch.ones(2)] * 4, change)


def test_gradients_assigned_before_one_torch_refuses_are_put_back():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    old_a, new_a = torch.zeros(2), torch.full((2,), 5.0)
    a.grad = old_a
    with pytest.raises(CommitRefused, match="attempting to assign a gradient"):
        set_grads((a, a, b), (None, new_a, torch.ones(4)))  # a is set twice, then b fails
    assert a.grad is old_a and b.grad is None
    set_grads((a, b), (new_a, None))
    assert a.grad is new_a and b.grad is None
