"""Inside a module: the first op, and the generated kernel, where the numbers change
(``dynaprobe bisect DUMP --module M --ops``, ``checker.bisect(module, ops=True)``).

The stored call is replayed from its captured graph (``GraphReplay``, replay.py) compiled with the
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

Here: ``localise`` and how it reads the judged ops. The watching and the three evaluations
are aten_graphs.py's; the result types and their text, ops_result.py's.
"""

from __future__ import annotations

import operator
import os
import re
import shutil
import sys
from typing import List, Optional

import torch
from torch import fx

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._C.vocabulary import KIND_FWD_OUTPUT, SIDE_COMPILED, SIDE_EAGER, SIDE_REFERENCE
from dynaprobe._offline.aten_graphs import (
    AtenGraph,
    Watcher,
    compiled_afresh,
    compiled_values,
    evaluate,
    name_graphs,
    run_compiled,
)
from dynaprobe._offline.judging import judge, judging_recorder
from dynaprobe._offline.ops_result import (
    FusedOutput,
    GraphOps,
    Kernel,
    OpFinding,
    OpsResult,
    SplitDecision,
)
from dynaprobe._offline.replay import GraphReplay, inductor_patch
from dynaprobe._offline.stored_call import ReplayError, Run, StoredCall
from dynaprobe._results.result import CompareResult


def localise(call: StoredCall, backend, config: Optional[dict] = None, label: str = "",
             folder: Optional[str] = None) -> OpsResult:
    """The first op of each aten graph of the call that fails under ``backend`` (see the module
    docstring). Every op's values are judged in a dump of their own, written to ``folder``
    (default: ``ops/<module>.call<C>.step<S>`` beside the call's step file): one row per op,
    module ``<graph>.<node>``, which ``dynaprobe compare`` reports as it reports modules."""
    replay = GraphReplay(call)
    watcher = Watcher()
    folder = folder or ops_folder(call)
    result = OpsResult(call.module, call.call, call.step, label or _backend_name(backend), folder)
    with inductor_patch(config or {}), compiled_afresh():
        replay.run(watcher.backend(backend), "ops")
        graphs = [g for g in watcher.graphs if g.inputs]  # a graph compiled but not run: none
        name_graphs(graphs)
        if not graphs:
            raise ReplayError(f"the replay of {call.module} call {call.call} ran no aten graph "
                              f"that {result.backend} compiled, so there are no ops to compare: "
                              "the stage bisection (bisect without --ops) still names the stage; "
                              "a custom backend is watched when it is built with aot_autograd or "
                              "calls inductor's compile_fx")
        evaluated = []
        for graph in graphs:
            graph.inputs = [a.detach() if isinstance(a, torch.Tensor) else a
                            for a in graph.inputs]
            with torch.no_grad():
                evaluated.append(evaluate(graph))
        rows = _judged(call, graphs, evaluated, folder, result.backend)
        for graph, (nodes, eager, reference, compiled, code) in zip(graphs, evaluated):
            ops = GraphOps(graph.kind, graph.name,
                           [rows[f"{graph.name}.{n.name}"] for n in nodes])
            if graph.kind == "forward":
                with torch.no_grad():
                    result.split_decisions += _split_decisions(
                        graph, nodes, ops.rows, eager, dict(zip((n.name for n in nodes),
                                                                compiled)), reference)
            rounding = result.split_by_rounding
            first = next((i for i, r in enumerate(ops.rows)
                          if r.status == vocabulary.STATUS_FAIL and r.module not in rounding),
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
    own = list(run_compiled(compiled, list(graph.inputs)))
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
        row = next(r for r in result.rows if r.check_type == KIND_FWD_OUTPUT)
        if row.status == vocabulary.STATUS_FAIL:
            return FusedOutput(graph.name, index, node.name, op_name(node), row,
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
            graph.name, node.name, op_name(node), int(split.sum()), index,
            "its input " + decided_on if decided_on != node.name else "its value",
            *(float(v[index]) for v in values), noise, within))
    return decisions


def _eager_noise(row) -> float:
    """Eager's own error against fp64 of an op's row (nan where it has no reference)."""
    reference = getattr(row, "reference", None)
    return float(reference.get("eager_rmse", float("nan"))) if isinstance(reference, dict) \
        else float("nan")


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
            module = f"{graph.name}.{node.name}"
            recorder.record_module(module, {
                vocabulary.ATTRIBUTE_OP: op_name(node),
                vocabulary.ATTRIBUTE_GRAPH: graph.name,
                vocabulary.ATTRIBUTE_SOURCE: _source(node.meta.get("stack_trace") or "")})
            for side, tensor in ((SIDE_EAGER, eager[node.name]), (SIDE_COMPILED, value),
                                 (SIDE_REFERENCE, reference[node.name])):
                recorder.record(module, 0, KIND_FWD_OUTPUT, 0, side, tensor)
        recorder.record_graph(f"{graph.name}_graph", graph.kind,
                              graph.gm.print_readable(print_output=False))
    recorder.end_step()
    comparison = _C.compare(folder, folder)
    return {row.module: row for row in CompareResult.from_report(
        comparison.steps[0], folder, "", comparison).rows if row.check_type == KIND_FWD_OUTPUT}


def op_name(node: fx.Node) -> str:
    """The op a node computes, as ``aten.<name>.<overload>``: for an element of a multi-output
    op's result (``getitem``: var_mean's variance, say), that op's."""
    if node.target is operator.getitem and node.args and isinstance(node.args[0], fx.Node):
        return str(node.args[0].target)
    return str(node.target)


def _finding(call: StoredCall, graph: AtenGraph, node: fx.Node, rows: list,
             nodes: List[fx.Node], code, eager: dict, reference: dict) -> OpFinding:
    """The finding at ``node``; ``eager`` and ``reference`` are the graph's evaluated values."""
    by_name = {n.name: r for n, r in zip(nodes, rows)}
    inputs = [a.name for a in node.all_input_nodes if a.name in by_name]
    matched = all(by_name[n].status != vocabulary.STATUS_FAIL for n in inputs)
    inputs_max = max((by_name[n].max_abs for n in inputs), default=0.0)
    row = by_name[node.name]
    # Cut after the node, only it exposed: the fusion closest to the backend's own.
    alone, alone_code = compiled_values(graph, [node.name], keep_outputs=False)
    single = judge(call, [(Run([eager[node.name]]), Run(alone))],
                   references=[Run([reference[node.name]])])[0].rows
    single = next(r for r in single if r.check_type == KIND_FWD_OUTPUT)
    if single.status == vocabulary.STATUS_FAIL:
        fidelity = ("confirmed with the graph cut after it and only it exposed "
                    f"(max_abs={single.max_abs:.3e})")
        kernel = _kernel(graph.code, node.name) or _kernel(alone_code, node.name)
    else:
        fidelity = ("seen only with every op exposed (a changed fusion): with the graph cut "
                    f"after it and only it exposed it passes (max_abs={single.max_abs:.3e})")
        kernel = _kernel(graph.code, node.name) or _kernel(code, node.name)
    trace = node.meta.get("stack_trace") or ""
    finding = OpFinding(graph.name, node.name, op_name(node), _source(trace), row, matched,
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
    function = f"{graph.name}_{node.name}"
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
                              f"the op {node.name} ({node.target}) of its {graph.name} graph, "
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
