"""The worker process forked from the program (``tiering/fork.py``): it starts without
importing torch, compiles candidates that match eager, is refused where a fork is not safe,
never writes the program's buffered output, and is replaced when it dies."""
import concurrent.futures
import io
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import warnings

import pytest

from specularch.tiering import fork, process

import test_tiering
import test_tiering_stall
from test_tiering import _mlp
from test_tiering_stall import _models_stepped, _worker_events

candidates, counted_workers = test_tiering.candidates, test_tiering_stall.counted_workers  # fixtures

pytestmark = pytest.mark.usefixtures("no_profiling")


@pytest.fixture
def no_other_threads():
    """A fork is refused while another thread is busy (not parked where it holds nothing,
    ``fork._busy_threads``): any busy thread an earlier test left fails the test, naming it
    (a leak to fix there), except where fork is never used."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the worker is forked on Linux only")
    assert fork.refusal() is None, fork.refusal()


def test_forked_worker_compiles_candidates_that_match_eager(counted_workers, candidates,
                                                            no_other_threads):
    candidates("torchscript")
    opts = _models_stepped([_mlp], (8, 16), 4)  # (compares with eager at every step)
    events = _worker_events(opts[0])
    assert events and all(e.compiled_in == "worker process" for e in events), events
    (only,) = counted_workers
    assert only.started == "forked" and isinstance(only.child, fork.Forked)
    assert only.child.pid != os.getpid() and only.child.poll() is None  # still warm


def test_fork_is_refused_while_another_thread_is_busy(no_other_threads):
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sum(range(100))
    other = threading.Thread(target=busy, name="the program's loader")
    other.start()
    try:
        assert "the program's loader" in fork.refusal()
        process.shut_down()
        started = process._worker()
        assert started.started.startswith("new interpreter (other threads run")
        assert not isinstance(started.child, fork.Forked)
    finally:
        stop.set()
        other.join()
        process.shut_down()


def test_threads_parked_where_they_hold_nothing_do_not_refuse_a_fork(no_other_threads):
    """An idle pool (Inductor's compile threads after a pinned ``inductor``), a writer
    thread waiting on its queue (TensorBoard's), a thread waiting on an event or a join."""
    stop, jobs = threading.Event(), queue.Queue()
    waiting = [threading.Thread(target=jobs.get, name="writer"),
               threading.Thread(target=stop.wait, name="waiter")]
    waiting.append(threading.Thread(target=waiting[1].join, name="joiner"))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(abs, [-1, -2, -3])) == [1, 2, 3]
        for t in waiting:
            t.start()
        time.sleep(0.1)  # (each reaches its wait)
        try:
            assert fork.refusal() is None
            sleeper = threading.Thread(target=time.sleep, args=(0.5,), name="sleeper")
            sleeper.start()  # not known to hold nothing: refused
            assert "sleeper" in fork.refusal()
            sleeper.join()
        finally:
            jobs.put(None)
            stop.set()
            for t in waiting:
                t.join()


def test_a_fork_never_writes_the_programs_buffered_output(counted_workers, candidates,
                                                          no_other_threads, monkeypatch, capfd):
    """stdout redirected to a file is block-buffered: text the program printed but had not
    written yet is copied into the child; written there it would appear twice (or inside the
    worker's answers). The child answers on a pipe of its own and leaves those streams be."""
    buffered = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=False)
    monkeypatch.setattr(sys, "stdout", buffered)
    print("the program's pending line", end="")  # in the buffer, not written
    candidates("torchscript")
    opts = _models_stepped([_mlp], (8, 16), 4)
    assert all(e.decision in ("kept", "rejected") for e in _worker_events(opts[0]))
    (only,) = counted_workers
    assert only.started == "forked"
    only.log.seek(0)
    assert b"pending line" not in only.log.read()
    monkeypatch.undo()
    buffered.close()  # written now, by the program: once
    assert capfd.readouterr().out.count("the program's pending line") == 1


def test_a_dead_forked_worker_is_reaped_and_replaced(counted_workers, candidates, no_other_threads):
    first = process._worker()
    assert isinstance(first.child, fork.Forked)
    first.child.kill()
    assert first.child.wait() == -9 and first.child.stdout.closed and first.child.poll() == -9
    candidates("torchscript")
    opts = _models_stepped([_mlp], (8, 16), 4)  # its job finds the dead one, starts another
    events = _worker_events(opts[0])
    assert events and all(e.decision in ("kept", "rejected") for e in events), events
    dead, second = counted_workers
    assert (dead, dead.jobs) == (first, 0) and second.jobs == len(events)
    assert second.started == "forked" and second.child.poll() is None


def test_a_forked_worker_takes_one_compile_thread_though_inductor_read_its_config_before(
        monkeypatch):
    """The program imported Inductor (its config read ``TORCHINDUCTOR_COMPILE_THREADS`` then,
    unset: a pool of compile processes per core); the forked child sets the variable and
    must make the config say one thread, as a new interpreter's does."""
    from torch._inductor import config as inductor_config
    from specularch.fx_lower import _torch_compilers as compilers
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    before = inductor_config.compile_threads  # (not monkeypatch.setattr: its undo deletes
    inductor_config.compile_threads = 7       # a key of Inductor's config module)
    try:
        compilers.compile_threads_from_environment()
        assert inductor_config.compile_threads == 1
    finally:
        inductor_config.compile_threads = before


def test_loading_the_workers_torchscript_leaves_the_warning_filters_alone(
        counted_workers, candidates, monkeypatch):
    """``warnings.catch_warnings`` swaps the process-wide filters: on the background thread,
    loading a candidate would drop a warning the program raised meanwhile. It is used there
    no more (``compile_cache.quiet_warnings``)."""
    swaps = []
    original = warnings.catch_warnings

    def recording(*args, **kwargs):
        swaps.append((threading.current_thread().name, sys._getframe(1).f_globals["__name__"]))
        return original(*args, **kwargs)
    monkeypatch.setattr(warnings, "catch_warnings", recording)
    candidates("torchscript")
    opts = _models_stepped([_mlp], (8, 16), 4)
    events = _worker_events(opts[0])
    assert events and all(e.compiled_in == "worker process" for e in events), events
    assert not [s for s in swaps if s[0] != threading.main_thread().name
                and s[1].startswith("specularch.")]


def test_an_inductor_job_of_a_program_on_several_threads_gets_a_new_interpreter(no_other_threads):
    """A child forked from a program whose OpenMP pool exists hangs in an OpenMP region of more
    than one thread, which the Inductor package's test run opens for such a program: that job
    goes to a new interpreter (the forked worker is retired), TorchScript's still fork."""
    assert process.forkable("torchscript", 8) and process.forkable("inductor", 1)
    assert not process.forkable("inductor", 2)
    process.shut_down()
    try:
        forked = process._worker()
        assert forked.started == "forked" and process._worker(may_fork=True) is forked  # warm
        new = process._worker(may_fork=False)
        assert new is not forked and new.started.startswith("new interpreter (an Inductor job")
        assert forked.child.poll() == -9  # retired
        assert process._worker(may_fork=True) is new  # a new interpreter serves every job
    finally:
        process.shut_down()


def test_the_programs_signal_handlers_never_run_in_the_forked_worker(no_other_threads, tmp_path):
    """A program's handler (saving a checkpoint on SIGUSR1, say) must not run in the child on
    its stale copy; Ctrl-C, sent to the whole process group, leaves the child alive."""
    ran = tmp_path / "handler ran"
    previous = signal.signal(signal.SIGUSR1, lambda *_: ran.write_text(str(os.getpid())))
    process.shut_down()
    try:
        child = process._worker().child
        assert isinstance(child, fork.Forked)
        time.sleep(0.2)  # (past the fork's set-up)
        os.kill(child.pid, signal.SIGINT)
        time.sleep(0.2)
        assert child.poll() is None  # ignored
        os.kill(child.pid, signal.SIGUSR1)
        assert child.wait() == -signal.SIGUSR1  # its default action, not the program's handler
        assert not ran.exists()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        process.shut_down()


class _Finalized:
    def __init__(self, path):
        self.path = path

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def test_the_child_releases_nothing_the_programs_frames_hold(no_other_threads, tmp_path):
    """The worker is forked from the background thread; the child drops the program's
    threads, and CPython 3.11 frees their frames without releasing what they hold: no
    finalizer of the program's runs there, no temporary directory of its goes."""
    calls = tmp_path / "finalized"
    held, folder = _Finalized(calls), tempfile.TemporaryDirectory()
    process.shut_down()
    try:
        started = threading.Event()
        worker_thread = threading.Thread(
            target=lambda: (process._worker(), started.set()), name="specularch-tier-compiler")
        worker_thread.start()  # (forks from a thread other than this, the program's main one)
        worker_thread.join()
        assert started.is_set() and process._current.started == "forked"
        time.sleep(0.3)  # (the child is past its set-up: it releases there if anywhere)
        assert process._current.child.poll() is None
    finally:
        process.shut_down()
    assert not calls.exists() and os.path.isdir(folder.name)
    del held
    assert calls.read_text() == f"{os.getpid()}\n"
    folder.cleanup()


def test_the_fork_happens_with_torchs_seeding_lock_held(monkeypatch):
    """``torch.manual_seed`` takes ``torch.cuda._initialization_lock`` (CUDA or not), and
    Inductor's compile in the worker takes it too: a fork while the program's main thread
    seeded left the worker waiting on it forever. The forking thread holds it across
    ``os.fork`` (``_torch_fork.py``), so a seeding main thread waits for the fork instead."""
    import torch
    held = []

    class Forked(Exception):
        pass

    def fake_fork():
        held.append(torch.cuda._initialization_lock.locked())
        raise Forked
    monkeypatch.setattr(fork.os, "fork", fake_fork)
    with pytest.raises(Forked):
        fork.start(0, 2, (), {})
    assert held == [True]
    assert not torch.cuda._initialization_lock.locked()  # released after the fork
    torch.manual_seed(0)


def test_a_program_holding_more_than_max_memory_gets_a_new_interpreter(no_other_threads, monkeypatch):
    """A fork stalls the program ~25 ms per GiB and the child keeps a copy of each page the
    program writes afterwards: above ``fork.MAX_MEMORY`` the worker is a new interpreter."""
    held = fork.program_memory()
    assert held is not None and 50 * 2**20 < held < 64 * 2**30  # torch is imported: not nothing
    monkeypatch.setattr(fork, "MAX_MEMORY", held // 2)
    why = fork.refusal()
    assert why.startswith(f"the program holds {held / 2**30:.1f} GiB (fork.MAX_MEMORY"), why
    assert "ms and keep a copy of each page it writes" in why
    process.shut_down()
    try:
        started = process._worker()
        assert started.started == f"new interpreter ({why})"
        assert not isinstance(started.child, fork.Forked)
    finally:
        process.shut_down()


def _until(condition, seconds=10.0):
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.02)
    return condition()


def test_a_worker_without_a_job_for_idle_seconds_is_stopped(no_other_threads, monkeypatch, candidates,
                                                            counted_workers):
    """An idle forked worker holds a copy of each page the program wrote since the fork (and an
    idle interpreter its compilers): stopped after ``IDLE_SECONDS`` without a job, and the next
    graph's candidates start another."""
    from specularch.tiering import worker
    monkeypatch.setattr(worker, "IDLE_POLL", 0.05)
    monkeypatch.setattr(process, "IDLE_SECONDS", 60.0)
    candidates("torchscript")
    _models_stepped([_mlp], (8, 16), 4)
    (first,) = counted_workers
    time.sleep(0.5)  # polled ~10 times, far from IDLE_SECONDS
    assert process._current is first and first.child.poll() is None
    monkeypatch.setattr(process, "IDLE_SECONDS", 0.3)
    assert _until(lambda: process._current is None and first.child.poll() is not None)
    assert not process._prestarted  # (the next graph's prestart starts one)
    _models_stepped([_mlp], (8, 16), 4)  # a new graph's candidates: a new worker
    assert len(counted_workers) == 2 and counted_workers[1] is not first
    assert _until(lambda: process._current is None)
