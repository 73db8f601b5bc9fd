"""``python -m specularch.bench``'s never-seen regime: every timed step a new tree / BPTT
length, eager vs specularch (vs torch.compile) interleaved. Smoke runs at the tiny preset:
the report's fields are present and sane, and each mode's parameters end where eager's do
(the timings themselves are not checked)."""
import json

import pytest
import torch

import specularch
from specularch.bench import never_seen
from specularch.workloads import WORKLOADS

TREE_MODELS = ("tree_rnn", "tree_lstm")


def _run(tmp_path, workloads, structures, *extra):
    from specularch.bench.__main__ import main
    out = tmp_path / "r.json"
    assert main(["--workloads", workloads, "--preset", "tiny", "--structures", str(structures),
                 "--json", str(out), *extra]) == 0
    results = json.loads(out.read_text())
    return results, {r["workload"]: r for r in results["never_seen"]}


def test_never_seen_regime_reports_every_mode_side_by_side(tmp_path, capsys):
    profiled = specularch.config.profile_calls
    # (--tier-warmup-s: the suite keeps graphs cold, so auto would wait 60 s for them to get hot)
    results, runs = _run(tmp_path, "lenet,tree_rnn,lstm_lm", 6, "--no-torch-compile", "--tier-warmup-s", "0")
    printed = capsys.readouterr()
    # auto: the workloads whose structure varies run never-seen, the others the cycle
    assert [r["workload"] for r in results["results"]] == ["lenet"] and set(runs) == {"tree_rnn", "lstm_lm"}
    assert runs["tree_rnn"]["distinct_structures"] == 6  # a new tree every step
    assert 1 <= runs["lstm_lm"]["distinct_structures"] <= 6
    for name, run in runs.items():
        # the default mode (auto, tiered) next to the pinned fx
        assert run["steps"] == 6 and list(run["modes"]) == ["eager", "specularch auto",
                                                            "specularch fx"]
        eager = run["modes"]["eager"]
        assert eager["vs_eager"] == 1.0 and "max_param_diff" not in eager
        assert eager["steps"] == 6 and 0 < eager["median_ms"] and 0 < eager["first_step_ms"]
        for mode in ("specularch auto", "specularch fx"):
            spec = run["modes"][mode]
            assert spec["steps"] == 6 and 0 < spec["median_ms"] and 0 < spec["first_step_ms"]
            assert spec["first_compiled_step"] == profiled + 1, spec  # after the profiled calls
            assert 1 <= spec["graphs"] <= 6 - profiled and spec["cache_limit_fallbacks"] == 0
            # after the run every parameter equals eager's within float rounding (bit for bit
            # where every step ran unrolled graphs or eagerly; batched templates round differently)
            assert spec["max_param_diff"] < 1e-5 and spec["params_close"] is True, (name, spec)
            assert f"| {name} | {mode} |" in printed.out
        assert f"[bench] {name}: step 6/6" in printed.err
    assert "threads=1" in printed.out and results["threads"] == 1


def test_never_seen_regime_counts_cache_limit_fallbacks(tmp_path):
    """Past ``cache_limit`` graphs every new BPTT length runs eagerly; the report counts
    those calls (from explain's records), and the parameters still end where eager's do."""
    with specularch.config.patch(cache_limit=1):
        _, runs = _run(tmp_path, "lstm_lm", 8, "--no-torch-compile", "--regime", "never-seen")
    spec = runs["lstm_lm"]["modes"]["specularch fx"]
    profiled = specularch.config.profile_calls
    assert spec["cache_limit_fallbacks"] >= 1 and "cache_limit" in spec["fallback_kinds"], spec
    assert spec["graphs"] + spec["cache_limit_fallbacks"] + profiled <= 8
    assert spec["max_param_diff"] == 0.0 and spec["params_close"]


def test_never_seen_presets_have_the_issues_sizes():
    """Tree models: emb 300, hidden 150, one tree of 5-30 leaves per step; the LM: two
    LSTMCells of 200, batch 20, BPTT length 15-25, no dropout (so every mode draws alike)."""
    gen = torch.Generator().manual_seed(0)
    for name in TREE_MODELS:
        w = WORKLOADS[name]
        model = w.build(never_seen.PRESET)
        assert model.embed.embedding_dim == 300 and model.classify.in_features == 150
        trees = [w.make_batch(never_seen.PRESET, gen)[0] for _ in range(20)]
        assert all(len(t) == 1 and 5 <= t[0].leaves() <= 30 for t in trees)
    lm = WORKLOADS["lstm_lm"]
    model = lm.build(never_seen.PRESET)
    assert [c.hidden_size for c in model.cells] == [200, 200] and model.drop.p == 0.0
    batches = [lm.make_batch(never_seen.PRESET, gen) for _ in range(40)]
    assert {b[0].shape[1] for b in batches} == {20}
    lengths = {b[0].shape[0] for b in batches}
    assert lengths <= set(range(15, 26)) and len(lengths) > 5


@pytest.mark.parametrize("name", TREE_MODELS)
def test_tree_model_with_a_wider_embedding_trains_like_eager(name):
    """The never_seen preset's leaf path (embedding 300 -> hidden 150) under optimize: three
    training steps on new trees, parameters equal to eager's within float rounding."""
    w = WORKLOADS[name]
    modes = never_seen.build_modes(w, never_seen.PRESET, "cpu", ["fx"], with_compile=False)
    batches = never_seen.make_batches(w, never_seen.PRESET, 5, "cpu")
    with specularch.config.patch(profile_calls=0):
        for i, batch in enumerate(batches[:3]):
            for mode in modes:
                mode.run(batch, seed=i, device="cpu")
    assert specularch.explain(modes[1].step).stats.captures >= 1
    worst, close = never_seen.param_difference(modes[1].model, modes[0].model)
    assert close and worst < 1e-5, worst


@pytest.mark.slow
def test_never_seen_regime_with_torch_compile(tmp_path, capsys):
    _, runs = _run(tmp_path, "lstm_lm", 3, "--torch-compile")
    tc = runs["lstm_lm"]["modes"]["torch.compile"]
    assert tc["steps"] == 3 and tc["graphs"] >= 1 and tc["first_compiled_step"] == 1, tc
    assert tc["recompile_limit_hits"] == 0, tc
    # the tiny LM has dropout, and Inductor draws its own random numbers (the never_seen
    # preset has none): the report shows the parameters drifting from eager's
    assert tc["max_param_diff"] > 0 and tc["params_close"] is False, tc
    assert "| lstm_lm | torch.compile |" in capsys.readouterr().out


def test_the_greedy_decoder_trains_like_eager_in_one_graph():
    """Free-running decoding that stops at EOS (a rolled loop with an exit test,
    ``symbolic/rolled/exits.py``) and a source of a new length per step: one graph, no
    fallback, parameters equal to eager's within float rounding."""
    w = WORKLOADS["greedy_decoder"]
    modes = never_seen.build_modes(w, never_seen.PRESET, "cpu", ["fx"], with_compile=False)
    batches = never_seen.make_batches(w, never_seen.PRESET, 16, "cpu")
    for i, batch in enumerate(batches):
        for mode in modes:
            mode.run(batch, seed=i, device="cpu")
    report = specularch.explain(modes[1].step)
    assert not report.fallbacks and len(report.graphs) == 1, report
    decode = report.graphs[0].loops[-1]
    assert decode.rolled and "break" in str(decode) and len(set(decode.trips)) > 2, decode
    worst, close = never_seen.param_difference(modes[1].model, modes[0].model)
    assert close and worst < 1e-5, worst
