"""The JANUS workloads, written as ordinary imperative PyTorch (no specularch imports).

``WORKLOADS`` maps a name to a ``Workload``: how to build the model at a size preset
(``tiny`` for tests, ``cpu`` for benchmarks on this machine, ``paper`` for the paper's size),
how to make a batch, the loss, and the unit of throughput.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import big_lm, greedy_decoder, inception, lenet, lstm_lm, resnet, tree_lstm, tree_rnn


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable          # build(preset) -> nn.Module
    make_batch: Callable     # make_batch(preset, generator, step, last=False) -> (inputs, targets);
                             # last=True: the epoch's short last batch
    loss: Callable           # loss(model, batch) -> scalar tensor
    unit: str                # "examples/s" | "words/s" | "sentences/s"
    items: Callable          # items(batch) -> number of units in the batch
    presets: dict


WORKLOADS = {m.NAME: Workload(m.NAME, m.build, m.make_batch, m.loss, m.UNIT, m.items, m.PRESETS)
             for m in (lenet, resnet, inception, lstm_lm, big_lm, tree_rnn, tree_lstm, greedy_decoder)}
