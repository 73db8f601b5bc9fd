"""pytest plugin (entry point ``pytest11``), active once specularch is installed.

* ``pytest --specularch=on`` runs the suite with the global switch (see ``specularch/frames/policy.py``);
* ``pytest --specularch=compare`` does the same in validation mode: every optimized call is
  also run eagerly on copies of its arguments and compared (``validate.py``); a difference
  fails the test with a report naming the function, the graph, its guards and the value;
* ``--specularch=off`` (default) changes nothing;
* ``@pytest.mark.specularch_skip`` excludes a test;
* the fixture ``specularch_compare(fn, *args, backends=["fx", ...])`` compares ``fn`` eager
  against each backend explicitly and returns the ``explain`` reports;
* a test fails when a mismatch was raised during it, also when the test caught it;
* the run ends with a summary: optimized calls, graphs, fallback calls by kind, mismatches.
"""
from __future__ import annotations

import collections

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("specularch")
    group.addoption("--specularch", choices=("off", "on", "compare"), default="off",
                    help="run tests with specularch enabled globally (on), in validation "
                         "mode against eager (compare), or not at all (off, default)")


def pytest_configure(config):
    config.addinivalue_line("markers", "specularch_skip: do not run this test under specularch")
    mode = config.getoption("--specularch", default="off")
    if mode == "off":
        return
    from . import dispatch, startup, validate
    from .config import check_environment
    errors, _ = check_environment()  # the backend may be registered later, by a conftest
    if errors:
        raise pytest.UsageError(f"specularch: {errors[0]}")
    startup.activate()
    if mode == "compare":
        dispatch.set_run_wrapper(validate.validator)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    mode = item.config.getoption("--specularch", default="off")
    if mode == "off":
        yield
        return
    from . import dispatch, frames, validate
    skipped = item.get_closest_marker("specularch_skip") is not None
    validator = dispatch.run_wrapper()
    if skipped:
        frames.disable_globally()
        dispatch.set_run_wrapper(None)
    before = len(validate.MISMATCHES)
    try:
        outcome = yield
    finally:
        dispatch.set_run_wrapper(validator)
        if skipped:
            frames.enable_globally()
    # A mismatch raised inside the test may have been caught by the test's own ``except``.
    if len(validate.MISMATCHES) > before and outcome.exception is None:
        outcome.force_exception(validate.SpecularchMismatch(
            "caught by the test, but a specularch mismatch was raised:\n"
            + validate.MISMATCHES[before]))


# What each test's optimized calls did, kept past ``specularch.reset()`` (which a suite's
# fixtures may call after every test) for the summary: id(stats) -> (stats, fallback records,
# graph count, code). The stats object is held so that its id is not reused.
_SEEN: dict[int, tuple] = {}


def _record_states() -> None:
    from . import dispatch
    for state in dispatch.all_states():
        if state.stats.calls:
            target = state.target
            _SEEN[id(state.stats)] = (state.stats, state.fallbacks, len(state.entries),
                                      (target.filename, target.firstlineno, target.name))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    if item.config.getoption("--specularch", default="off") != "off":
        _record_states()  # before the fixtures' teardown, which may reset specularch
    yield


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.getoption("--specularch", default="off") == "off":
        return
    from . import validate
    _record_states()
    seen = list(_SEEN.values())
    records = [f for _, fallbacks, _, _ in seen for f in fallbacks.values()]
    calls, sites = collections.Counter(), collections.defaultdict(set)
    for record in records:
        calls[record.kind] += record.count  # calls that ran eagerly because of this record
        sites[record.kind].add((record.filename, record.lineno, record.function))
    stats = [s for s, _, _, _ in seen]
    codes = {code for _, _, _, code in seen}
    write = terminalreporter.write_line
    terminalreporter.section("specularch")
    write(f"optimized code objects: {len(codes)}, graphs: {sum(g for _, _, g, _ in seen)}, "
          f"calls: {sum(s.calls for s in stats)} (graph hits: {sum(s.graph_hits for s in stats)}, "
          f"captures: {sum(s.captures for s in stats)}, profiled eagerly: "
          f"{sum(s.profiled_calls for s in stats)}, fell back to eager: "
          f"{sum(s.fallback_calls for s in stats)})")
    write("fallback calls by kind: " + (", ".join(
        f"{k}={calls[k]} ({len(sites[k])} site{'s' if len(sites[k]) > 1 else ''})"
        for k in sorted(calls)) or "none"))
    write(f"mismatches: {len(validate.MISMATCHES)}")


@pytest.fixture
def specularch_compare():
    """``specularch_compare(fn, *args, backends=("fx",))``: eager vs each backend, exact for
    ``fx`` and within float tolerance for compiling backends; returns the reports."""
    import torch

    import specularch

    def compare(fn, *args, backends=("fx",), **kwargs):
        expected = fn(*args, **kwargs)
        reports = []
        for backend in backends:
            optimized = specularch.optimize(fn, backend=backend)
            with specularch.config.patch(profile_calls=0):
                for _ in range(2):  # capture, then a cache hit
                    got = optimized(*args, **kwargs)
                    if backend == "fx":
                        torch.testing.assert_close(got, expected, rtol=0, atol=0)
                    else:
                        torch.testing.assert_close(got, expected)
            reports.append(specularch.explain(optimized))
        return reports

    return compare
