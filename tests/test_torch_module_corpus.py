"""PyTorch's own module tests as a corpus (benchmarks/torch_module_corpus.py): every ``nn``
module class of torch's ``module_db`` with the inputs torch's tests use, eager vs
``specularch.optimize`` (``fx``, bit for bit: outputs, input and parameter gradients, buffers,
exceptions) gives no mismatch, no ``internal_error`` and no crash. The share captured whole is
reported by the tool (docs/torch-module-corpus.md), not asserted here. Also: the harness
itself tells a difference, a crash and a fallback apart."""
import pathlib
import sys
import unittest

import pytest
import torch

pytest.importorskip("expecttest", reason="torch's module_db needs expecttest: pip install -e .[test]")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _torch_testing  # noqa: E402
import torch_module_corpus as corpus  # noqa: E402

BAD = ("mismatch", "internal_error", "crash")

# One of each shape of program: parameters, buffers updated in train mode, RNG in the graph,
# tuple outputs, random samples drawn in forward, lazy parameters made on the first call,
# several inputs, keyword inputs and an attention mask.
FAST_MODULES = ("Linear", "Conv2d", "BatchNorm1d", "LSTM", "GRUCell", "FractionalMaxPool2d",
                "LazyConv1d", "Bilinear", "CrossEntropyLoss", "MultiheadAttention",
                "TransformerEncoderLayer", "Embedding", "PReLU", "GroupNorm")


@pytest.fixture(autouse=True)
def _one_thread():
    """As the tool runs: on a shared machine, two OpenMP threads per op make the whole
    corpus several times slower, not faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _describe(results):
    return "\n".join(f"{r.name} {r.status}: {r.detail or corpus._first_internal(r)}"
                     for r in results if r.status in BAD)


@pytest.mark.parametrize("name", FAST_MODULES)
def test_module_equals_eager(name):
    results, _ = corpus.run_corpus({name}, samples=1, calls=2)
    assert results, f"module_db has no CPU float32 program for {name}"
    assert not [r for r in results if r.status in BAD], _describe(results)
    assert all(r.calls == 2 for r in results), "the optimized forward was not called"


@pytest.mark.slow
def test_whole_corpus_equals_eager():
    """Every sample of every module (about 2000 programs, ~60 s), not only the first three
    the report uses; two calls each (the capturing call and a cached one), as the fast
    tests above."""
    results, skipped = corpus.run_corpus(samples=0, calls=2)
    assert len(results) > 1000
    bad = [r for r in results if r.status in BAD]
    assert not bad, f"{len(bad)} of {len(results)} programs:\n{_describe(bad)}"
    assert sum(r.status == "captured whole" for r in results) > 0


# --- the harness --------------------------------------------------------------------------

class _ToList(torch.nn.Module):
    """Reads tensor values into Python: a data-dependent value, so the call runs eagerly."""

    def __init__(self, n):
        super().__init__()
        self.linear = torch.nn.Linear(n, n)

    def forward(self, x):
        return self.linear(x) * len([v for v in x.sum(1).tolist() if v > 0])


def _toy_entry(cls):
    return _torch_testing.ModuleEntry(cls.__name__, cls, False, None)


def test_a_fallback_is_classified_with_its_record():
    sample = _torch_testing.Sample("toy", (3,), {}, (torch.randn(4, 3, requires_grad=True),), {})
    result = corpus.run_program(_toy_entry(_ToList), 0, sample, True, calls=2)
    assert result.status == "fell back", result
    assert result.fallbacks
    assert all(f.location.startswith("tests/test_torch_module_corpus.py:") for f in result.fallbacks)
    assert result.graph_calls < result.calls == 2


def test_a_captured_module_is_captured_whole():
    sample = _torch_testing.Sample("toy", (3, 2), {}, (torch.randn(4, 3, requires_grad=True),), {})
    result = corpus.run_program(_toy_entry(torch.nn.Linear), 0, sample, True, calls=3)
    assert (result.status, result.calls, result.graph_calls) == ("captured whole", 3, 3)


def _outcome(value):
    return ("returned", {"output": torch.tensor([1.0, value])})


def test_harness_tells_mismatch_crash_and_same_exception_apart():
    def judge(eager, got):
        result = corpus.ProgramResult("m", 0, "", True)
        corpus._compare_calls(result, eager, got)
        return result

    assert judge([_outcome(2.0)], [_outcome(2.0)]).status == "captured whole"
    differs = judge([_outcome(2.0)], [_outcome(2.0 + 1e-6)])
    assert differs.status == "mismatch" and differs.max_abs_diff > 0, differs
    assert judge([_outcome(2.0)], [("raised", "RuntimeError: x")]).status == "crash"
    assert judge([("raised", "RuntimeError: x")], [_outcome(2.0)]).status == "crash"
    assert judge([("raised", "RuntimeError: x")], [("raised", "ValueError: x")]).status == "crash"
    same = judge([("raised", "RuntimeError: x")], [("raised", "RuntimeError: x")])
    assert same.status == "captured whole" and same.eager_raised == "RuntimeError: x"
    missing_grad = judge([("returned", {"g": "no grad"})], [("returned", {"g": torch.ones(1)})])
    assert missing_grad.status == "mismatch"


def test_torch_skips_on_cpu_are_recognised():
    assert corpus._torch_testing._skips_on_cpu(unittest.skip("flaky"), torch.float32)
    assert corpus._torch_testing._skips_on_cpu(unittest.expectedFailure, torch.float32)
    assert corpus._torch_testing._skips_on_cpu(lambda fn: fn, torch.float32) is None


def test_report_counts_and_ranks():
    results = [corpus.ProgramResult("nn.A", 0, "", True),
               corpus.ProgramResult("nn.B", 0, "", True, status="fell back",
                                    fallbacks=[corpus.Fallback("k", "why", "f.py:1", 1)]),
               corpus.ProgramResult("nn.B", 1, "", True, status="fell back",
                                    fallbacks=[corpus.Fallback("k", "why", "f.py:1", 2)])]
    assert "| 3 | 1 | 2 | 0 | 0 | 0 | 33.3% |" in corpus.summary(results)
    (cause,) = corpus.ranked_causes(results)
    assert (cause["kind"], cause["programs"], cause["modules"]) == ("k", 2, ["nn.B"])
