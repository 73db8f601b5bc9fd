"""``str(specularch.explain(obj))`` is a short summary (guards and inputs counted, every
fallback and recompile with its reason and ``file:line``); ``explain(obj, verbose=True)`` lists
every guard and the graph code; ``SPECULARCH_LOG=guards,graphs`` logs them while a script runs
under ``python -m specularch explain``, whose end-of-program report is the summary."""
import io
import os
import re
import subprocess
import sys
import textwrap

import torch
from torch import nn

import specularch
from specularch.explain import DETAIL_HINT
from differential import mse_train_step

GRAPH_LINE = re.compile(r"^  graph (\d+): backend=(\S+) runs=(\d+) capture=[\d.]+ms "
                        r"compile=[\d.]+ms inputs=(\d+) guards=(\d+) \(([\d.]+)µs\)$", re.M)


def _mlp_adam():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


_step = mse_train_step


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _trained_adam_step():
    """A 3-layer MLP Adam step run optimized and eagerly (same results, checked)."""
    (m_fast, o_fast), (m_ref, o_ref) = _mlp_adam(), _mlp_adam()
    fast, slow = specularch.optimize(_step(m_fast, o_fast)), _step(m_ref, o_ref)
    for i in range(6):
        assert fast(*_batch(i)) == slow(*_batch(i)), f"loss differs at step {i}"
    for p, q in zip(m_fast.parameters(), m_ref.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
    return fast


def _check_graph_lines(e, summary):
    """One summary line per graph, with the graph's own backend, runs, input and guard counts,
    and what one check of its guards costs."""
    found = GRAPH_LINE.findall(summary)
    assert [int(i) for i, *_ in found] == list(range(len(e.graphs))), summary
    for (_, backend, runs, inputs, guards, micros), g in zip(found, e.graphs):
        assert (backend, int(runs), int(inputs), int(guards)) == (
            g.backend, g.hits, len(g.inputs), len(g.guards)), summary
        assert 0 < float(micros) < 10_000 and abs(float(micros) - g.guard_us) <= 0.05, summary


def test_mlp_adam_step_summary_is_short_and_counts_guards():
    fast = _trained_adam_step()
    e = specularch.explain(fast)
    summary = str(e)
    assert 5 <= len(summary.splitlines()) <= 25, summary
    assert len(e.guards) > 50  # what the summary leaves out: the step has many guards
    assert summary.startswith("specularch report for mse_train_step.<locals>.train_step\nstats: calls=6 ")
    _check_graph_lines(e, summary)
    assert not any(g in summary for g in e.guards), summary  # counted, not listed
    assert "def forward(" not in summary and "  guards:" not in summary
    assert summary.splitlines()[-1] == DETAIL_HINT
    assert "fallbacks: 0" in summary and "recompiles: 0" in summary


def test_verbose_lists_every_guard_input_and_code_line():
    fast = _trained_adam_step()
    e, full = specularch.explain(fast), specularch.explain(fast, verbose=True)
    assert e == full  # the same report; only its text differs
    lines = str(full).splitlines()
    assert len(lines) > 100 and DETAIL_HINT not in lines
    for g in e.graphs:
        assert all(f"    {guard}" in lines for guard in g.guards), "a guard is missing"
        assert all(f"    {line}" in lines for line in g.code.splitlines()), "a code line is missing"
        assert "  inputs: " + ", ".join(g.inputs) in lines
    e.verbose = True  # the attribute the flag sets: the same text
    assert str(e) == str(full)


def affine(x, w):
    return x @ w + 1


def test_recompiles_keep_their_reason_and_line_in_the_summary():
    opt = specularch.optimize(affine)
    with specularch.config.patch(profile_calls=0, cache_limit=8):
        for shape in [(4, 3), (4, 3), (5, 3), (5, 3)]:
            x, w = torch.randn(*shape), torch.randn(3, 2)
            assert torch.equal(opt(x, w), affine(x, w))
        x = torch.randn(4, 3, dtype=torch.float64)  # dtype: not relaxed, a new graph
        w = torch.randn(3, 2, dtype=torch.float64)
        assert torch.equal(opt(x, w), affine(x, w))
    e = specularch.explain(opt)
    summary = str(e)
    assert len(e.graphs) >= 2 and e.recompiles, summary
    _check_graph_lines(e, summary)
    for r in e.recompiles:
        assert f"  {r}" in summary.splitlines()
        assert re.search(re.escape(__file__) + r":\d+", str(r)), r  # the user's file:line
    assert not any(g in summary for g in e.guards), summary


SINK = io.StringIO()


def writes_a_file_in_a_branch(x, log):
    y = x * 2
    if log:
        print("logged", file=SINK)  # mark
    return y + 1


def test_fallbacks_appear_in_the_summary_with_their_line():
    SINK.seek(0)
    SINK.truncate()
    opt = specularch.optimize(writes_a_file_in_a_branch)
    mark = next(i for i, line in enumerate(open(__file__), 1) if line.rstrip().endswith("# mark"))
    with specularch.config.patch(profile_calls=0):
        for log in (False, True, False, True):
            x = torch.randn(3)
            assert torch.equal(opt(x, log), writes_a_file_in_a_branch(x, log))
    assert SINK.getvalue() == "logged\n" * 4  # twice from each side
    e = specularch.explain(opt)
    summary = str(e)
    assert e.fallbacks and e.graphs, summary
    assert [f.location for f in e.fallbacks] == [f"{__file__}:{mark}"], summary
    for f in e.fallbacks:
        assert f"  [{f.kind}] writes_a_file_in_a_branch at {f.location}" in summary
        assert f.explanation in summary and f.hint in summary
    _check_graph_lines(e, summary)


def test_cli_report_is_the_summary_and_the_log_gives_the_guards(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.Adam(net.parameters(), lr=0.1)

        def train_step(x, y):
            opt.zero_grad()
            loss = ((net(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            return loss.item()

        for i in range(6):
            train_step(torch.randn(5, 4), torch.randn(5, 2))
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULARCH")}
    env.update(SPECULARCH_LOG="guards,graphs", SPECULARCH_REPORT="1")
    out = subprocess.run([sys.executable, "-m", "specularch", "explain", str(script)], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    logged, report = out.stderr.split("\nspecularch report for train_step\n", 1)
    report = report.split("\n\n", 1)[0]
    assert len(report.splitlines()) <= 10 and report.splitlines()[-1] == DETAIL_HINT, report
    (_, _, _, _, guards, _), = GRAPH_LINE.findall("\n" + report)
    # The [guards] log message: a header line, then one indented line per guard.
    guard_lines = logged.split("specularch: [guards] train_step:\n", 1)[1].split("\n")
    guard_lines = [line for line in guard_lines[:int(guards) + 1] if line.startswith("  ")]
    assert len(guard_lines) == int(guards), logged
    assert "def forward(" in logged and "def forward(" not in report
