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

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

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


def _real_backend(backend) -> Callable:
    if callable(backend):
        return backend
    if backend == "inductor":  # what torch.compile(backend="inductor") uses
        return torch._TorchCompileInductorWrapper(None, None, None)
    return torch._dynamo.lookup_backend(backend)


class GraphRecorder:
    """A torch.compile backend that compiles with ``backend`` and remembers the graphs."""

    def __init__(self, backend) -> None:
        self.real = _real_backend(backend)
        self.graphs: List[Graph] = []
        self.functions: Dict[str, List[str]] = {}  # module -> compiled functions, cumulative
        self.failures: Dict[str, List[str]] = {}  # module -> backend errors, cumulative

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
            compiled = self.real(gm, example_inputs)
        except Exception as error:
            # Dynamo may fall back to running the frame eagerly (suppress_errors): the module then
            # became no compiled function, only its captured graph is kept, for diagnosis.
            self.failures.setdefault(module, []).append(
                f"backend failed on {function}: {type(error).__name__}: {error}".splitlines()[0])
            raise
        else:
            self.functions.setdefault(module, []).append(function)
            return compiled
        finally:
            trace_log.removeHandler(listener)
            for artifact, text in listener.graphs:
                kind, label = _AOT_ARTIFACTS[artifact]
                self._add(function, module, kind, label, text)

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
