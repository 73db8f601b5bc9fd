"""The public-example-style corpus (benchmarks/corpus/): every script, run with
``specularch.optimize`` applied to its models and step functions, gives results equal to eager
(bit for bit with ``fx``: losses, metrics, final parameters, printed text), does not crash and
hits no ``internal_error``. The share of graph calls is reported by
``benchmarks/corpus_report.py``, not asserted here. Also: the bug the corpus found
(``x = 0.; x += t`` captured as ``0.0 += t``) and the report's own comparison and parser."""
import operator
import pathlib
import sys

import pytest
import torch

import specularch
from differential import A, T, check

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import corpus_report  # noqa: E402


# --- the corpus --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", corpus_report.SCRIPTS)
def test_corpus_script_equals_eager(name):
    with specularch.config.patch(profile_calls=1):  # reach the graphs within a few steps
        result = corpus_report.run_optimized(name)
    assert not result.error, f"{name} crashed when optimized: {result.error}"
    internal = [f for f in result.fallbacks if f.kind == "internal_error"]
    assert not internal, "\n".join(f"{f.location}: {f.explanation}" for f in internal)
    assert not result.mismatch, f"{name} differs from eager at {result.difference}"
    assert result.graph_calls > 0, f"{name}: no call ran as a graph, nothing was compared"


def test_corpus_has_the_programs_the_issue_names():
    named = {"mnist_cnn", "word_language_model", "vae", "dcgan", "actor_critic", "gcn", "gat",
             "siamese", "super_resolution"}
    assert named <= set(corpus_report.SCRIPTS)
    assert len(corpus_report.SCRIPTS) >= len(named) + 3


def _pth_installed() -> bool:
    return any((pathlib.Path(p) / "specularch_startup.pth").exists() for p in sys.path
               if p.endswith("site-packages"))


@pytest.mark.slow
@pytest.mark.skipif(not _pth_installed(), reason="the start-up .pth is not installed")
def test_corpus_script_under_the_switch_equals_eager():
    result = corpus_report.run_switch("vae")
    assert not result.error and not result.mismatch, result.error or result.difference
    assert "VAE.forward" in result.objects and "main.<locals>.train_step" in result.objects
    assert result.graph_calls > 0 and result.internal_errors == 0


# --- `number op= tensor` (found by the corpus: fast_neural_style's `style_loss = 0.`) ------

@pytest.mark.parametrize("op", [operator.iadd, operator.isub, operator.imul, operator.itruediv])
@pytest.mark.parametrize("start", [0.0, 1], ids=["float", "int"])
def test_number_inplace_op_tensor_is_the_plain_op(op, start, no_profiling):
    def accumulate(x, y):
        total = start
        total = op(total, x.sum())  # operator.iadd(...) called, not BINARY_OP
        for t in (y, x):
            total = op(total, (t * 2).mean())
        return total

    def augmented(x, y):
        loss = start
        for t in (x, y):
            if op is operator.iadd:
                loss += t.mean()
            elif op is operator.isub:
                loss -= t.mean()
            elif op is operator.imul:
                loss *= t.mean()
            else:
                loss /= t.mean()
        return loss

    check(augmented, lambda: A(T(3, requires_grad=True), T(3)), expect="graph", grad=True)
    check(accumulate, lambda: A(T(3), T(3)), expect="graph")


def test_number_inplace_op_tensor_in_a_training_step():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.ones(3))
    targets = [torch.ones(3), torch.zeros(3)]

    def step(x):
        loss = 0.
        for t in targets:
            loss += ((x * w - t) ** 2).mean()
        loss *= 10.0
        loss.backward()
        return loss.detach()

    opt = specularch.optimize(step)
    x = torch.randn(3)
    with specularch.config.patch(profile_calls=0):
        got, got_grad = opt(x), w.grad.clone()
        w.grad = None
        expected = step(x)
    assert torch.equal(got, expected) and torch.equal(got_grad, w.grad)
    report = specularch.explain(opt)
    assert len(report.graphs) == 1 and not report.fallbacks, str(report)


# --- the report's comparison and parser --------------------------------------------------

def test_compare_is_exact_or_relative():
    a = {"losses": [1.0, 2.0], "params": {"w": torch.ones(3)}, "n": 3}
    near = {"losses": [1.0, 2.0 + 1e-9], "params": {"w": torch.ones(3) + 2 ** -20}, "n": 3}
    exact = corpus_report.compare(a, near, 0.0)
    assert exact.first == "result['losses'][1]: max abs difference 1e-09"
    assert corpus_report.compare(a, near, 1e-5).first is None
    assert corpus_report.compare(a, near, 1e-5).max_abs == 2 ** -20
    assert corpus_report.compare(a, a, 0.0).first is None
    nan = {"x": torch.tensor([float("nan"), 1.0])}
    assert corpus_report.compare(nan, nan, 0.0).first is None
    assert "max abs difference inf" in corpus_report.compare(
        nan, {"x": torch.tensor([0.0, 1.0])}, 0.0).first
    assert "tensor (3,)" in corpus_report.compare(a, {**a, "params": {"w": torch.ones(2)}}).first
    assert corpus_report.compare(a, {**a, "n": 4}).first is not None


def test_parse_report_reads_what_explain_prints():
    def f(x):
        if x.sum() > 0:  # a tensor-dependent branch: the first call is the one profiled
            return x + 1
        return x - 1

    opt = specularch.optimize(f)
    for i in range(5):
        opt(torch.ones(2) * (1 if i % 2 else -1))
    report = specularch.explain(opt)
    result = corpus_report.ScriptResult("f", "switch")
    corpus_report.parse_report("noise\n" + str(report) + "\nmore noise\n", result)
    stats = report.stats
    assert result.objects == [report.name]
    assert (result.calls, result.graph_hits, result.captures, result.profiled,
            result.fallback_calls) == (stats.calls, stats.graph_hits, stats.captures,
                                       stats.profiled_calls, stats.fallback_calls)
    assert [(f.kind, f.calls, f.explanation) for f in result.fallbacks] == \
        [(f.kind, f.count, f.explanation) for f in report.fallbacks]
