"""Compiling wrapped modules: each through an entry code object of its own and the graph
recorder, with the graph breaks of its first compilation counted, and what a step learned about
each target (calls, compiled functions, breaks; NOT_RUN and NOT_COMPILED notes)."""

from __future__ import annotations

import re
import types
from typing import Callable, Dict, List, Tuple

import torch

from dynaprobe._C import vocabulary
from dynaprobe._mechanics.graphs import GraphRecorder
from dynaprobe._steps.step import Step, Target


def own_entry(forward: Callable, name: str) -> Callable:
    """A function calling ``forward``, with a code object of its own, named ``dynaprobe_{name}``.

    Dynamo keeps its compiled code, its recompile limit (8) and its skip decisions per code
    object, and every instance of a class shares that class's ``forward`` code (every torch.nn
    module even shares one). Compiling ``forward`` itself would let the ninth wrapped block of a
    model, or every built-in module after an ``nn.Identity`` whose empty graph gets its code
    skipped, silently run eagerly. One entry code object per wrapped module keeps each module's
    compilation its own.

    What Dynamo learns of the sizes it sees (automatic dynamic shapes: a dimension that changed
    between calls is compiled as a symbol from then on) it keeps by the code's file, line and
    name, for every code object alike: entries of one ``name`` share it (see Compiler.compile).
    """

    def entry(*args, **kwargs):
        return forward(*args, **kwargs)

    label = re.sub(r"\W", "_", name)
    code = entry.__code__.replace(co_name=f"dynaprobe_{label}",
                                  co_qualname=f"dynaprobe_{label}")
    # Dynamo installs the compiled functions into the entry's globals: give it those of the
    # module's own code, where they would go without dynaprobe.
    home = getattr(getattr(forward, "__func__", forward), "__globals__", entry.__globals__)
    return types.FunctionType(code, home, code.co_name, entry.__defaults__, entry.__closure__)


class Compiler:
    """torch.compile for the wrapped modules of one checker, and what it learned of them."""

    def __init__(self, backend):
        self.graphs = GraphRecorder(backend)
        # module -> (graph breaks, their reasons), from the module's first compilation
        self.graph_breaks: Dict[str, Tuple[int, List[str]]] = {}

    def compile(self, name: str, forward: Callable) -> Callable:
        """torch.compile of a wrapped module's forward, through the graph recorder, counting the
        graph breaks Dynamo meets while compiling it."""
        # The entry is named after the forward's own code, as the user's torch.compile(block)
        # is: the wrapped blocks of one class share what Dynamo learns of their sizes, as they do
        # without the checker (a UNet's second ResnetBlock2D, at half the resolution of the
        # first, compiles with symbolic sizes), so each compiles to the program the user trains.
        code = getattr(getattr(forward, "__func__", forward), "__code__", None)
        shared = code.co_qualname if code is not None else type(forward).__qualname__
        compiled = torch.compile(own_entry(forward, shared),
                                 backend=self.graphs.for_module(name))
        counters = torch._dynamo.utils.counters

        # Dynamo counts explicit graph breaks under "graph_break" and what it cannot trace
        # (data-dependent control flow, ...) under "unimplemented"; both name the reason. A break
        # is counted in every frame it splits, so the number of breaks comes from the graphs the
        # first compilation produced: n graphs, n - 1 breaks.
        kinds = ("graph_break", "unimplemented")

        def run(*args, **kwargs):
            first = name not in self.graph_breaks
            before = {kind: dict(counters[kind]) for kind in kinds}
            graphs_before = len(self.graphs.functions.get(name, []))
            try:
                return compiled(*args, **kwargs)
            finally:
                if first:
                    reasons = set()
                    for kind in kinds:
                        for reason, count in counters[kind].items():
                            if count > before[kind].get(reason, 0):
                                # Dynamo's reasons run to several lines (explanation, hint,
                                # link): the first says what broke the graph.
                                reasons.add((reason.strip().splitlines() or ["?"])[0].strip())
                    graphs = len(self.graphs.functions.get(name, [])) - graphs_before
                    self.graph_breaks[name] = (max(graphs - 1, 0), sorted(reasons))

        return run

    def summarize(self, step: Step, targets: List[Target]) -> None:
        """Per-step facts about each compiled module: whether it ran, what Dynamo compiled it
        into, its graph breaks. A module that ran without Dynamo compiling anything for it was
        compared eager against eager: a warning, never a pass."""
        for target in targets:
            functions = self.graphs.functions.get(target.name, [])
            breaks, reasons = self.graph_breaks.get(target.name, (0, []))
            attributes = step.attributes.setdefault(target.name, {})
            attributes.update({
                vocabulary.ATTRIBUTE_CALLS: str(target.calls),
                vocabulary.ATTRIBUTE_COMPILED_FUNCTIONS: ",".join(functions),
                vocabulary.ATTRIBUTE_GRAPH_BREAKS: str(breaks),
            })
            if reasons:
                attributes[vocabulary.ATTRIBUTE_GRAPH_BREAK_REASONS] = "; ".join(reasons)
            failures = self.graphs.failures.get(target.name, [])
            if failures:
                attributes[vocabulary.ATTRIBUTE_COMPILE_ERRORS] = "; ".join(failures)
            if target.calls == 0:
                step.note(target.name, vocabulary.NOTE_NOT_RUN,
                          "the wrapped module was not called in this step")
            elif not functions:
                reason = "Dynamo compiled no graph for it (frame skipped, fallback to eager after " \
                         "an error, or no tensor operations): eager was compared with eager"
                if failures:
                    reason += "; " + "; ".join(failures)
                if reasons:
                    reason += "; Dynamo reported: " + "; ".join(reasons)
                step.note(target.name, vocabulary.NOTE_NOT_COMPILED, reason)
