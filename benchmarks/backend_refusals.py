"""Which graphs of the corpus (benchmarks/corpus/) a pinned compiling backend compiles, and
why it refuses or fails on the others (each graph's ``explain()`` note).

    python benchmarks/backend_refusals.py [--backend torchscript] [--scripts a,b]

Every script's ``main()`` runs once with ``optimize=`` pinning the backend, 1 thread. Per
graph: the script, the backend that ran it, its calls, the note; then the notes counted.
Graphs that ran once are counted too (a pinned backend compiles at capture).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import io
import pathlib
import sys

import torch

import specularch

CORPUS = pathlib.Path(__file__).parent / "corpus"


def _graphs(path: pathlib.Path, backend: str) -> list:
    spec = importlib.util.spec_from_file_location(f"corpus_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    made = []

    def optimize(obj, **_):
        made.append(specularch.optimize(obj, backend=backend))
        return made[-1]

    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):
        module.main(optimize=optimize)
    return [g for obj in made for g in specularch.explain(obj).graphs]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torchscript")
    parser.add_argument("--scripts", default="", help="comma-separated names (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    chosen = set(filter(None, args.scripts.split(",")))
    notes = collections.Counter()
    for path in sorted(CORPUS.glob("*.py")):
        if chosen and path.stem not in chosen:
            continue
        print(f"{path.stem} ...", file=sys.stderr)
        try:
            graphs = _graphs(path, args.backend)
        except Exception as e:  # a script that raises is reported, the others still run
            print(f"{path.stem:22s} raised {type(e).__name__}: {e}")
            continue
        for g in graphs:
            why = g.note.split("; ran it with")[0]
            notes[(g.backend, why)] += 1
            print(f"{path.stem:22s} {g.backend:12s} calls={g.hits:<5d} {why}")
    total = sum(notes.values())
    print(f"\n{total} graphs; {sum(n for (b, _), n in notes.items() if b == args.backend)} "
          f"compiled by {args.backend}")
    for (backend, why), count in notes.most_common():
        print(f"{count:4d}  {backend:12s} {why or '(compiled)'}")


if __name__ == "__main__":
    main()
