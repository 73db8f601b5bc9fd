"""One graph under tiering: its calls counted until it is hot, its candidates compiled in the
background, each timed on live calls against the current tier, the fastest kept.

The ``Tier`` stands in the graph entry's ``fn`` (what the hot path calls) only while there is
something to measure or decide; once every candidate is decided the entry's ``fn`` is the
winner's entry function itself, with no wrapper left. Every change of the entry is one
attribute assignment, which a call on another thread sees either before or after.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from .. import log
from ..config import config
from ..eager_run import EagerRun
from ..entry_function import MISS
from ..fx_lower import get_backend
from ..fx_lower import compile_cache
from ..fx_lower.backends import compile_in_background
from ..fx_lower.passes import example_inputs
from ..fx_lower.randomness import graph_uses_randomness
from ..records import AssumptionBroken
from .. import _glibc_malloc
from . import hot_sizes, policy, process, remembered, worker
from .backward_timing import BackwardTimer, grad_outputs
from .eager_tier import EAGER, RunTimer
from .same_draws import Checked
from .hot_sizes import SizeCount
from .history import FAILED, KEPT, RAISED, REFUSED, REJECTED, REMEMBERED, TierEvent, TierHistory


SAMPLE = 4  # hits per CPU-time reading while a graph is not yet hot


@dataclass
class Candidate:
    backend: str
    fn: Callable          # its entry function (guards, compiled graph, commit)
    graph_fn: Callable
    source: str
    compile_seconds: float
    compiled_in: str = ""
    # Its first calls, for a graph that draws random numbers: checked against fx's draws.
    checked_fn: Callable | None = None


class Tier:
    """``build(graph_fn) -> (entry fn, source)`` wraps a compiled graph in the entry's guards
    and commit (``dispatch/misses.py``, which this package does not import); ``eager()``
    makes the eager tier's entry function (``eager_tier.py``), None where there is none."""

    def __init__(self, entry, gm, build: Callable, eager: Callable | None = None):
        self.entry, self.gm, self.build, self.eager = entry, gm, build, eager
        self.fn = entry.fn  # the current tier's entry function
        self.reference = entry.graph_fn  # fx's graph: eager's random numbers
        self.random = graph_uses_randomness(gm)
        self.history = entry.tier = TierHistory()
        self.hits, self.submitted = 0, False
        self.sampled: deque[float] = deque(maxlen=15)  # CPU seconds of the sampled calls
        self.todo: deque[str] = deque()  # candidates not compiled yet, in order
        self.ready: deque[Candidate] = deque()
        self.compiling = 0
        self.trial: Trial | None = None
        self.lock = threading.Lock()
        self.trial_calls = config.tier_trial_calls  # read here: config.patch is per thread
        self.tune_malloc = config.tune_malloc
        # The program's torch thread count (per thread: the background one's differs), part
        # of the key its trials' verdicts are remembered under (remembered.py)
        self.threads = torch.get_num_threads()
        self.key: str | None = None  # that key, found on the background thread,
        self.earlier: dict[str, dict] | None = None  # and what was remembered under it
        # A forward graph with dynamic sizes: the sizes of its calls, counted until it is hot;
        # then those of most calls, if any, which its candidates are compiled for (hot_sizes.py)
        dynamic = hot_sizes.counted(gm)
        self.size_count = SizeCount(self.reference, dynamic) if dynamic else None
        self.sizes: list[tuple[int, ...]] | None = None  # (set when the graph is hot)
        if self.size_count is not None:
            self.fn = build(self.size_count)[0]
        entry.fn = self

    def __call__(self, L, C, G, B):
        trial = self.trial
        if trial is not None:
            return trial.call(L, C, G, B)
        if self.submitted:  # candidates compiling: nothing to measure yet
            return self.fn(L, C, G, B)
        # Only calls the graph ran count (and are sampled): a call its guards turn away
        # (MISS: another graph of the function runs it) is not this graph's. Counted per
        # call tried, a graph taking every other call (a training step beside an eval pass)
        # was sampled only on the calls it turned away, and never got hot.
        if (self.hits + 1) % SAMPLE:
            result = self.fn(L, C, G, B)
            if result is not MISS:
                self.hits += 1
            return result
        # CPU time of this thread, not wall time: on a busy machine a preempted call would
        # make a small graph look hot. Read on one hit in SAMPLE: reading it is a system
        # call (µs), as much as a small graph's whole call. The graph's time so far is
        # estimated as hits x the median sampled call, so that one slow call (a collection,
        # a page-faulting first run) does not make a small graph look hot.
        start = time.thread_time()
        result = self.fn(L, C, G, B)
        if result is not MISS:
            self.hits += 1
            self.sampled.append(time.thread_time() - start)
            seconds = self.hits * statistics.median(self.sampled)
            if policy.hot(self.hits, seconds):
                self._submit()
            elif seconds * 4 >= config.tier_min_seconds:  # a quarter of the way to hot
                process.prestart(self.gm, policy.CANDIDATES, lambda: set(self._earlier()))
        return result

    def _submit(self) -> None:
        self.submitted = True
        self.history.submitted_at = time.perf_counter()
        if self.size_count is not None:  # counted enough: fx's own entry again
            self.sizes = self.size_count.common()
            self.fn = self.build(self.reference)[0]
        with self.lock:
            for name, refusal in policy.candidates(self.gm):
                if name == EAGER and self.eager is None:
                    refusal = "this graph's path may not run as the original Python"
                if refusal:
                    self.history.add(TierEvent(name, REFUSED, reason=refusal))
                else:
                    self.todo.append(name)
            self._next_trial()

    def _compile(self, name: str) -> None:
        """On the worker thread: compile, build the entry function, queue it for a trial
        (unless an earlier run rejected it: ``_skipped``)."""
        if self._skipped(name):
            return
        start = time.perf_counter()
        if name == EAGER:  # nothing to compile: the guards' check function
            fn = self.eager()
            with self.lock:
                self.compiling -= 1
                self.ready.append(Candidate(EAGER, fn, None, "(the original Python)",
                                            time.perf_counter() - start, "guards only"))
                self._next_trial()
            return
        examples = example_inputs(self.gm)
        sizes = self.sizes if process.ENABLED else None  # (hot_sizes.py)
        # (counted, no sizes most calls': what was counted, in the refusal)
        counted = self.size_count.summary() if self.size_count is not None and sizes is None else ""
        why_not = process.route(name, self.gm, sizes is not None, counted) if process.ENABLED else \
            "process.ENABLED is off"
        where = "worker process" if why_not is None else f"thread: {why_not}"
        try:
            graph_fn = None
            if why_not is None:
                try:
                    if sizes is None:
                        graph_fn = process.compile_candidate(name, self.gm, examples, process.TIMEOUT)
                    else:  # one form per common size (other sizes: fx)
                        graph_fn, examples = self._forms(name, sizes)
                except process.NotSplit as e:
                    where = f"thread: its AOT-autograd form cannot be sent ({e})"
            if graph_fn is None:
                graph_fn = compile_in_background(get_backend(name), self.gm, examples, worker.submit)
            if compile_cache.from_cache(graph_fn):
                where = "from the compile cache"
            if getattr(graph_fn, "artefact_note", ""):  # e.g. not the form it should be
                where += f"; {graph_fn.artefact_note}"
            if not self.random:  # its first calls' work, off the program's steps; a graph that
                # draws random numbers would draw them here, beside the program, from its generator:
                # its first calls are the checked ones in the trial instead (same_draws.py)
                worker.warm_up(graph_fn, examples)
            fn, source = self.build(graph_fn)
            checked_fn = self.build(Checked(graph_fn, self.reference))[0] if self.random else None
        except Exception as e:
            reason = str(e) if isinstance(e, process.WorkerFailed) else f"{type(e).__name__}: {e}"
            with self.lock:
                self.compiling -= 1
                self.history.add(TierEvent(name, FAILED, time.perf_counter() - start,
                                           reason=reason, compiled_in=where))
                self._next_trial()
            return
        with self.lock:
            self.compiling -= 1
            self.ready.append(Candidate(name, fn, graph_fn, source, time.perf_counter() - start,
                                        where, checked_fn))
            self._next_trial()

    def _forms(self, name: str, sizes: list) -> tuple[Callable, list]:
        """(On the worker thread.) ``name``'s form of the graph for each of ``sizes``,
        compiled by the worker one after the other and chosen by each call's sizes
        (``hot_sizes.checked``), and the example inputs of the first. The forms after the
        first are warmed up here, each on its own sizes (the first with the whole)."""
        forms, first = [], None
        for each in sizes:
            fixed = hot_sizes.examples(self.gm, each)
            compiled = process.compile_candidate(name, self.gm, fixed, process.TIMEOUT,
                                                 fixed_sizes=True)
            if first is None:
                first = fixed
            elif not self.random:  # (see _compile)
                worker.warm_up(compiled, fixed)
            forms.append((each, compiled))
        return hot_sizes.checked(forms, self.gm), first

    def _earlier(self) -> dict[str, dict]:
        """(On the worker thread.) The rejections earlier runs left for this graph, read once."""
        if self.earlier is None:
            self.key = remembered.graph_key(self.gm, self.threads)
            self.earlier = remembered.rejections(self.key)
        return self.earlier

    def _skipped(self, name: str) -> bool:
        """(On the worker thread.) Whether an earlier run rejected ``name`` for this graph,
        against the tier the graph is on now (one candidate at a time: the earlier ones are
        decided), and that is still remembered: then it is neither compiled nor timed in this
        run, one run fewer is left to skip it, and the history says so. One that lost against
        another tier is tried (``eager`` rejected against TorchScript must be tried again
        where this run stayed on ``fx``)."""
        try:
            earlier = self._earlier().get(name)
            if earlier is None or earlier["against"] != self.history.tier:
                return False  # (lost against another tier than this run's: tried)
            left = earlier["runs_left"] - 1
            remembered.remember(self.key, name, {**earlier, "runs_left": left} if left > 0 else None)
        except Exception as e:  # (a job must not raise) nothing remembered: it is tried
            log.emit("graphs", f"tiering: could not read earlier decisions: {type(e).__name__}: {e}")
            return False
        with self.lock:
            self.compiling -= 1
            self.history.add(TierEvent(
                name, REMEMBERED, candidate_us=earlier["candidate_us"],
                current_us=earlier["current_us"], against=earlier["against"],
                reason=f"not tried in this run; tried again after {left} more" if left
                else "not tried in this run; tried again in the next"))
            self._next_trial()
        return True

    def _record(self, event: TierEvent) -> None:
        """(On the worker thread.) Remember a rejection for the next runs; a kept candidate
        clears one."""
        try:
            rejected = None if event.decision == KEPT else {
                "candidate_us": event.candidate_us, "current_us": event.current_us,
                "against": event.against, "runs_left": policy.REMEMBER_RUNS}
            self._earlier()  # (the key)
            remembered.remember(self.key, event.candidate, rejected)
        except Exception as e:  # (a job must not raise) a decision not remembered: tried again
            log.emit("graphs", f"tiering: could not remember {event}: {type(e).__name__}: {e}")

    def _next_trial(self) -> None:
        """(With ``lock`` held.) Time the next compiled candidate, else compile the next one,
        or, when none is left, put the current tier's entry function in place of this
        wrapper. One candidate at a time, compiled then timed: a trial timed while the next
        candidate compiles beside it measures the compile's contention, not the candidate."""
        if self.trial is not None:
            return
        if self.ready:
            candidate = self.ready.popleft()
            if candidate.backend != EAGER and self.tune_malloc:
                _glibc_malloc.tune_logged("before the first compiled candidate's trial")
            self.trial = Trial(self, candidate)
        elif self.compiling:
            return
        elif self.todo:
            self.compiling += 1
            name = self.todo.popleft()
            worker.submit(lambda: self._compile(name))
        else:
            self.history.settled = True
            self.entry.fn = self.fn

    def decide(self, trial: Trial, event: TierEvent) -> None:
        with self.lock:
            if self.trial is not trial:
                return
            self.history.add(event)
            if event.decision in (KEPT, REJECTED):
                worker.submit(lambda: self._record(event))
            if event.decision == KEPT:
                c, entry = trial.candidate, self.entry
                self.fn = c.fn
                entry.backend, entry.entry_source = c.backend, c.source
                if c.graph_fn is not None:  # (the eager tier keeps the last graph's, unused)
                    entry.graph_fn = c.graph_fn
            self.trial = None
            self._next_trial()


class Trial:
    """A candidate against the current tier on live calls: ``policy.WARM_UP`` untimed calls
    of the candidate (for a graph that draws random numbers, each checked to draw eager's),
    then ``policy.ROUNDS`` rounds of ``k`` calls each side, interleaved (so
    that a slow phase of the program, or a compile running beside it, weighs on both),
    compared by median of the calls' CPU time (``policy.clock``); one faster within the
    margin gets more rounds (``policy.MAX_ROUNDS``). The ``eager`` candidate
    has no warm-up: the original Python has no first-call work of its own to keep out of
    the timing, and each of its calls is a step at eager's speed."""

    def __init__(self, tier: Tier, candidate: Candidate):
        self.tier, self.candidate = tier, candidate
        self.calls = 0
        self.warm_up = 0 if candidate.backend == EAGER else policy.WARM_UP
        self.samples: tuple[list, list] = ([], [])  # seconds per call: current, candidate
        self.k = tier.trial_calls
        self.weighed = 0  # calls per side when the samples were last weighed (_add)
        # Chosen by the first call, on the program's thread: a trial is made on whichever
        # thread decided the last one (often the background thread), and with OpenMP
        # torch's thread count is per thread (a thread keeps the count of the moment it was
        # made): the program's later set_num_threads(1) is not the background thread's.
        self.clock = None
        # Forward graphs whose results need autograd: each call timed with its backward
        # (backward_timing.py; the eager tier's run too, once it returned: RunTimer).
        self.with_backward = policy.times_backward(tier.gm)
        self.pending: BackwardTimer | None = None  # the last call's, until its backward ran

    def call(self, L, C, G, B):
        if self.pending is not None:
            self._flush()
        # (calls the graph ran, as Tier counts them: a call its guards turn away leaves the
        # trial where it was, so that the warm-up's checked calls are real ones, and two
        # graphs taking turns do not leave one side without samples)
        n = self.calls
        timed = n >= self.warm_up
        side = ((n - self.warm_up) // self.k) % 2 if timed else 1
        fn = self.candidate.fn if side else self.tier.fn
        if not timed and self.candidate.checked_fn is not None:
            fn = self.candidate.checked_fn  # (same_draws.py)
        if self.clock is None:
            self.clock = policy.clock()
        start = self.clock()
        try:
            result = fn(L, C, G, B)
        except AssumptionBroken:
            raise  # the call's assumption, not the candidate's failure: the dispatcher's
        except Exception as e:
            if not side:
                raise
            # The candidate's graph raised: nothing was committed (the entry function
            # commits after the graph), so the current tier runs the call instead.
            self.tier.decide(self, TierEvent(self.candidate.backend, RAISED,
                                             self.candidate.compile_seconds,
                                             reason=f"{type(e).__name__}: {e}; stays on "
                                                    f"{self.tier.history.tier}",
                                             compiled_in=self.candidate.compiled_in))
            return self.tier.fn(L, C, G, B)
        elapsed = self.clock() - start
        if result is not MISS:
            self.calls = n + 1
        # (not while another graph's candidate compiles: see Tier._next_trial)
        if timed and result is not MISS and not worker.pending():
            if type(result) is EagerRun:  # the eager tier: its run comes after this returns
                result.timer = RunTimer(self.clock, elapsed, lambda s: self._add(side, s),
                                        (lambda s, out: self._time_backward(side, s, out))
                                        if self.with_backward else None)
            elif not (self.with_backward and self._time_backward(side, elapsed, result)):
                self._add(side, elapsed)
        return result

    def _time_backward(self, side: int, elapsed: float, result) -> bool:
        outputs = grad_outputs(result)
        if not outputs:
            return False
        self.pending = BackwardTimer(self.clock, elapsed, side, self._backward_done)
        self.pending.attach(outputs)
        return True

    def _backward_done(self, timer: BackwardTimer, seconds: float) -> None:
        if self.pending is timer:
            self.pending = None
            self._add(timer.side, seconds)

    def _flush(self) -> None:
        """The last call's outputs got no backward before this call: its forward alone."""
        timer, self.pending = self.pending, None
        self._add(timer.side, timer.forward)

    def _add(self, side: int, seconds: float) -> None:
        self.samples[side].append(seconds)
        if self._hopeless(side):
            self.tier.decide(self, self._verdict())
            return
        done = min(map(len, self.samples))
        if done < self.k * policy.ROUNDS or done % self.k or done == self.weighed:
            return
        self.weighed = done  # (each side's round ends once: weigh it once)
        current, candidate = (statistics.median(s) for s in self.samples)
        if done < self.k * policy.MAX_ROUNDS and policy.undecided(candidate, current):
            return  # faster, within the margin: another round
        self.tier.decide(self, self._verdict())

    def _hopeless(self, side: int) -> bool:
        """After the candidate's first round: far slower already (``policy.HOPELESS``), so
        that a trial of a slow candidate costs the program one round, not three."""
        current, candidate = self.samples
        if not side or len(candidate) != self.k or len(current) < self.k:
            return False
        return policy.hopeless(statistics.median(candidate), statistics.median(current))

    def _verdict(self) -> TierEvent:
        current_us, candidate_us = (statistics.median(s) * 1e6 for s in self.samples)
        decision = KEPT if policy.faster(candidate_us, current_us) else REJECTED
        return TierEvent(self.candidate.backend, decision, self.candidate.compile_seconds,
                         candidate_us, current_us, self.tier.history.tier,
                         compiled_in=self.candidate.compiled_in)
