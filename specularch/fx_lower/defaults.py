"""The default backend for each device type, chosen from measurements (docs/benchmarks.md,
"The default backend": ``benchmarks/mlp_forward.py``, ``benchmarks/train_step.py``,
``python -m specularch.bench``).

On the team's 2-core VM (1 thread, torch 2.13.0) ``fx`` ran the training steps at
0.86-1.18x of eager and the MLP forward at 1.03x, with a first call of milliseconds, and
takes every graph; ``torchscript`` (0.63-1.47x) and ``inductor`` (0.64-2.03x; 7-13 s per
graph from an empty cache) each lose to ``fx`` on some workload (LeNet) and pay off only
after many steps. Nothing was measured on CUDA (no GPU on the team's machines; see
docs/benchmarks.md for what ``cudagraphs`` and ``inductor`` are expected to give).

Since no single backend wins everywhere, the default on both is ``auto`` (tiered,
``specularch/tiering/``): ``fx`` first, and per graph the compiling backend measured fastest
on the program's own calls, compiled in the background (docs/tiering.md). Device types not
measured at all keep ``fx``.
"""
from __future__ import annotations

DEFAULTS: dict[str, str] = {"cpu": "auto", "cuda": "auto"}


def default_backend(device=None) -> str:
    """The default backend for ``device`` (a ``torch.device``, a string such as ``"cuda:0"``,
    or None for the CPU); ``fx`` for device types that were not measured."""
    kind = "cpu" if device is None else getattr(device, "type", str(device).split(":")[0])
    return DEFAULTS.get(kind, "fx")
