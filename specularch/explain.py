"""``specularch.explain(obj)``: what was captured, guarded, or fell back, and why."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .records import FallbackRecord, RecompileRecord


@dataclass
class GraphReport:
    code: str                 # the FX graph's generated Python
    guards: list[str]         # readable guards, each with the user line that caused it
    inputs: list[str]         # where each graph input is read from at run time
    backend: str
    hits: int                 # calls run through this graph, the capturing call included
    capture_seconds: float
    compile_seconds: float
    note: str = ""            # why the requested backend was not used, if it was not

    def __str__(self) -> str:
        lines = [f"  backend={self.backend} runs={self.hits} "
                 f"capture={self.capture_seconds * 1e3:.1f}ms compile={self.compile_seconds * 1e3:.1f}ms",
                 *([f"  note: {self.note}"] if self.note else []),
                 "  inputs: " + (", ".join(self.inputs) or "(none)"),
                 "  guards:"]
        lines += [f"    {g}" for g in self.guards]
        lines += ["  code:"] + [f"    {line}" for line in self.code.splitlines()]
        return "\n".join(lines)


@dataclass
class Explanation:
    name: str
    graphs: list[GraphReport] = field(default_factory=list)
    fallbacks: list[FallbackRecord] = field(default_factory=list)
    recompiles: list[RecompileRecord] = field(default_factory=list)
    stats: object = None
    relaxations: list[str] = field(default_factory=list)

    @property
    def guards(self) -> list[str]:
        return [g for report in self.graphs for g in report.guards]

    def __str__(self) -> str:
        out = [f"specularch report for {self.name}", f"stats: {self.stats}",
               f"graphs: {len(self.graphs)}"]
        for i, g in enumerate(self.graphs):
            out.append(f"--- graph {i} ---")
            out.append(str(g))
        out.append(f"fallbacks: {len(self.fallbacks)}")
        out += [f"  {line}" for f in self.fallbacks for line in str(f).splitlines()]
        out.append(f"recompiles: {len(self.recompiles)}")
        out += [f"  {r}" for r in self.recompiles]
        out.append(f"relaxations: {len(self.relaxations)}")
        out += [f"  {r}" for r in self.relaxations]
        return "\n".join(out)


def explain_state(state) -> Explanation:
    graphs = [GraphReport(e.capture.code, e.capture.guards.readable(),
                          [str(s) for s in e.capture.input_sources], e.backend, e.hits,
                          e.capture.seconds, e.compile_seconds, e.note)
              for e in reversed(state.entries)]
    return Explanation(state.target.name, graphs, [replace(f) for f in state.fallbacks.values()],
                       list(state.recompiles), replace(state.stats),
                       list(state.general.relaxations))
