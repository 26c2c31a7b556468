"""What op localisation found (``dynaprobe bisect --ops``, ops.py), and its text: each aten
graph's ops judged (``GraphOps``), the first op that fails (``OpFinding``) and its kernel
(``Kernel``), an output that fails only at the backend's own fusion (``FusedOutput``), the masks
and clamps the two sides decided differently (``SplitDecision``); ``OpsResult.text()`` says it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from dynaprobe._C import vocabulary


@dataclass
class Kernel:
    """The generated kernel that computes a node (inductor): its name, the graph nodes it fuses
    and the file of the generated code."""

    name: str
    fuses: List[str]
    path: str


@dataclass
class OpFinding:
    """The first node of an aten graph whose compiled value fails against eager."""

    graph: str  # its name: forward, backward or inference; numbered after a graph break
    node: str
    op: str
    source: str  # file:line and code, from the stack trace Dynamo recorded
    row: object  # the engine's row (metrics, status, reference verdict)
    inputs_matched: bool
    inputs_max_abs: float
    fidelity: str
    kernel: Optional[Kernel] = None
    repro: str = ""  # the op alone on its real inputs: a repro.py that runs with torch alone


@dataclass
class SplitDecision:
    """A value the backward graph takes from the forward one that the two sides decided
    differently at some elements: a mask (a comparison's booleans) or a clamp (relu's zeros),
    True or zero on one side only. ``within_noise``: at every such element the value decided on
    (the comparison's input, the clamp's output) differs between the sides by no more than its
    op's rounding noise: rounding that fell on the two sides of a kink, not a divergence, though
    every gradient through those elements differs by a whole term."""

    graph: str  # the forward graph's name (GraphOps.name)
    node: str
    op: str
    elements: int  # how many were decided differently
    index: tuple  # the first of them
    decided_on: str  # the value decided on: the node itself, or the comparison's input
    eager: float  # that value at ``index``, each side's and fp64's
    compiled: float
    reference: float
    noise: float  # its op's own: eager's rmse against fp64
    within_noise: bool


@dataclass
class FusedOutput:
    """An output of an aten graph that fails as the backend compiled the graph (its own
    fusion) while every op passes with each exposed: the kernel that computes it, fused as it
    was, is where the numbers change."""

    graph: str
    index: int  # the graph's output position
    node: str
    op: str
    row: object  # the engine's row of it, the backend's own compilation against eager
    kernel: Optional[Kernel] = None


@dataclass
class GraphOps:
    """One aten graph's nodes, judged: the engine's row of each, in graph order; where none
    fails, the first of its outputs that fails at the backend's own fusion."""

    kind: str
    name: str  # the kind, numbered where a graph break gives the call several of it
    rows: list
    finding: Optional[OpFinding] = None
    fused_output: Optional[FusedOutput] = None


@dataclass
class OpsResult:
    """The op localisation of a call: each aten graph's ops judged, and where its dump went
    (``dynaprobe compare DUMP`` reports it: one row per op)."""

    module: str
    call: int
    step: int
    backend: str
    dump: str
    graphs: List[GraphOps] = field(default_factory=list)
    split_decisions: List[SplitDecision] = field(default_factory=list)

    @property
    def split_by_rounding(self) -> set:
        """The forward nodes whose split decisions are rounding at a kink, not findings, by
        their rows' name (``<graph>.<node>``: a graph break gives a call several forward
        graphs, whose nodes may share names)."""
        return {f"{d.graph}.{d.node}" for d in self.split_decisions if d.within_noise}

    @property
    def findings(self) -> List[OpFinding]:
        return [g.finding for g in self.graphs if g.finding is not None]

    def text(self) -> str:
        lines = [f"Op localisation of {self.module} call {self.call} (step {self.step}), "
                 f"{self.backend} against eager, fp64 as the noise bound:"]
        rounding = self.split_by_rounding
        for graph in self.graphs:
            failing = sum(r.status == vocabulary.STATUS_FAIL for r in graph.rows)
            kinked = sum(r.status == vocabulary.STATUS_FAIL and r.module in rounding
                         for r in graph.rows)
            lines.append(f"  {graph.name} graph: {len(graph.rows)} ops, {failing - kinked} fail"
                         + (f", {kinked} decided otherwise within rounding" if kinked else ""))
        for finding in self.findings:
            row = finding.row
            lines += ["", f"  first op that fails in the {finding.graph} graph: {finding.node} "
                          f"({finding.op})",
                      f"    source   {finding.source or '(no stack trace)'}",
                      f"    error    max_abs={row.max_abs:.3e} mean_abs={row.mean_abs:.3e} "
                      f"max_rel={row.max_rel:.3e}",
                      f"    noise    {_noise_text(row)}",
                      "    inputs   " + ("matched" if finding.inputs_matched and
                                         finding.inputs_max_abs == 0 else
                                         f"within noise (max_abs={finding.inputs_max_abs:.3e})"
                                         if finding.inputs_matched else
                                         f"differ (max_abs={finding.inputs_max_abs:.3e})"),
                      f"    fidelity {finding.fidelity}"]
            if finding.kernel is not None:
                kernel = finding.kernel
                lines += [f"    kernel   {kernel.name}, fusing {', '.join(kernel.fuses)}",
                          f"             {kernel.path}"]
            if finding.repro:
                lines.append(f"    repro    python {finding.repro}  (the op alone, on its real "
                             "inputs; torch only)")
        for fused in (g.fused_output for g in self.graphs if g.fused_output is not None):
            row = fused.row
            lines += ["", f"  the {fused.graph} graph's output {fused.index} ({fused.node}, "
                          f"{fused.op}) fails as the backend compiled the graph,",
                      "  though every op passes with each exposed: the fusion that computes it "
                      "changes the numbers",
                      f"    error    max_abs={row.max_abs:.3e} mean_abs={row.mean_abs:.3e} "
                      f"max_rel={row.max_rel:.3e}",
                      f"    noise    {_noise_text(row)}"]
            if fused.kernel is not None:
                lines += [f"    kernel   {fused.kernel.name}, fusing "
                          f"{', '.join(fused.kernel.fuses)}",
                          f"             {fused.kernel.path}"]
        if not self.findings:
            no_op = "no op fails" + ("" if any(g.fused_output for g in self.graphs) else
                                     ": every difference is within the fp64 noise bound")
            lines += ["", "  " + no_op]
            lines += _split_text(self.split_decisions)
        lines += ["", f"  every op's row: dynaprobe compare {self.dump} (--html PATH draws the "
                      "error along the graph)"]
        return "\n".join(lines) + "\n"


def _noise_text(row) -> str:
    """The reference's verdict on a row: what its fp64 evaluation says of eager and compiled."""
    reference = getattr(row, "reference", None)
    if not isinstance(reference, dict) or "verdict" not in reference:
        return "no fp64 reference (not a floating value)"
    return (f"fp64: {reference['verdict']} (rmse against fp64: compiled="
            f"{reference.get('compiled_rmse', float('nan')):.3e}, eager="
            f"{reference.get('eager_rmse', float('nan')):.3e}; noise is compiled <= "
            f"{reference.get('factor', 2.0):g} x eager)")


def _split_text(decisions: List[SplitDecision]) -> List[str]:
    """What the backward takes that the two sides decided differently: why a module's gradient
    can fail where no op does."""
    if not decisions:
        return []
    lines = ["", "  the backward takes values the two sides decided differently:"]
    for d in decisions:
        index = ", ".join(str(i) for i in d.index)
        lines.append(f"    {d.graph}.{d.node} ({d.op}): {d.elements} element(s), first [{index}]: "
                     f"{d.decided_on} eager={d.eager:.3e} compiled={d.compiled:.3e} "
                     f"fp64={d.reference:.3e} (its op's noise {d.noise:.1e})")
    if all(d.within_noise for d in decisions):
        lines += ["    each within its op's rounding noise: rounding that fell on the two sides "
                  "of a kink, not a",
                  "    compiler divergence; every gradient through those elements differs by a "
                  "whole term, so the",
                  "    module's gradient rows can fail by it (docs/guide/diagnosis.md, "
                  "\"Rounding at a kink\")"]
    return lines
