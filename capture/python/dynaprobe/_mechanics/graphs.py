"""Graph capture: what Dynamo and AOTAutograd made of each wrapped module.

dynaprobe hands ``torch.compile`` a thin backend that forwards to the real one unchanged and, on
the way, keeps

- the graph Dynamo captured (the ``GraphModule`` it passes to every backend; its
  ``meta["backend_id"]`` carries Dynamo's own ``__compiled_fn_<n>`` name), and
- the forward and backward (or inference) graphs AOTAutograd derives from it, from PyTorch's
  structured trace (``torch._logging.trace_structured``: ``aot_forward_graph``,
  ``aot_backward_graph``, ``aot_inference_graph``), listened to only while the real backend runs.

Both are PyTorch's most stable public-facing artifacts of compilation (they feed ``TORCH_TRACE``
and tlparse). If a future PyTorch stops delivering them, ``tests/python/test_graphs.py`` fails.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import operator
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch import fx

_FN_NAME = re.compile(r"^(__compiled_fn_\d+)")
# Structured-trace artifact -> (graph kind stored in the dump, file-name part PyTorch uses).
_AOT_ARTIFACTS = {
    "aot_forward_graph": ("forward", "Forward_Graph"),
    "aot_inference_graph": ("forward", "Forward_Graph"),
    "aot_backward_graph": ("backward", "Backward_Graph"),
}


@dataclass
class Graph:
    name: str  # "__compiled_fn_1.Forward_Graph.1a2b3c4d"
    kind: str  # "captured", "forward", "backward"
    function: str  # "__compiled_fn_1"
    module: str  # the wrapped module it was compiled for
    text: str


class _AotGraphListener(logging.Handler):
    """Collects AOTAutograd's graphs from the structured trace while a backend compiles."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.graphs: List[tuple] = []

    def emit(self, record: logging.LogRecord) -> None:
        metadata = getattr(record, "metadata", None) or {}
        for artifact in metadata:
            if artifact in _AOT_ARTIFACTS:
                payload = getattr(record, "payload", None)
                if isinstance(payload, str) and payload:
                    self.graphs.append((artifact, payload))


def real_backend(backend, options: Optional[Dict[str, Any]] = None) -> Callable:
    """The callable ``torch.compile(backend=backend, options=options)`` compiles with (options:
    inductor config switches, for inductor alone)."""
    if callable(backend):
        return backend
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(None, options or None, None)
    return torch._dynamo.lookup_backend(backend)


class GraphRecorder:
    """A torch.compile backend that compiles with ``backend`` and remembers the graphs."""

    def __init__(self, backend) -> None:
        self.backend = backend  # as the user named it
        self.real = real_backend(backend)
        self.graphs: List[Graph] = []
        self.functions: Dict[str, List[str]] = {}  # module -> compiled functions, cumulative
        self.failures: Dict[str, List[str]] = {}  # module -> backend errors, cumulative
        self.captured: Dict[str, fx.GraphModule] = {}  # function -> Dynamo's graph (replays)
        self._listening: Dict[str, List["LiveGraphCall"]] = {}  # module -> its call's graphs
        # module -> the backend a confirmed remedy compiles it with (checker.confirm)
        self.changed: Dict[str, Callable] = {}

    @contextlib.contextmanager
    def listen(self, module: str) -> Iterator[List["LiveGraphCall"]]:
        """Collects, while the block runs, each run of a compiled function of ``module``: what
        a replay from the captured graph needs (LiveGraphCall)."""
        calls: List[LiveGraphCall] = []
        self._listening[module] = calls
        try:
            yield calls
        finally:
            self._listening.pop(module, None)

    def for_module(self, module: str) -> Callable:
        """The backend to compile ``module`` with."""

        def backend(gm: torch.fx.GraphModule, example_inputs):
            return self.compile(module, gm, example_inputs)

        return backend

    def compile(self, module: str, gm: torch.fx.GraphModule, example_inputs):
        """Compiles ``gm`` for ``module`` with the real backend, keeping its graphs."""
        match = _FN_NAME.match(str(gm.meta.get("backend_id", "")))
        function = match.group(1) if match else f"__compiled_fn_unnamed{len(self.graphs)}"
        self._add(function, module, "captured", "Captured_Graph",
                  gm.print_readable(print_output=False, include_stride=True, include_device=True))
        listener = _AotGraphListener()
        trace_log = logging.getLogger("torch.__trace")
        trace_log.addHandler(listener)
        try:
            compiled = self.changed.get(module, self.real)(gm, example_inputs)
        except Exception as error:
            # Dynamo may fall back to running the frame eagerly (suppress_errors): the module then
            # became no compiled function, only its captured graph is kept, for diagnosis.
            self.failures.setdefault(module, []).append(
                f"backend failed on {function}: {type(error).__name__}: {error}".splitlines()[0])
            raise
        else:
            self.functions.setdefault(module, []).append(function)
            self.captured[function] = gm
            return self._listened(module, function, compiled, written_placeholders(gm))
        finally:
            trace_log.removeHandler(listener)
            for artifact, text in listener.graphs:
                kind, label = _AOT_ARTIFACTS[artifact]
                self._add(function, module, kind, label, text)

    def _listened(self, module: str, function: str, compiled: Callable, written) -> Callable:
        """``compiled``, reporting each run to the listener of ``module`` when there is one."""

        def run(*args):
            calls = self._listening.get(module)
            if calls is None:
                return compiled(*args)
            try:
                live = LiveGraphCall(function, args, written)
            except Exception:  # never break training: this call keeps no graph replay
                return compiled(*args)
            out = compiled(*args)
            try:
                live.finish(out)
                calls.append(live)
            except Exception:
                pass
            return out

        if getattr(compiled, "_boxed_call", False):
            run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def _add(self, function: str, module: str, kind: str, label: str, text: str) -> None:
        digest = hashlib.md5(text.encode()).hexdigest()[:8]
        self.graphs.append(Graph(f"{function}.{label}.{digest}", kind, function, module, text))

    def take(self) -> List[Graph]:
        """The graphs captured since the last call (the functions list stays)."""
        graphs, self.graphs = self.graphs, []
        return graphs


def write_graph_files(graphs: List[Graph], folder: str) -> List[str]:
    """Writes graphs as ``<name>.py`` files, as the spec's graph dump names them."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for graph in graphs:
        path = os.path.join(folder, graph.name + ".py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"# {graph.name}: {graph.kind} graph of {graph.module}\n{graph.text}")
        paths.append(path)
    return paths


# Methods and functions whose result shares its input's storage: writing into it writes into the
# input.
_VIEWS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "narrow", "select",
          "unsqueeze", "squeeze", "expand", "expand_as", "t", "flatten", "unflatten", "as_strided",
          "diagonal", "split", "chunk", "unbind", "movedim", "swapaxes", "detach", "__getitem__",
          "getitem", "contiguous", "unfold"}


def written_placeholders(gm: fx.GraphModule) -> frozenset:
    """Positions of the placeholders the graph writes into in place (``copy_``, ``index_copy_``,
    ``x[i] = v``, ``out=``), directly or through a view: a replay needs their values from
    before the call."""
    origin: Dict[fx.Node, int] = {}
    written = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            origin[node] = len(origin)
            continue
        if node.op not in ("call_method", "call_function") or not node.args:
            continue
        first = node.args[0]
        source = origin.get(first) if isinstance(first, fx.Node) else None
        if source is None:
            continue
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        name = str(name).split(".")[0]
        if name in _VIEWS:
            origin[node] = source
        elif (name.endswith("_") and not name.endswith("__")) or \
                node.target is operator.setitem or "out" in node.kwargs:
            written.add(source)
    return frozenset(written)


class LiveGraphCall:
    """One run of a compiled function during a checked call, held by reference until the call's
    replay data is decided: its arguments (copies, taken before, of those the graph writes into),
    their version counters after the run, the RNG state before it, and the gradient each output
    receives in the training backward (hooks)."""

    def __init__(self, function: str, args: tuple, written: frozenset):
        self.function = function
        self.args = list(args)
        self.before = {i: a.detach().clone() for i, a in enumerate(args)
                       if i in written and isinstance(a, torch.Tensor)}
        self.requires_grad = [i for i, a in enumerate(args)
                              if isinstance(a, torch.Tensor) and a.requires_grad]
        versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        self._versions_before = versions
        self.rng = torch.get_rng_state()
        self.cuda_rng = {}
        for a in args:
            if isinstance(a, torch.Tensor) and a.is_cuda:
                index = a.device.index if a.device.index is not None else \
                    torch.cuda.current_device()
                self.cuda_rng.setdefault(index, torch.cuda.get_rng_state(index))
        self.versions: List[Optional[int]] = []
        self.overwritten: List[int] = []  # written by the run without a copy from before
        self.grads: Dict[int, torch.Tensor] = {}
        self.released = False

    def finish(self, out) -> None:
        self.versions = [a._version if isinstance(a, torch.Tensor) else None for a in self.args]
        self.overwritten = [i for i, (b, a) in enumerate(zip(self._versions_before,
                                                            self.versions))
                            if b != a and i not in self.before]
        outputs = out if isinstance(out, (tuple, list)) else [out]
        for position, value in enumerate(outputs):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(functools.partial(self._keep_grad, position))

    def _keep_grad(self, position: int, grad) -> None:
        if grad is not None and not self.released:
            self.grads[position] = grad

    def release(self) -> None:
        """Drops what it holds once its call is decided: the hooks on its outputs may outlive
        the step (a user keeping the outputs), and must not keep the call's tensors alive."""
        self.released = True
        self.args, self.before, self.grads = [], {}, {}

    def changed_since(self) -> List[int]:
        """Positions of arguments (not copied) written in place since the run."""
        return [i for i, a in enumerate(self.args) if i not in self.before and isinstance(
            a, torch.Tensor) and a._version != self.versions[i]]
