"""``specularch.explain(obj)``: what was captured, guarded, or fell back, and why.

``str(report)`` is a short summary (a few lines per graph, whatever the model's size): per
graph its backend, runs, capture and compile time and how many inputs and guards it has, then
every fallback and recompile with its reason and the user's ``file:line``. The guards and the
graph code (hundreds to thousands of lines for a real model) are printed only on request:
``explain(obj, verbose=True)``, or ``SPECULARCH_LOG=guards,graphs`` as graphs are captured.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .records import FallbackRecord, RecompileRecord

# The summary's last line: where the detail it leaves out is.
DETAIL_HINT = ("guards and graph code: print(specularch.explain(obj, verbose=True)), "
               "or SPECULARCH_LOG=guards,graphs while the program runs")


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
    loops: list = field(default_factory=list)  # rolled loops (trip counts) and unrolled ones (why)
    tiers: list = field(default_factory=list)  # backend "auto": the tier history (tiering/)
    tier: object = None  # ... as the live ``tiering.TierHistory`` (times, events, settled)
    cached: bool = False      # the compiled graph came from the persistent compile cache
    guard_us: float | None = None  # µs one check of the guards took (timed at compile time)
    sizes: str = ""           # compiled for dynamic sizes: where, and the calls that ran fx

    def _timing(self) -> str:
        return (f"backend={self.backend} runs={self.hits} capture={self.capture_seconds * 1e3:.1f}ms "
                f"compile={self.compile_seconds * 1e3:.1f}ms{' (cached)' if self.cached else ''}")

    def _guards(self, sep: str = "=") -> str:
        cost = f" ({self.guard_us:.1f}µs)" if self.guard_us is not None else ""
        return f"guards{sep}{len(self.guards)}{cost}"

    def summary(self) -> str:
        """One line (two with a backend note): the guards and inputs counted, not listed."""
        line = f"{self._timing()} inputs={len(self.inputs)} {self._guards()}"
        line += "".join(f"\n    {loop}" for loop in self.loops)
        line += "".join(f"\n    {tier}" for tier in self.tiers)
        line += f"\n    {self.sizes}" if self.sizes else ""
        return line + (f"\n    note: {self.note}" if self.note else "")

    def __str__(self) -> str:
        lines = [f"  {self._timing()}",
                 *([f"  note: {self.note}"] if self.note else []),
                 *[f"  {loop}" for loop in self.loops],
                 *[f"  {tier}" for tier in self.tiers],
                 *([f"  {self.sizes}"] if self.sizes else []),
                 "  inputs: " + (", ".join(self.inputs) or "(none)"),
                 f"  {self._guards(': ')}"]
        lines += [f"    {g}" for g in self.guards]
        lines += ["  code:"] + [f"    {line}" for line in self.code.splitlines()]
        return "\n".join(lines)


@dataclass
class Explanation:
    """What specularch did with one optimized object.

    ``print(report)`` shows the summary; ``print(specularch.explain(obj, verbose=True))`` (or
    ``report.verbose = True``) shows everything: each graph's inputs, guards and code too.
    The detail is always in the attributes: ``report.graphs[i].guards`` / ``.code`` /
    ``.inputs``, ``report.fallbacks``, ``report.recompiles``, ``report.relaxations``.
    """

    name: str
    graphs: list[GraphReport] = field(default_factory=list)
    fallbacks: list[FallbackRecord] = field(default_factory=list)
    recompiles: list[RecompileRecord] = field(default_factory=list)
    stats: object = None
    relaxations: list[str] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)  # recursion templates (templates/)
    # loops left unrolled in graphs dropped since or captures that fell back (each why)
    unrolled: list = field(default_factory=list)
    verbose: bool = field(default=False, compare=False)  # str() lists guards and graph code

    @property
    def guards(self) -> list[str]:
        return [g for report in self.graphs for g in report.guards]

    def __str__(self) -> str:
        out = [f"specularch report for {self.name}", f"stats: {self.stats}",
               f"graphs: {len(self.graphs)}"]
        if self.verbose:
            for i, g in enumerate(self.graphs):
                out += [f"--- graph {i} ---", str(g)]
        else:
            out += [f"  graph {i}: {g.summary()}" for i, g in enumerate(self.graphs)]
        out += self._records()
        if self.graphs and not self.verbose:
            out.append(DETAIL_HINT)
        return "\n".join(out)

    def _records(self) -> list[str]:
        """Fallbacks, recompiles and relaxations, each in full: they are why something did
        not run as one graph, and there are few of them (fallback records are capped)."""
        out = [f"fallbacks: {len(self.fallbacks)}"]
        out += [f"  {line}" for f in self.fallbacks for line in str(f).splitlines()]
        if self.unrolled:
            out.append("loops not rolled, in graphs dropped since or captures that fell back:")
            out += [f"  {loop}" for loop in self.unrolled]
        out.append(f"recompiles: {len(self.recompiles)}")
        out += [f"  {r}" for r in self.recompiles]
        out.append(f"relaxations: {len(self.relaxations)}")
        out += [f"  {r}" for r in self.relaxations]
        if self.templates:
            out.append("templates:")
            out += self.templates
        return out


def explain_state(state, verbose: bool = False) -> Explanation:
    from .fx_lower.compile_cache import from_cache
    from .fx_lower.dynamic_sizes import describe
    from .templates.report import template_lines
    graphs = [GraphReport(e.capture.code, e.capture.guards.readable(),
                          [str(s) for s in e.capture.input_sources], e.backend, e.hits,
                          e.capture.seconds, e.compile_seconds,
                          "; ".join(filter(None, [e.note, getattr(e.graph_fn, "note", "")])),
                          list(getattr(e.capture, "loops", ())),
                          e.tier.lines() if e.tier is not None else [], e.tier,
                          cached=from_cache(e.graph_fn), guard_us=e.capture.guards.micros,
                          sizes=describe(e.graph_fn, [str(s) for s in e.capture.input_sources]))
              for e in reversed(state.entries)]
    templates = template_lines([e.capture.graph_module for e in state.entries])
    shown = {loop.site for g in graphs for loop in g.loops}
    unrolled = [loop for site, loop in state.unrolled.items() if site not in shown]
    return Explanation(state.target.name, graphs, [replace(f) for f in state.fallbacks.values()],
                       list(state.recompiles), replace(state.stats),
                       list(state.general.relaxations), templates, unrolled, verbose)
