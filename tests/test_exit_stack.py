"""``contextlib.ExitStack`` made in the optimized call: managers entered through it (Python
classes, @contextmanager, grad mode), callbacks and exit functions run last-in first-out with
the pending exception, suppression, pop_all/close. Differential on values, gradients, grad
mode, the objects the managers write and raised exceptions."""
import contextlib

import torch

from differential import A, T, check


class Tracker:
    """A manager written in Python that records into an object passed in."""

    def __init__(self, box, name, swallow=False):
        self.box, self.name, self.swallow = box, name, swallow

    def __enter__(self):
        self.box.events.append("enter " + self.name)
        return self

    def __exit__(self, kind, exc, tb):
        self.box.events.append(f"exit {self.name} {kind.__name__ if kind else None}")
        return self.swallow


class Box:
    def __init__(self):
        self.events = []
        self.total = 0


@contextlib.contextmanager
def scaled(box, k):
    box.total += k
    try:
        yield k * 2
    finally:
        box.total -= 1


def stack_of_managers(x, box):
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(Tracker(box, "a"))
        k = stack.enter_context(scaled(box, 3))
        stack.enter_context(torch.no_grad())
        stack.callback(box.events.append, "callback")
        stack.push(lambda kind, exc, tb: box.events.append("pushed"))
        y = x * k
        box.events.append(f"inside {a.name} grad={torch.is_grad_enabled()}")
    return y + x, y.requires_grad


def suppressed_raise(x, box):
    with contextlib.ExitStack() as stack:
        stack.enter_context(Tracker(box, "outer"))
        stack.enter_context(Tracker(box, "swallower", swallow=True))
        stack.enter_context(Tracker(box, "inner"))
        box.total = 1
        raise KeyError("dropped")
    return x * 2


def raising_through(x, box):
    with contextlib.ExitStack() as stack:
        stack.enter_context(Tracker(box, "only"))
        stack.callback(box.events.append, "cb")
        return x[5]  # IndexError from the graph: eager runs it, the callbacks see it


def moved_and_closed(x, box):
    with contextlib.ExitStack() as stack:
        stack.enter_context(Tracker(box, "kept"))
        later = stack.pop_all()  # leaving the `with` runs nothing
        box.events.append("left")
    later.close()
    box.events.append("closed")
    return x.sin()


def test_exit_stack_managers_and_callbacks():
    check(stack_of_managers, lambda: A(T(3, requires_grad=True), Box()), calls=5,
          expect="graph", grad=True)


def test_exit_stack_suppresses_as_eager():
    check(suppressed_raise, lambda: A(T(3), Box()), calls=5, expect="graph")


def test_exit_stack_pop_all_and_close():
    check(moved_and_closed, lambda: A(T(3), Box()), calls=5, expect="graph")


def test_exit_stack_sees_an_exception_from_the_graph():
    check(raising_through, lambda: A(T(3), Box()), calls=4)


def _fail(box):
    box.events.append("failing")
    raise ValueError("from a callback")


def callback_raises(x, box):
    with contextlib.ExitStack() as stack:
        stack.enter_context(Tracker(box, "sees it"))
        stack.callback(_fail, box)
        y = x + 1
    return y


def test_exit_stack_callback_that_raises_runs_eagerly():
    check(callback_raises, lambda: A(T(3), Box()), calls=4, expect="fallback",
          fallback_kind="exception_handling")
