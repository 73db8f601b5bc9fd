"""Which graph nodes draw random numbers: such a node must run even when its result is unused,
and a graph with one saves and restores the RNG state around a failed assumption; and the
generators' states, saved, compared and put back."""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

_RANDOM_OPS = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform",
               "exponential", "poisson", "geometric", "cauchy", "log_normal", "rrelu",
               "gumbel", "fractional_max_pool")


def is_random_node(node: torch.fx.Node) -> bool:
    """Whether the node draws random numbers (by op name; conservative: ``normalize`` counts).
    Such a node must run even when its result is unused, to advance the RNG like eager."""
    if node.meta.get("draws_random"):  # a rolled loop whose body does
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name in _RNN_OPS:
        return _rnn_dropout(node.args)
    return any(r in str(name) for r in _RANDOM_OPS)


# ``nn.LSTM``/``GRU``/``RNN`` modules' ops: with ``dropout > 0`` in training they draw
# between layers (``torch.gru(input, hx, params, has_biases, num_layers, dropout, train, ...)``)
_RNN_OPS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})


def _rnn_dropout(args: tuple) -> bool:
    """Whether an RNN op's ``(dropout, train)`` arguments (a float then a bool, in either
    form of its schema) make it draw."""
    for p, train in zip(args, args[1:]):
        if type(p) is float and type(train) is bool:
            return p > 0 and train
    return True  # (not found: assume it draws)


def is_identity_dropout(node: torch.fx.Node) -> bool:
    """``F.dropout`` with ``p=0`` or ``training=False``: it returns its input and draws
    nothing, so it may move or be compiled like any op."""
    if node.target is not F.dropout:
        return False
    args = (*node.args, None, None, None)
    p = node.kwargs.get("p", args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", args[2] if len(node.args) > 2 else True)
    inplace = node.kwargs.get("inplace", args[3] if len(node.args) > 3 else False)
    return not inplace and (p == 0 or training is False)


def graph_uses_randomness(gm: torch.fx.GraphModule) -> bool:
    return any(is_random_node(node) for node in gm.graph.nodes)


def generator_states() -> tuple:
    """The CPU generator's state, and every CUDA device's where CUDA is initialised."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def restore_generators(states: tuple) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def same_generator_states(a: tuple, b: tuple) -> bool:
    if not torch.equal(a[0], b[0]):
        return False
    return (a[1] is None) == (b[1] is None) and \
        (a[1] is None or all(torch.equal(x, y) for x, y in zip(a[1], b[1])))
