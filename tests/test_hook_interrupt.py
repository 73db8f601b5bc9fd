"""Ctrl-C (KeyboardInterrupt) arriving while the frame hook's callback runs: it reaches the
program, raised at the call being entered, as eager raises it at that point; the hook stays
on in this thread exactly as before (torch leaves a thread's hook off after a callback that
raised), so the rest of the program is intercepted as before. Ordinary errors inside the
callback are still swallowed (the frame runs as plain Python)."""
import pytest

from specularch import frames
from specularch.frames import interceptor


def _fresh_functions():
    """``(caller, leaf)`` with code objects the hook has never seen (it skips a code object
    for good once it said no to it)."""
    ns = {}
    exec(compile("def leaf(x):\n    return x + 1\n\ndef caller(x):\n    return leaf(x) * 2\n",
                 __file__, "exec"), ns)
    return ns["caller"], ns["leaf"]


@pytest.fixture
def interrupting_policy():
    """A global-switch policy that is interrupted (or fails) the first time it is asked
    about a fresh ``leaf``."""
    asked = []
    caller, leaf = _fresh_functions()

    def install(error):
        def policy(frame, code):
            if code is leaf.__code__ and not asked:
                asked.append(code)
                raise error
            return None
        interceptor.set_auto_target(policy)
        return caller
    yield install, asked
    interceptor.set_auto_target(None)


def test_keyboard_interrupt_in_the_callback_reaches_the_program(interrupting_policy):
    install, asked = interrupting_policy
    _caller = install(KeyboardInterrupt("Ctrl-C in the callback"))
    with frames.hook_active():
        assert frames.is_active()
        with pytest.raises(KeyboardInterrupt, match="Ctrl-C in the callback"):
            _caller(1)
        assert asked, "the callback was never asked about _leaf"
        assert frames.is_active(), "the hook was left off in this thread"
        assert _caller(1) == 4  # the program goes on, intercepted as before
    assert not frames.is_active()


def test_an_ordinary_error_in_the_callback_is_still_swallowed(interrupting_policy):
    install, asked = interrupting_policy
    _caller = install(RuntimeError("a bug in a policy"))
    before = interceptor.stats()["callback_errors"]
    with frames.hook_active():
        assert _caller(1) == 4
        assert frames.is_active()
    assert asked and interceptor.stats()["callback_errors"] == before + 1
