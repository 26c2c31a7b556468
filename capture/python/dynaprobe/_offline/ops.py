"""Inside a module: the first op, and the generated kernel, where the numbers change
(``dynaprobe bisect DUMP --module M --ops``, ``checker.bisect(module, ops=True)``).

The stored call is replayed from its captured graph (``_replay.GraphReplay``) compiled with the
recorded backend, whose own compilers of aten graphs are watched: inductor's ``compile_fx_inner``
(its post-grad passes, fusion and code generation), or the ``fw_compiler`` / ``bw_compiler`` of
an ``aot_autograd`` backend. That yields the aten graphs the backend compiled, forward and
backward, after AOTAutograd, its decompositions and its partitioner, and what each took in the
replay.

Each graph is then evaluated three ways on those very inputs: node by node in eager
(``fx.Interpreter``), node by node in float64 (every floating input and dtype argument raised to
float64: the noise bound), and compiled by the backend's own compiler with every computed node
exposed as an output. The engine judges each node's compiled value against eager with the fp64
value as the reference, by the rule of ``reference="fp64"``: a difference as large as eager's own
rounding is noise. The first node that fails, in the graph's order, is the finding; its inputs
are said to match when they passed. Exposing the nodes changes what inductor may fuse, so the
finding is checked again with the graph cut after that node and only it exposed; when only that
changes its verdict, the finding says it was seen with a changed fusion. Where no op fails, the
graph's outputs are judged as the backend compiled it (a fault of one fusion, gone with every op
exposed), and the masks and clamps the backward takes that the two sides decided differently are
listed: split by rounding, they are a kink's, not a divergence (docs/guide/diagnosis.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
from torch import fx

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._offline.replay import (
    GraphReplay,
    ReplayError,
    Run,
    StoredCall,
    inductor_patch,
    judge,
    judging_recorder,
)
from dynaprobe._results.result import CompareResult
from dynaprobe._vocabulary import COMPILED, EAGER, FWD_OUTPUT, REFERENCE

_LOW_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class AtenGraph:
    """An aten graph the backend compiled: ``kind`` (forward, backward, inference), the graph as
    the backend received it (before its own passes), what it took in the replay, and the
    backend's compiler of such a graph: (the compiled callable, inductor's kernels by name with
    the graph nodes each computes; empty for other backends)."""

    kind: str
    gm: fx.GraphModule
    inputs: list
    compile: Callable[[fx.GraphModule, list], tuple]
    code: tuple = (None, {})  # the backend's own compilation of it: (callable, kernels)


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

    graph: str  # forward, backward, inference
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
        """The forward nodes whose split decisions are rounding at a kink: not findings."""
        return {d.node for d in self.split_decisions if d.within_noise}

    @property
    def findings(self) -> List[OpFinding]:
        return [g.finding for g in self.graphs if g.finding is not None]

    def text(self) -> str:
        lines = [f"Op localisation of {self.module} call {self.call} (step {self.step}), "
                 f"{self.backend} against eager, fp64 as the noise bound:"]
        rounding = self.split_by_rounding
        for graph in self.graphs:
            failing = sum(r.status == vocabulary.STATUS_FAIL for r in graph.rows)
            kinked = sum(r.status == vocabulary.STATUS_FAIL and r.module.split(".", 1)[1] in
                         rounding for r in graph.rows) if graph.kind == "forward" else 0
            lines.append(f"  {graph.kind} graph: {len(graph.rows)} ops, {failing - kinked} fail"
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
        lines.append(f"    {d.node} ({d.op}): {d.elements} element(s), first [{index}]: "
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


# ---------------------------------------------------------------------- watching the backend
class _Watcher:
    """Wraps a backend so that its compilers of aten graphs are watched (AtenGraph each)."""

    def __init__(self):
        self.graphs: List[AtenGraph] = []

    def backend(self, backend):
        """The watched backend, or ReplayError for one whose aten compilers cannot be seen."""
        from torch._dynamo.backends.common import AotAutograd  # noqa: PLC0415

        if isinstance(backend, str) and backend == "inductor":
            return self._inductor()
        if isinstance(backend, str):
            backend = torch._dynamo.lookup_backend(backend)
        if isinstance(backend, AotAutograd):
            from torch._dynamo.backends.common import aot_autograd  # noqa: PLC0415

            kwargs = dict(backend.kwargs)
            for key, kind in (("fw_compiler", "forward"), ("bw_compiler", "backward"),
                              ("inference_compiler", "inference")):
                if kwargs.get(key) is not None:
                    kwargs[key] = self._aot(kwargs[key], kind)
            if "inference_compiler" not in backend.kwargs and "fw_compiler" in backend.kwargs:
                kwargs["inference_compiler"] = self._aot(backend.kwargs["fw_compiler"],
                                                         "inference")
            return aot_autograd(**kwargs)
        raise ReplayError(f"the backend {backend!r} is neither inductor nor an aot_autograd "
                          "backend: its aten graphs cannot be watched, so ops cannot be compared")

    def _inductor(self):
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # noqa: PLC0415

        def tracked(gm, example_inputs, **kwargs):
            """compile_fx_inner, with inductor's provenance tracking: each kernel's nodes."""
            from torch._inductor import config, debug  # noqa: PLC0415

            with debug.reset_provenance_globals(), config.patch({
                    "trace.provenance_tracking_level": 1}):
                compiled = compile_fx_inner(gm, example_inputs, **kwargs)
                return compiled, dict(debug._inductor_triton_kernel_to_post_grad_node_info)

        def inner(gm, example_inputs, **kwargs):
            kind = "backward" if kwargs.get("is_backward") else (
                "inference" if kwargs.get("is_inference") else "forward")
            before = _copy(gm)
            compiled, kernels = tracked(gm, example_inputs, **kwargs)
            own = dict(kwargs)
            return self._keep(kind, before, (compiled, kernels),
                              lambda g, inputs: tracked(g, inputs, **own))

        return lambda gm, example_inputs: compile_fx(gm, example_inputs, inner_compile=inner)

    def _aot(self, compiler, kind: str):
        def watched(gm, example_inputs, **kwargs):
            before = _copy(gm)
            compiled = compiler(gm, example_inputs, **kwargs)
            return self._keep(kind, before, (compiled, {}),
                              lambda g, inputs: (compiler(g, inputs, **kwargs), {}))

        return watched

    def _keep(self, kind: str, gm: fx.GraphModule, code: tuple, compile_again):
        graph = AtenGraph(kind, gm, [], compile_again, code)
        self.graphs.append(graph)
        compiled = code[0]
        if getattr(compiled, "_boxed_call", False):
            def run(args):
                graph.inputs = list(args)
                return compiled(args)

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        def run_unboxed(*args):
            graph.inputs = list(args)
            return compiled(*args)

        return run_unboxed


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A graph of its own on the same module (node metadata copied shallowly: its fake tensors
    do not deep-copy)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _call(compiled, inputs: list):
    return compiled(list(inputs)) if getattr(compiled, "_boxed_call", False) else \
        compiled(*inputs)


# ---------------------------------------------------------------------- evaluating a graph
def _computed(gm: fx.GraphModule) -> List[fx.Node]:
    """The nodes whose values are compared: ops that compute a tensor (not views of one)."""
    nodes = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is not None and any(r.alias_info is not None for r in schema.returns):
            continue  # a view: its values are its base's
        nodes.append(node)
    return nodes


class _Evaluation(fx.Interpreter):
    """Runs a graph node by node, keeping each value; ``fp64`` raises every floating input and
    dtype argument to float64 (the reference evaluation)."""

    def __init__(self, gm: fx.GraphModule, fp64: bool):
        super().__init__(gm)
        self.fp64 = fp64
        self.values: Dict[str, object] = {}

    def run_node(self, node: fx.Node):
        if self.fp64 and node.op == "call_function":
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            args, kwargs = _raise_dtypes((args, kwargs))
            value = getattr(self, node.op)(node.target, args, kwargs)
        else:
            value = super().run_node(node)
        self.values[node.name] = value
        return value


def _raise_dtypes(value):
    if isinstance(value, torch.dtype):
        return torch.float64 if value in _LOW_FLOATS else value
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64) if value.dtype in _LOW_FLOATS else value
    if isinstance(value, (list, tuple)):
        return type(value)(_raise_dtypes(v) for v in value)
    if isinstance(value, dict):
        return {k: _raise_dtypes(v) for k, v in value.items()}
    return value


def _exposed(gm: fx.GraphModule, nodes: List[str], keep_outputs: bool = True) -> fx.GraphModule:
    """A copy of the graph with ``nodes`` as its outputs (after its own, with ``keep_outputs``;
    else the graph is cut after the last of them)."""
    copied = _copy(gm)
    by_name = {n.name: n for n in copied.graph.nodes}
    output = next(n for n in copied.graph.nodes if n.op == "output")
    own = list(output.args[0]) if keep_outputs else []
    copied.graph.erase_node(output)
    copied.graph.output(tuple(own + [by_name[n] for n in nodes]))
    if not keep_outputs:
        copied.graph.eliminate_dead_code()
    copied.recompile()
    return copied


def _compiled_values(graph: AtenGraph, nodes: List[str], keep_outputs: bool = True) -> tuple:
    """The compiled values of ``nodes`` and the compiled graph's (callable, kernels)."""
    gm = _exposed(graph.gm, nodes, keep_outputs)
    compiled, kernels = graph.compile(gm, list(graph.inputs))
    out = _call(compiled, graph.inputs)
    kept = len(next(n for n in graph.gm.graph.nodes if n.op == "output").args[0]) \
        if keep_outputs else 0
    return list(out)[kept:], (compiled, kernels)


def localise(call: StoredCall, backend, config: Optional[dict] = None, label: str = "",
             folder: Optional[str] = None) -> OpsResult:
    """The first op of each aten graph of the call that fails under ``backend`` (see the module
    docstring). Every op's values are judged in a dump of their own, written to ``folder``
    (default: ``ops/<module>.call<C>.step<S>`` beside the call's step file): one row per op,
    module ``<graph>.<node>``, which ``dynaprobe compare`` reports as it reports modules."""
    replay = GraphReplay(call)
    watcher = _Watcher()
    folder = folder or ops_folder(call)
    result = OpsResult(call.module, call.call, call.step, label or _backend_name(backend), folder)
    with inductor_patch(config or {}), _compiled_afresh():
        replay.run(watcher.backend(backend), "ops")
        graphs = [g for g in watcher.graphs if g.inputs]  # a graph compiled but not run: none
        if not graphs:
            raise ReplayError(f"the replay of {call.module} call {call.call} ran no aten graph "
                              f"that {result.backend} compiled, so there are no ops to compare: "
                              "the stage bisection (bisect without --ops) still names the stage; "
                              "with a custom backend, build it with aot_autograd so that its "
                              "compilers can be watched")
        evaluated = []
        for graph in graphs:
            graph.inputs = [a.detach() if isinstance(a, torch.Tensor) else a
                            for a in graph.inputs]
            with torch.no_grad():
                evaluated.append(_evaluate(graph))
        rows = _judged(call, graphs, evaluated, folder, result.backend)
        for graph, (nodes, eager, reference, compiled, code) in zip(graphs, evaluated):
            ops = GraphOps(graph.kind, [rows[f"{graph.kind}.{n.name}"] for n in nodes])
            if graph.kind == "forward":
                with torch.no_grad():
                    result.split_decisions += _split_decisions(
                        graph, nodes, ops.rows, eager, dict(zip((n.name for n in nodes),
                                                                compiled)), reference)
            rounding = result.split_by_rounding if graph.kind == "forward" else set()
            first = next((i for i, (n, r) in enumerate(zip(nodes, ops.rows))
                          if r.status == vocabulary.STATUS_FAIL and n.name not in rounding),
                         None)
            with torch.no_grad():
                if first is not None:
                    ops.finding = _finding(call, graph, nodes[first], ops.rows, nodes, code,
                                           eager, reference)
                else:  # no op fails, bar masks split by rounding
                    ops.fused_output = _fused_output(call, graph, eager, reference)
            result.graphs.append(ops)
    return result


def _fused_output(call: StoredCall, graph: AtenGraph, eager: dict,
                  reference: dict) -> Optional[FusedOutput]:
    """The first output of the graph that fails as the backend compiled it, against the
    graph evaluated node by node: exposing every op changes what inductor fuses, so a fault of
    a fusion can pass op by op."""
    compiled, kernels = graph.code
    if compiled is None:
        return None
    own = list(_call(compiled, list(graph.inputs)))
    output = next(n for n in graph.gm.graph.nodes if n.op == "output")
    judged = [(i, node, own[i]) for i, node in enumerate(output.args[0])
              if isinstance(node, fx.Node) and i < len(own) and isinstance(own[i], torch.Tensor)
              and node.name in eager and node.name in reference
              and isinstance(eager[node.name], torch.Tensor)
              and eager[node.name].dtype != torch.bool]  # a mask: judged by what it decided on
    if not judged:
        return None
    pairs = [(Run([eager[n.name]]), Run([value])) for _, n, value in judged]
    results = judge(call, pairs, references=[Run([reference[n.name]]) for _, n, _ in judged])
    for (index, node, _), result in zip(judged, results):
        row = next(r for r in result.rows if r.check_type == FWD_OUTPUT)
        if row.status == vocabulary.STATUS_FAIL:
            return FusedOutput(graph.kind, index, node.name, str(node.target), row,
                               _nearest_kernel(graph.code, node))
    return None


def _nearest_kernel(code: tuple, node: fx.Node) -> Optional[Kernel]:
    """The generated kernel of ``node``, else of its nearest producer that has one: a view has
    none, and an extern matmul is not a generated kernel, so the fusion feeding it is named."""
    frontier, seen = [node], set()
    while frontier:
        current = frontier.pop(0)
        if current in seen:
            continue
        seen.add(current)
        kernel = _kernel(code, current.name)
        if kernel is not None and not kernel.name.startswith("extern_kernels."):
            return kernel
        frontier += current.all_input_nodes
    return None


def _split_decisions(graph: AtenGraph, nodes: List[fx.Node], rows: list, eager: dict,
                     compiled: dict, reference: dict) -> List[SplitDecision]:
    """The forward graph's outputs (what the backward takes) that are True, or zero, on one side
    only at some elements (see SplitDecision)."""
    output = next(n for n in graph.gm.graph.nodes if n.op == "output")
    returned = {n.name for n in output.all_input_nodes}
    row_of = {n.name: r for n, r in zip(nodes, rows)}
    decisions = []
    for node in nodes:
        ours, theirs = eager[node.name], compiled.get(node.name)
        if node.name not in returned or not isinstance(theirs, torch.Tensor):
            continue
        if ours.dtype == torch.bool:  # a comparison: what it decided on is its input
            split = ours != theirs
            decided_on = next((a.name for a in node.all_input_nodes
                               if a.name in compiled and compiled[a.name].is_floating_point()),
                              None)
            if decided_on is None:
                continue
        else:  # a clamp: zero on one side only
            split, decided_on = (ours == 0) != (theirs == 0), node.name
        if not bool(split.any()):
            continue
        values = [side[decided_on].double() for side in (eager, compiled, reference)]
        noise = _eager_noise(row_of.get(decided_on))
        moved = (values[0] - values[1]).abs()[split]
        within = bool(((moved > 0) & (moved <= 4 * noise)).all())
        index = tuple(int(i) for i in split.nonzero()[0])
        decisions.append(SplitDecision(
            node.name, str(node.target), int(split.sum()), index,
            "its input " + decided_on if decided_on != node.name else "its value",
            *(float(v[index]) for v in values), noise, within))
    return decisions


def _eager_noise(row) -> float:
    """Eager's own error against fp64 of an op's row (nan where it has no reference)."""
    reference = getattr(row, "reference", None)
    return float(reference.get("eager_rmse", float("nan"))) if isinstance(reference, dict) \
        else float("nan")


def _compiled_afresh():
    """No compile cache: a graph AOTAutograd's or inductor's cache already holds is returned
    without its compilers being called, so the watcher would see no graph."""
    import torch._functorch.config as functorch_config  # noqa: PLC0415
    import torch._inductor.config as inductor_config  # noqa: PLC0415

    stack = contextlib.ExitStack()
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    return stack


def _backend_name(backend) -> str:
    """A backend in words: its name, or its compiler's."""
    if isinstance(backend, str):
        return backend
    kwargs = getattr(backend, "kwargs", {}) or {}
    compiler = kwargs.get("fw_compiler")
    if compiler is not None:
        return f"aot_autograd({getattr(compiler, '__name__', type(compiler).__name__)})"
    return getattr(backend, "__name__", type(backend).__name__)


def ops_folder(call: StoredCall) -> str:
    """Where the ops dump of a call goes: ``ops/`` beside its step file."""
    name = re.sub(r"[^\w.-]", "_", call.module)
    return os.path.join(os.path.dirname(os.path.abspath(call.path)), "ops",
                        f"{name}.call{call.call}.step{call.step}")


def _evaluate(graph: AtenGraph) -> tuple:
    """(nodes, eager values, fp64 values, compiled values, compiled code) of a graph."""
    nodes = _computed(graph.gm)
    eager = _Evaluation(graph.gm, fp64=False)
    eager.run(*graph.inputs)
    reference = _Evaluation(graph.gm, fp64=True)
    reference.run(*_raise_dtypes(list(graph.inputs)))
    compiled, code = _compiled_values(graph, [n.name for n in nodes])
    return nodes, eager.values, reference.values, compiled, code


def _judged(call: StoredCall, graphs: List[AtenGraph], evaluated: list, folder: str,
            result_label: str) -> dict:
    """Writes the ops dump (one step, a row per op in graph order, the aten graphs) and judges
    it; the rows by module name (``<graph>.<node>``)."""
    shutil.rmtree(folder, ignore_errors=True)
    recorder = judging_recorder(call, folder, producer="dynaprobe bisect --ops", **{
        vocabulary.PROVENANCE_OPS_MODULE: call.module,
        vocabulary.PROVENANCE_OPS_CALL: str(call.call),
        vocabulary.PROVENANCE_OPS_BACKEND: result_label})
    recorder.begin_step(call.step)
    for graph, (nodes, eager, reference, compiled, _) in zip(graphs, evaluated):
        for node, value in zip(nodes, compiled):
            module = f"{graph.kind}.{node.name}"
            recorder.record_module(module, {
                vocabulary.ATTRIBUTE_OP: str(node.target),
                vocabulary.ATTRIBUTE_GRAPH: graph.kind,
                vocabulary.ATTRIBUTE_SOURCE: _source(node.meta.get("stack_trace") or "")})
            for side, tensor in ((EAGER, eager[node.name]), (COMPILED, value),
                                 (REFERENCE, reference[node.name])):
                recorder.record(module, 0, FWD_OUTPUT, 0, side, tensor)
        recorder.record_graph(f"{graph.kind}_graph", graph.kind,
                              graph.gm.print_readable(print_output=False))
    recorder.end_step()
    comparison = _C.compare(folder, folder)
    return {row.module: row for row in CompareResult.from_report(
        comparison.steps[0], folder, "", comparison).rows if row.check_type == FWD_OUTPUT}


def _finding(call: StoredCall, graph: AtenGraph, node: fx.Node, rows: list,
             nodes: List[fx.Node], code, eager: dict, reference: dict) -> OpFinding:
    """The finding at ``node``; ``eager`` and ``reference`` are the graph's evaluated values."""
    by_name = {n.name: r for n, r in zip(nodes, rows)}
    inputs = [a.name for a in node.all_input_nodes if a.name in by_name]
    matched = all(by_name[n].status != vocabulary.STATUS_FAIL for n in inputs)
    inputs_max = max((by_name[n].max_abs for n in inputs), default=0.0)
    row = by_name[node.name]
    # Cut after the node, only it exposed: the fusion closest to the backend's own.
    alone, alone_code = _compiled_values(graph, [node.name], keep_outputs=False)
    single = judge(call, [(Run([eager[node.name]]), Run(alone))],
                   references=[Run([reference[node.name]])])[0].rows
    single = next(r for r in single if r.check_type == FWD_OUTPUT)
    if single.status == vocabulary.STATUS_FAIL:
        fidelity = ("confirmed with the graph cut after it and only it exposed "
                    f"(max_abs={single.max_abs:.3e})")
        kernel = _kernel(graph.code, node.name) or _kernel(alone_code, node.name)
    else:
        fidelity = ("seen only with every op exposed (a changed fusion): with the graph cut "
                    f"after it and only it exposed it passes (max_abs={single.max_abs:.3e})")
        kernel = _kernel(graph.code, node.name) or _kernel(code, node.name)
    trace = node.meta.get("stack_trace") or ""
    finding = OpFinding(graph.kind, node.name, str(node.target), _source(trace), row, matched,
                        inputs_max, fidelity, kernel)
    finding.repro = _op_repro(call, graph, node, eager, finding)
    return finding


def _op_repro(call: StoredCall, graph: AtenGraph, node: fx.Node, values: dict,
              finding: OpFinding) -> str:
    """A repro folder of the op alone: a graph of it with its inputs as placeholders, taking the
    values it took (eager's: the same on both sides when its inputs matched)."""
    from dynaprobe._mechanics.graph_runner import GraphCall  # noqa: PLC0415
    from dynaprobe._offline.repro import write_graph_folder  # noqa: PLC0415

    small = fx.Graph()
    inputs = {inp: small.placeholder(inp.name) for inp in node.all_input_nodes}
    small.output((small.node_copy(node, lambda n: inputs[n]),))
    gm = fx.GraphModule(torch.nn.Module(), small)
    function = f"{graph.kind}_{node.name}"
    args = [values[inp.name] for inp in inputs]
    call_of_op = GraphCall(function, args, [inp.name for inp in inputs], [], [node.name],
                           rng=torch.get_rng_state())
    folder = os.path.join(os.path.dirname(ops_folder(call)) + "_repro",
                          f"{os.path.basename(ops_folder(call))}.{function}")
    shutil.rmtree(folder, ignore_errors=True)
    recorded = [f"  {finding.row.status:4} {finding.graph}.{finding.node} ({finding.op}) "
                f"max_abs={finding.row.max_abs!r} mean_abs={finding.row.mean_abs!r} "
                f"max_rel={finding.row.max_rel!r}  at {finding.source}"]
    return write_graph_folder(call, folder, {function: gm}, [call_of_op], False,
                              str(args[0].device) if args and isinstance(args[0], torch.Tensor)
                              else "cpu", recorded,
                              f"the op {node.name} ({node.target}) of its {graph.kind} graph, "
                              "alone, on the values it took")


def _source(trace: str) -> str:
    """``file:line  code`` of the innermost frame of a stack trace."""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        match = re.match(r'File "([^"]+)", line (\d+)', lines[i])
        if match:
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{match.group(1)}:{match.group(2)}  {code}"
    return lines[-1] if lines else ""


def _kernel(code: tuple, node: str) -> Optional[Kernel]:
    """The inductor kernel that computes ``node`` (inductor's provenance tracking: each kernel's
    post-grad nodes), with the file of the generated code; None for other backends."""
    compiled, kernels = code
    runner = getattr(compiled, "current_callable", None)
    module = sys.modules.get(getattr(runner, "__module__", "") or "")
    path = getattr(module, "__file__", "") or ""
    for name, nodes in kernels.items():
        if node in nodes:
            return Kernel(name.rsplit(":", 1)[0], list(nodes), path)
    return None
