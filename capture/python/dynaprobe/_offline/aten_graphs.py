"""The aten graphs a backend compiles, watched and evaluated, for op localisation (ops.py).

``Watcher`` wraps the recorded backend so that its own compilers of aten graphs are seen:
inductor's ``compile_fx_inner`` (with its kernels' provenance; also under a backend of the user's
own that calls ``compile_fx``) or an ``aot_autograd`` backend's ``fw_compiler`` /
``bw_compiler``; each graph is kept as an ``AtenGraph`` with the inputs it took
in the replay and a way to compile it again. ``evaluate`` runs such a graph three ways: node by
node in eager, node by node in float64 (the noise bound), and compiled with every computed node
exposed as an output.
"""

from __future__ import annotations

import contextlib
import importlib
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
from torch import fx

from dynaprobe._mechanics.replay_store import inductor_config_changes
from dynaprobe._offline.stored_call import ReplayError

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
    name: str = ""  # the kind, numbered where a graph break gives the call several of it


def name_graphs(graphs: List[AtenGraph]) -> None:
    """Names each graph by its kind, numbered in compile order (``forward_1``, ``forward_2``)
    where the call has more than one of that kind: a module with a graph break."""
    of_kind = Counter(graph.kind for graph in graphs)
    seen: Counter = Counter()
    for graph in graphs:
        seen[graph.kind] += 1
        graph.name = graph.kind if of_kind[graph.kind] == 1 else f"{graph.kind}_{seen[graph.kind]}"


# ---------------------------------------------------------------------- watching the backend
class Watcher:
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
        if callable(backend):
            return self._around_compile_fx(backend)
        raise ReplayError(f"the backend {backend!r} is neither inductor nor an aot_autograd "
                          "backend: its aten graphs cannot be watched, so ops cannot be compared")

    def _around_compile_fx(self, backend):
        """A backend of the user's own that calls inductor's ``compile_fx`` (with its own config
        patches, say): while it compiles, compile_fx's default inner compiler is the watched
        one, which the backward's lazy compile keeps too. A backend that compiles otherwise
        shows no aten graph, which localise says."""
        module = importlib.import_module("torch._inductor.compile_fx")  # not its function
        inner = self._inner()

        def watched(gm, example_inputs):
            defaults = module.compile_fx.__defaults__
            module.compile_fx.__defaults__ = (inner,) + defaults[1:]
            try:
                return backend(gm, example_inputs)
            finally:
                module.compile_fx.__defaults__ = defaults

        return watched

    def _inductor(self):
        from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415

        inner = self._inner()
        return lambda gm, example_inputs: compile_fx(gm, example_inputs, inner_compile=inner)

    def _inner(self):
        """compile_fx's inner compiler, watched: each aten graph it compiles is kept."""
        from torch._inductor.compile_fx import compile_fx_inner  # noqa: PLC0415

        def tracked(gm, example_inputs, **kwargs):
            """compile_fx_inner, with inductor's provenance tracking: each kernel's nodes."""
            from torch._inductor import config, debug  # noqa: PLC0415

            with debug.reset_provenance_globals(), config.patch({
                    "trace.provenance_tracking_level": 1}):
                compiled = compile_fx_inner(gm, example_inputs, **kwargs)
                return compiled, dict(debug._inductor_triton_kernel_to_post_grad_node_info)

        def inner(gm, example_inputs, **kwargs):
            from torch._inductor import config  # noqa: PLC0415

            kind = "backward" if kwargs.get("is_backward") else (
                "inference" if kwargs.get("is_inference") else "forward")
            before = _copy(gm)
            compiled, kernels = tracked(gm, example_inputs, **kwargs)
            own = dict(kwargs)
            # The config this graph compiled under (a backend's own config_patches are set
            # around this call only): compiled again under it, with its nodes exposed.
            switches = {key: value for key, (value, _) in inductor_config_changes().items()}

            def compile_again(g, inputs):
                with config.patch(switches):
                    return tracked(g, inputs, **own)

            return self._keep(kind, before, (compiled, kernels), compile_again)

        return inner

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


def run_compiled(compiled, inputs: list):
    """Calls a compiled graph on ``inputs``, boxed (one list) or not, as it expects."""
    return compiled(list(inputs)) if getattr(compiled, "_boxed_call", False) else \
        compiled(*inputs)


def compiled_afresh():
    """No compile cache: a graph AOTAutograd's or inductor's cache already holds is returned
    without its compilers being called, so the watcher would see no graph."""
    import torch._functorch.config as functorch_config  # noqa: PLC0415
    import torch._inductor.config as inductor_config  # noqa: PLC0415

    stack = contextlib.ExitStack()
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    return stack


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


def compiled_values(graph: AtenGraph, nodes: List[str], keep_outputs: bool = True) -> tuple:
    """The compiled values of ``nodes`` and the compiled graph's (callable, kernels)."""
    gm = _exposed(graph.gm, nodes, keep_outputs)
    compiled, kernels = graph.compile(gm, list(graph.inputs))
    out = run_compiled(compiled, graph.inputs)
    kept = len(next(n for n in graph.gm.graph.nodes if n.op == "output").args[0]) \
        if keep_outputs else 0
    return list(out)[kept:], (compiled, kernels)


def evaluate(graph: AtenGraph) -> tuple:
    """(nodes, eager values, fp64 values, compiled values, compiled code) of a graph."""
    nodes = _computed(graph.gm)
    eager = _Evaluation(graph.gm, fp64=False)
    eager.run(*graph.inputs)
    reference = _Evaluation(graph.gm, fp64=True)
    reference.run(*_raise_dtypes(list(graph.inputs)))
    compiled, code = compiled_values(graph, [n.name for n in nodes])
    return nodes, eager.values, reference.values, compiled, code
