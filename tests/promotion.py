"""The harness of the promotion sweeps (``test_tiered_*_sweep.py``): a model optimized in the
default (tiered) mode beside an eager twin, trained side by side and compared after every
step, and the check that its graphs were promoted. The ``promoted`` fixture (conftest.py)
makes graphs hot after 3 calls with TorchScript's candidate always kept."""
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from specularch import tiering

from differential import assert_same

RTOL, ATOL = 1e-4, 1e-6  # compiled code rounds differently; random numbers must be eager's


class Twins:
    """``make_model()`` optimized beside an eager twin with its state; an Adam for each."""

    def __init__(self, make_model, lr=0.01):
        torch.manual_seed(0)
        self.model, self.twin = make_model(), make_model()
        self.twin.load_state_dict(self.model.state_dict())
        self.opt = specularch.optimize(self.model)
        self.adams = [torch.optim.Adam(m.parameters(), lr=lr) for m in (self.twin, self.model)]

    def sides(self):
        """(net to call, the module itself, its Adam): the eager twin's first."""
        return ((self.twin, self.twin, self.adams[0]), (self.opt, self.model, self.adams[1]))

    def run(self, steps, step_fn, seed=1000):
        """``step_fn(net, module, adam, step)`` on each side from the same generator state;
        what it returns, the generator state after it and the models compared each step;
        at the end every step's results again (a compiled graph must not reuse the memory of
        results it returned)."""
        kept = []
        for step in range(steps):
            results, states = [], []
            for net, module, adam in self.sides():
                torch.manual_seed(seed + step)
                results.append(step_fn(net, module, adam, step))
                states.append(torch.get_rng_state())
            assert_same(results[0], results[1], f"step {step}: result", rtol=RTOL, atol=ATOL)
            assert torch.equal(*states), f"step {step}: the generator drew other numbers than eager's"
            self.compare(f"step {step}")
            kept.append(results)
            tiering.wait(timeout=120)
        for step, results in enumerate(kept):
            assert_same(results[0], results[1], f"step {step}: result, at the end", rtol=RTOL, atol=ATOL)

    def compare(self, where):
        compare_models(self.twin, self.model, where)


def compare_models(eager, optimized, where):
    """Parameters (values and ``.grad``), buffers, public attributes, train/eval mode."""
    assert_same(eager, optimized, f"{where}: model", rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(eager.named_parameters(), optimized.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{where}: {name}.grad {p.grad} vs {q.grad}"
        if p.grad is not None:
            assert_same(p.grad, q.grad, f"{where}: {name}.grad", rtol=RTOL, atol=ATOL)
    for (name, a), b in zip(eager.state_dict().items(), optimized.state_dict().values()):
        assert_same(a, b, f"{where}: state_dict {name}", rtol=RTOL, atol=ATOL)


class StepTwins:
    """Two identical (model, optimizer[, scheduler]) and ``make_step(model, opt)``'s training
    step of each, the second one optimized (a whole step as one graph)."""

    def __init__(self, make_model, make_opt, make_step, make_sched=None):
        torch.manual_seed(0)
        self.models = [make_model(), make_model()]
        self.models[1].load_state_dict(self.models[0].state_dict())
        self.opts = [make_opt(m.parameters()) for m in self.models]
        self.scheds = [make_sched(o) for o in self.opts] if make_sched else None
        self.steps = [make_step(m, o) for m, o in zip(self.models, self.opts)]
        self.steps[1] = specularch.optimize(self.steps[1])

    def run(self, batches, seed=2000):
        """Each side's step on each of ``batches`` (argument tuples) from the same generator
        state: what it returns (values and types), the generator state after it, the models,
        the optimizers' and schedulers' state compared after every step; every step's
        results again at the end."""
        kept = []
        for i, batch in enumerate(batches):
            results, states = [], []
            for fn in self.steps:
                torch.manual_seed(seed + i)
                results.append(fn(*batch))
                states.append(torch.get_rng_state())
            where = f"step {i}"
            assert_same(results[0], results[1], f"{where}: result", rtol=RTOL, atol=ATOL)
            assert _types(results[0]) == _types(results[1]), f"{where}: result types"
            assert torch.equal(*states), f"{where}: the generator drew other numbers than eager's"
            if self.scheds:
                for s in self.scheds:
                    s.step()
            self.compare(where)
            kept.append(results)
            tiering.wait(timeout=120)
        for i, results in enumerate(kept):
            assert_same(results[0], results[1], f"step {i}: result, at the end", rtol=RTOL, atol=ATOL)

    def compare(self, where):
        compare_models(*self.models, where)
        assert_same(self.opts[0].state_dict(), self.opts[1].state_dict(), f"{where}: optimizer",
                    rtol=RTOL, atol=ATOL)
        if self.scheds:
            assert_same(self.scheds[0].state_dict(), self.scheds[1].state_dict(), f"{where}: scheduler")
            assert self.scheds[0].get_last_lr() == self.scheds[1].get_last_lr()


def _types(value):
    if isinstance(value, (tuple, list)):
        return type(value), [_types(v) for v in value]
    return type(value)


def adam_step(loss_fn):
    """``make_step`` for ``StepTwins``: ``zero_grad``, ``loss_fn(model(x), target)``,
    ``backward``, the optimizer's ``step``, ``loss.item()``."""
    def make(model, opt):
        def train_step(x, target):
            opt.zero_grad()
            loss = loss_fn(model(x), target)
            loss.backward()
            opt.step()
            return loss.item()
        return train_step
    return make


def classified(batches):
    """A plain classifier's training step over ``batches`` (``(x, labels)``, cycled): its
    outputs compared."""
    def step(net, module, adam, i):
        x, labels = batches[i % len(batches)]
        adam.zero_grad()
        out = net(x)
        F.cross_entropy(out, labels).backward()
        adam.step()
        return out.detach()
    return step


class Recurrent(nn.Module):
    """An LSTM or GRU (``cell``) classified from its last step's output, ``out[:, -1]``."""

    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(6, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class NotPromoted(AssertionError):
    """A graph the case hits often still runs on another tier than TorchScript, kept."""


def kept(graph) -> bool:
    decisions = [(e.candidate, e.decision) for e in graph.tier.events] if graph.tier else []
    return graph.backend == "torchscript" and ("torchscript", "kept") in decisions


def busiest(fn, share):
    """``explain(fn)`` and its graphs that ran at least ``share`` of all graph calls."""
    report = specularch.explain(fn)
    assert report.graphs, f"no graph captured\n{report}"
    total = sum(g.hits for g in report.graphs)
    return report, [g for g in report.graphs if g.hits >= share * total]


def assert_promoted(fn, share=0.0, sizes=None, cold=0):
    """Every graph of ``fn`` running at least ``share`` of its graphs' calls (every graph,
    by default) runs on TorchScript, kept; with ``sizes`` (the start of ``explain()``'s sizes
    line), compiled for those sizes; but for ``cold`` graphs that ran too few times to get
    hot, which stay on ``fx`` ("not hot enough to compile in the background"). Returns the
    graphs checked."""
    report, graphs = busiest(fn, share)
    unhot = [g for g in graphs if g.backend == "fx" and any("not hot enough" in str(t) for t in g.tiers)]
    assert len(unhot) == cold, f"{len(unhot)} graphs not hot, expected {cold}\n{report}"
    graphs = [g for g in graphs if g not in unhot]
    for graph in graphs:
        if not kept(graph):
            raise NotPromoted(f"not promoted: backend={graph.backend} tiers={graph.tiers} "
                              f"note={graph.note!r}\n{report}")
        if sizes is not None and not graph.sizes.startswith(sizes):
            raise NotPromoted(f"sizes line {graph.sizes!r}, not {sizes!r}\n{report}")
    return graphs
