"""Single-pass: each checked call's share of its parameters' gradients, the compiled twin of
what the eager re-run's backward gives them (a parameter may be used outside the call too)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from dynaprobe._C.vocabulary import SIDE_COMPILED
from dynaprobe._steps.step import Step


class CallShares:
    """Single-pass: the share of each parameter's gradient that one compiled call sends it, the
    twin of what the eager re-run's backward gives it. A parameter the model also uses outside
    the call (DiT's final layer reuses ``transformer_blocks[0].norm1.emb``; tied weights) gets
    more from the training backward than from the call.

    Created just before the call and ``close``-d just after it: the autograd nodes the call
    created are the ones numbered in between (autograd numbers nodes in creation order, per
    thread). ``attach`` walks them from the call's results: each edge into a parameter's
    AccumulateGrad gets a post-hook that adds the gradient along it. A parameter also fed by a
    node created before the call (autocast's cached cast of a weight, an earlier call of a
    module that shares it) cannot be split this way: its compiled side stays the training
    backward's sum (``Step.by_call``)."""

    def __init__(self) -> None:
        self.start = torch.autograd._get_sequence_nr()
        self.end = self.start

    def close(self) -> None:
        self.end = torch.autograd._get_sequence_nr()

    def attach(self, step: Step, results: List[torch.Tensor], params: List[torch.Tensor]) -> None:
        """Hooks the call's nodes that feed ``params``, walking back from ``results`` (what the
        call returned and left in its arguments)."""
        start, end = self.start, self.end
        watched = {id(p) for p in params}
        found: Dict[int, List[Tuple[int, torch.Tensor]]] = {}  # id(node) -> (edge, parameter)
        nodes: Dict[int, object] = {}
        split = {key: True for key in watched}
        pending = [t.grad_fn for t in results if t.grad_fn is not None]
        while pending:
            node = pending.pop()
            if id(node) in nodes or not start <= node._sequence_nr() < end:
                continue
            nodes[id(node)] = node
            for edge, (child, _) in enumerate(node.next_functions):
                if child is None:
                    continue
                param = getattr(child, "variable", None)  # AccumulateGrad's leaf
                if param is not None:
                    if id(param) in watched:
                        found.setdefault(id(node), []).append((edge, param))
                elif start <= child._sequence_nr() < end:
                    pending.append(child)
                else:  # made before the call: does it feed a parameter of the call?
                    for grandchild, _ in child.next_functions:
                        if id(getattr(grandchild, "variable", None)) in watched:
                            split[id(grandchild.variable)] = False
        for key, ok in split.items():
            step.by_call[key] = step.by_call.get(key, True) and ok
        for key, edges in found.items():
            nodes[key].register_hook(_share_hook(step, edges))


def _share_hook(step: Step, edges: List[Tuple[int, torch.Tensor]]):
    def hook(grad_inputs, _grad_outputs) -> None:
        for edge, param in edges:
            grad = grad_inputs[edge]
            if grad is not None and step.by_call.get(id(param), False):
                step.add_param_grad(SIDE_COMPILED, param, grad)

    return hook
