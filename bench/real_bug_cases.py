"""Real torch.compile correctness bugs, reintroduced inside inductor, for dynaprobe's benchmark.

The benchmark in bench/ measures how often dynaprobe names the right module, stage (forward or
backward) and aten op when torch.compile changes a model's numbers. Synthetic perturbations (a
backend that scales one op's output) are easy to find; these cases are harder and closer to what
users meet: each one reintroduces a historical, since fixed, upstream torch.compile / inductor
correctness bug *inside real inductor compilation*. An inductor custom post-grad pass
(``torch._inductor.config.post_grad_custom_post_pass``) edits the aten FX graph after AOTAutograd
and decompositions, so the wrong numbers come out of inductor's own generated kernels, with
inductor's fusion, scheduling and codegen around them. One case uses inductor's own fault switch
``cpp.inject_log1p_bug_TESTING_ONLY`` instead of a pass.

Every model is an ``nn.Sequential`` of three blocks ``"0"``, ``"1"``, ``"2"``; the op a case
corrupts appears only in block ``"1"``, so blocks ``"0"`` and ``"2"`` compile to the same code with
and without the case's config. ``Case.module``, ``Case.op`` and ``Case.direction`` are the ground
truth dynaprobe should report; the two negative controls have ``module=None``. ``Case.op`` names the
first op of the aten graph inductor is given (the graph dynaprobe's op localisation watches) whose
output the bug changes: a floating-point op, or for the max-pool case the integer index computation
the bug misroutes (first written down as the downstream ``scatter_add``; dynaprobe's first run
named the index op, which is where the bug is, and the truth was corrected to it).

Measured on CPU (torch 2.13.0, float32), each block compiled on its own with
``torch.compile(block, backend="inductor")`` under ``torch._inductor.config.patch(case.config)``,
fed the eager model's activations and, for the backward, the eager gradient of
``model(*inputs).square().sum()`` with respect to the block's output; caches off
(``TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0``). "rel" is
``max|compiled - eager| / max|eager|`` over block 1's output (fwd) and over its input and parameter
gradients (bwd, the largest); blocks 0 and 2 stayed within the last column in every case.

============================== ============== ========= ======== ======== ======================
case                           issue          truth     fwd rel  bwd rel  blocks 0, 2 (max rel)
============================== ============== ========= ======== ======== ======================
index_add_alpha                pytorch#108963 forward   6.8e-01  0        9.1e-08
index_put_accumulate_twice     pytorch#138908 forward   1.0e+00  0        8.6e-08
diagonal_scatter_grad_zero     pytorch#182012 backward  0        1.0e+00  1.4e-07
slice_scatter_grad_zero        pytorch#180771 backward  0        1.0e+00  1.2e-07
max_pool_grad_misrouted        pytorch#185509 backward  0        1.0e+00  1.1e-07
upsample_nearest_grad_index    pytorch#100794 backward  0        9.9e-01  1.2e-07
log1p_injected                 inductor flag  forward   2.6e+00  3.9e+00  1.3e-07
norm_reduction_precision       pytorch#142839 forward   7.5e-03  6.2e-03  4.8e-07
shift_by_bit_width             pytorch#143555 forward   7.5e-01  1.6e+00  8.8e-08
argmax_physical_index          pytorch#183082 forward   7.2e-01  1.0e+00  8.8e-08
stale_scalar_after_graph_break pytorch#185382 forward   2.1e-01  2.3e-01  1.4e-07
neutral_doubling               control        none      0        8.4e-08  1.3e-07
reductions_no_bug              control        none      1.1e-07  1.8e-07  1.4e-07
============================== ============== ========= ======== ======== ======================

The stale-scalar case is measured on its second step (activations doubled, as an update changes
them): its first compile is right, as the bug's first iterations were.

The forward cases' bwd column is 0 where block 1's backward does not read the corrupted value
(index_add / index_put: the gradients come from the incoming gradient and the block's inputs), and
non-zero where it does (log1p: the gain's gradient is the wrong log1p; the norm: the saved mean and
rstd; the shift, the arg-max and the scalar feed the output the gradient flows back through).
With each case's config removed, block 1 stays within 1.1e-06 of eager in every case
(the InstanceNorm's 1.0e-06 is plain inductor, without any pass), so every difference above is the
reintroduced bug's.

Not reproduced as first tried, and fixed: the norm case's bfloat16 round trip alone changed
nothing (inductor's codegen folds float32 -> bfloat16 -> float32 away), so its config also sets
``emulate_precision_casts``. Every listed case reproduces; none was left out.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten
prims = torch.ops.prims


@dataclass(frozen=True)
class Case:
    """One benchmark case: a model, its inputs, the config that brings the bug back, the truth."""

    name: str                 # short id, e.g. "index_add_alpha"
    issue: str                # the upstream issue, e.g. "pytorch#108963"
    what: str                 # one line: the bug
    build: Callable[[], nn.Module]   # nn.Sequential of blocks "0", "1", "2"; seeded inside
    inputs: Callable[[], tuple]      # the model's inputs (seeded inside), float32 CPU
    config: Dict[str, Any]           # the inductor config patch that reintroduces the bug
    module: Optional[str]            # the block whose numbers change ("1"); None: negative control
    op: Optional[str]                # the aten op the bug corrupts, "aten.<name>.<overload>"
    direction: Optional[str]         # "forward" or "backward": where the difference first appears
    steps: int = 1                   # checked training steps (SGD between them); the last counts


# --------------------------------------------------------------------------------------------
# Graph editing helpers for the passes.
# --------------------------------------------------------------------------------------------

def _is_backward(graph: fx.Graph) -> bool:
    """AOTAutograd names the backward graph's incoming gradients ``tangents_*``."""
    return any(node.op == "placeholder" and node.name.startswith("tangents")
               for node in graph.nodes)


def _calls(graph: fx.Graph, target) -> list:
    return [node for node in graph.nodes if node.op == "call_function" and node.target == target]


def _insert(graph: fx.Graph, after: fx.Node, target, args: tuple) -> fx.Node:
    """A new call of ``target`` right after ``after``, with its fake value in ``meta["val"]``
    (inductor's lowering reads the dtypes and shapes of the nodes from it)."""
    with graph.inserting_after(after):
        node = graph.call_function(target, args)
    node.meta["val"] = target(*fx.node.map_arg(args, lambda arg: arg.meta["val"]))
    return node


def _replace_output(graph: fx.Graph, node: fx.Node, target, extra_args: tuple = ()) -> fx.Node:
    """Feed every user of ``node`` with ``target(node, *extra_args)`` instead of ``node``."""
    new = _insert(graph, node, target, (node, *extra_args))
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    return new


def _is_zero_fill(node: Any) -> bool:
    """``aten.full(shape, 0)``: what AOTAutograd scatters to clear the overwritten region."""
    return (isinstance(node, fx.Node) and node.target == aten.full.default
            and node.args[1] == 0)


class _Pass(CustomGraphPass):
    """A post-grad pass with a stable uuid, so inductor's caches key on the bug it reintroduces."""

    bug = "override"

    def uuid(self) -> str:
        return f"dynaprobe-real-bug-{self.bug}-v1"


# --------------------------------------------------------------------------------------------
# The passes: one per upstream bug.
# --------------------------------------------------------------------------------------------

class DropIndexAddAlpha(_Pass):
    """pytorch#108963: ``index_add(..., alpha=a)`` computed as if ``alpha`` were 1.

    AOTAutograd decomposes ``index_add`` into ``index_put(x, idx, src * alpha, accumulate=True)``;
    the pass feeds ``index_put`` the unscaled ``src``."""

    bug = "index_add_alpha"

    def __call__(self, graph: fx.Graph) -> None:
        if _is_backward(graph):
            return
        for node in _calls(graph, aten.index_put.default):
            values = node.args[2]
            accumulate = len(node.args) > 3 and node.args[3]
            if (accumulate and isinstance(values, fx.Node) and values.target == aten.mul.Tensor
                    and isinstance(values.args[1], (int, float))):
                node.update_arg(2, values.args[0])


class DoubleIndexPutAccumulate(_Pass):
    """pytorch#138908: ``index_put(..., accumulate=True)`` adds its values twice."""

    bug = "index_put_accumulate_twice"

    def __call__(self, graph: fx.Graph) -> None:
        if _is_backward(graph):
            return
        for node in _calls(graph, aten.index_put.default):
            if len(node.args) > 3 and node.args[3]:
                _, indices, values, _ = node.args
                _replace_output(graph, node, aten.index_put.default, (indices, values, True))


class ZeroScatterBaseGrad(_Pass):
    """pytorch#182012 (``diagonal_scatter``) and pytorch#180771 (``slice_scatter``): the gradient
    with respect to the scatter's base tensor comes out all zeros; the forward is right.

    AOTAutograd writes that gradient as ``<op>_scatter(grad, zeros, ...)`` (the incoming gradient
    with the overwritten region cleared); the pass multiplies its result by 0."""

    def __init__(self, target, bug: str) -> None:
        self.target = target
        self.bug = bug

    def __call__(self, graph: fx.Graph) -> None:
        if not _is_backward(graph):
            return
        for node in _calls(graph, self.target):
            if _is_zero_fill(node.args[1]):
                _replace_output(graph, node, aten.mul.Tensor, (0.0,))


class MisrouteMaxPoolGrad(_Pass):
    """pytorch#185509: max-pool backward sends each gradient to the wrong element of its window;
    the forward (the maxima) is right.

    Inductor saves the argmax of each window as an offset inside the window and turns it into
    flat indices in the backward (``prims._low_memory_max_pool_offsets_to_indices``) for a
    ``scatter_add``; the pass flips the offset's lowest bit, the neighbouring column of the window
    (still inside it for even kernel widths, so no out-of-bounds write)."""

    bug = "max_pool_grad_misrouted"

    def __call__(self, graph: fx.Graph) -> None:
        if not _is_backward(graph):
            return
        for node in _calls(graph, prims._low_memory_max_pool_offsets_to_indices.default):
            offsets = node.args[0]
            node.update_arg(0, _insert(graph, offsets, aten.bitwise_xor.Scalar, (offsets, 1)))


class ShiftUpsampleGradIndex(_Pass):
    """pytorch#100794: nearest upsampling's backward accumulates gradients at the wrong source
    index.

    The backward of nearest upsampling is ``index_put(zeros, [None, None, rows, cols], grad,
    accumulate=True)``; the pass shifts the column index by one (modulo the width, so it stays in
    bounds)."""

    bug = "upsample_nearest_grad_index"

    def __call__(self, graph: fx.Graph) -> None:
        if not _is_backward(graph):
            return
        for node in _calls(graph, aten.index_put.default):
            base, indices = node.args[0], node.args[1]
            if not (len(node.args) > 3 and node.args[3] and indices and indices[0] is None):
                continue
            cols = indices[-1]
            width = base.meta["val"].shape[len(indices) - 1]
            shifted = _insert(graph, cols, aten.add.Tensor, (cols, 1))
            wrapped = _insert(graph, shifted, aten.remainder.Scalar, (shifted, width))
            node.update_arg(1, [*indices[:-1], wrapped])


class LowPrecisionNormReduction(_Pass):
    """pytorch#142839: inductor's CPU Welford reduction for norms (InstanceNorm2d, also LayerNorm
    and GroupNorm) lacked cascade summation and lost precision against eager's kernel.

    Emulated on a small tensor by rounding the input of the norm's ``var_mean`` reduction to
    bfloat16 (and back to float32, so every dtype in the graph stays as AOTAutograd traced it):
    the mean and variance carry a real but small error, as a long naive sum's would. Needs
    ``emulate_precision_casts`` in the config, or inductor's codegen drops the round trip."""

    bug = "norm_reduction_precision"

    def __call__(self, graph: fx.Graph) -> None:
        if _is_backward(graph):
            return
        for node in _calls(graph, aten.var_mean.correction):
            source = node.args[0]
            low = _insert(graph, source, prims.convert_element_type.default,
                          (source, torch.bfloat16))
            back = _insert(graph, low, prims.convert_element_type.default, (low, torch.float32))
            node.update_arg(0, back)


class MaskShiftCount(_Pass):
    """pytorch#143555: inductor's C++ kernel computed ``a >> b`` with C's shift, whose result is
    undefined for ``b`` at least the bit width; on x86 the count is taken modulo 64, so a shift
    by 64 returned ``a`` where eager gives 0 (or -1 for a negative ``a``).

    The pass feeds the shift its count modulo 64, as the x86 instruction did."""

    bug = "shift_by_bit_width"

    def __call__(self, graph: fx.Graph) -> None:
        for node in _calls(graph, aten.bitwise_right_shift.Tensor):
            count = node.args[1]
            node.update_arg(1, _insert(graph, count, aten.bitwise_and.Scalar, (count, 63)))


class PhysicalArgmaxIndex(_Pass):
    """pytorch#183082: inductor's CPU codegen returned the flat arg-max of a transposed tensor as
    an offset in memory order, not in the tensor's logical (row-major) order.

    For ``argmax(permute(base, (1, 0)))`` over the whole tensor the pass takes ``argmax(base)``:
    the position of the same maximum in the memory order of the contiguous ``base``."""

    bug = "argmax_physical_index"

    def __call__(self, graph: fx.Graph) -> None:
        for node in _calls(graph, aten.argmax.default):
            source = node.args[0]
            whole = len(node.args) < 2 or node.args[1] is None
            if whole and isinstance(source, fx.Node) and \
                    source.target == aten.permute.default and list(source.args[1]) == [1, 0]:
                node.update_arg(0, source.args[0])


class StaleScalar(_Pass):
    """pytorch#185382: after an ``.item()`` graph break, a scalar computed from it (Adam's bias
    correction, in the report) reached inductor's kernel of ``addcdiv_``/``addcmul_`` with the
    value of an earlier iteration; ``aot_eager`` was right.

    Dynamo specialises the Python float: each new value recompiles the graph after the break,
    with the value as a constant of ``addcmul``. The pass keeps the first value it compiled and
    puts it into every later compile, so the graph recompiled on the next step carries a stale
    scalar (first compiles in a process stay right, as the bug's first iterations did)."""

    bug = "stale_scalar_after_graph_break"

    def __init__(self) -> None:
        self.first: Dict[tuple, float] = {}

    def __call__(self, graph: fx.Graph) -> None:
        for node in _calls(graph, aten.addcmul.default):
            value = node.kwargs.get("value")
            if isinstance(value, float):
                key = tuple(arg.meta["val"].shape for arg in node.args)
                node.update_kwarg("value", self.first.setdefault(key, value))


class NeutralDoubling(_Pass):
    """Negative control: ``x * 2`` rewritten ``x + x``, exact in floating point."""

    bug = "neutral_doubling"

    def __call__(self, graph: fx.Graph) -> None:
        for node in _calls(graph, aten.mul.Tensor):
            if node.args[1] == 2 and isinstance(node.args[0], fx.Node):
                operand = node.args[0]
                with graph.inserting_after(node):
                    doubled = graph.call_function(aten.add.Tensor, (operand, operand))
                doubled.meta.update(node.meta)
                node.replace_all_uses_with(doubled)
                graph.erase_node(node)


# Module-level instances: the config must name the same object on every compile.
DROP_INDEX_ADD_ALPHA = DropIndexAddAlpha()
DOUBLE_INDEX_PUT_ACCUMULATE = DoubleIndexPutAccumulate()
ZERO_DIAGONAL_SCATTER_GRAD = ZeroScatterBaseGrad(aten.diagonal_scatter.default,
                                                 "diagonal_scatter_grad_zero")
ZERO_SLICE_SCATTER_GRAD = ZeroScatterBaseGrad(aten.slice_scatter.default,
                                              "slice_scatter_grad_zero")
MISROUTE_MAX_POOL_GRAD = MisrouteMaxPoolGrad()
SHIFT_UPSAMPLE_GRAD_INDEX = ShiftUpsampleGradIndex()
LOW_PRECISION_NORM_REDUCTION = LowPrecisionNormReduction()
MASK_SHIFT_COUNT = MaskShiftCount()
PHYSICAL_ARGMAX_INDEX = PhysicalArgmaxIndex()
STALE_SCALAR = StaleScalar()
NEUTRAL_DOUBLING = NeutralDoubling()


def _post_pass(custom_pass: CustomGraphPass) -> Dict[str, Any]:
    return {"post_grad_custom_post_pass": custom_pass}


# --------------------------------------------------------------------------------------------
# The blocks "1": each holds the op its case corrupts, and nothing else uses it.
# --------------------------------------------------------------------------------------------

WIDTH = 16


class IndexAddBlock(nn.Module):
    """Adds learned rows (scaled by the input's first rows) into rows 1, 3, 3, 6, with alpha."""

    def __init__(self) -> None:
        super().__init__()
        self.source = nn.Parameter(torch.randn(4, WIDTH))
        self.register_buffer("index", torch.tensor([1, 3, 3, 6]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_add(0, self.index, self.source * x[:4], alpha=2.5)


class IndexPutBlock(nn.Module):
    """Accumulates learned rows (scaled by the input's first rows) into rows 1, 3, 3, 6."""

    def __init__(self) -> None:
        super().__init__()
        self.source = nn.Parameter(torch.randn(4, WIDTH))
        self.register_buffer("index", torch.tensor([1, 3, 3, 6]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.index_put(x, (self.index,), self.source * x[:4], accumulate=True)


class DiagonalScatterBlock(nn.Module):
    """Overwrites the main diagonal of ``1.5 * x`` with a learned, input-scaled vector."""

    def __init__(self) -> None:
        super().__init__()
        self.diagonal = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.diagonal_scatter(x * 1.5, self.diagonal * x[:, 0])


class SliceScatterBlock(nn.Module):
    """Overwrites columns 4:8 of ``1.5 * x`` with learned, input-scaled values."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Parameter(torch.randn(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.slice_scatter(x * 1.5, self.patch * x[:, 4:8], dim=1, start=4, end=8)


class Log1pBlock(nn.Module):
    """``log1p(x^2)`` with a learned gain."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(x.square()) * self.gain


class ShiftedInstanceNorm(nn.Module):
    """InstanceNorm2d of a feature map carrying a large constant offset: the offset is what makes
    a sum lose the low bits of the values it adds."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.InstanceNorm2d(channels, affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + 8.0)


class FixedPointBlock(nn.Module):
    """A fixed-point detail branch: ``x`` in 1/4096 steps, shifted right by a per-feature count
    (64 drops a feature's branch, as shifting every bit out does in eager), added back with a
    learned gain."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(WIDTH))
        self.register_buffer("shifts", torch.tensor([0, 2, 64, 5] * (WIDTH // 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fixed = (x * 4096).round().to(torch.int64)
        coarse = torch.bitwise_right_shift(fixed, self.shifts).to(x.dtype) / 4096
        return x + coarse * self.gain


class ArgmaxPickBlock(nn.Module):
    """Hard attention to one entry: the largest score of the transposed score matrix
    ``(x W)^T``, found by a flat arg-max, scales the input."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, 8) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (x @ self.weight).t()
        return x * scores.flatten()[scores.argmax()]


class ItemScaledBlock(nn.Module):
    """A step normalised by the input's largest magnitude, read with ``.item()`` (a graph break),
    as an optimizer's bias correction is: ``x - 0.5 / max|x| * x * tanh(g x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax().item()
        return x.addcmul(x, torch.tanh(x * self.gain), value=-0.5 / scale)


class DoublingBlock(nn.Module):
    """``2 x`` times a learned gain (the neutral pass rewrites the doubling)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2) * self.gain


class ReductionBlock(nn.Module):
    """Layer norm, softmax and a row sum: reductions whose order inductor may change."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return F.softmax(y, dim=-1) * y.sum(dim=-1, keepdim=True) + y


# --------------------------------------------------------------------------------------------
# Models and inputs.
# --------------------------------------------------------------------------------------------

def _vector_model(middle: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """Linear+Tanh, the block under test, Linear+Tanh, on (8, 16) inputs."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
            middle(),
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
        )

    return build


def _vector_inputs() -> tuple:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(8, WIDTH, generator=generator),)


def _image_model(middle: Callable[[], nn.Module], flat: int) -> Callable[[], nn.Module]:
    """Conv+Tanh, the block under test, Flatten+Linear+Tanh, on (2, 3, 8, 8) or (2, 3, 4, 4)
    images; ``flat`` is the block's output size per sample."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh()),
            middle(),
            nn.Sequential(nn.Flatten(), nn.Linear(flat, 8), nn.Tanh()),
        )

    return build


def _image_inputs(size: int) -> Callable[[], tuple]:
    def inputs() -> tuple:
        generator = torch.Generator().manual_seed(1)
        return (torch.randn(2, 3, size, size, generator=generator),)

    return inputs


CASES = [
    Case(
        name="index_add_alpha",
        issue="pytorch#108963",
        what="index_add ignores alpha (adds the source as if alpha were 1)",
        build=_vector_model(IndexAddBlock),
        inputs=_vector_inputs,
        config=_post_pass(DROP_INDEX_ADD_ALPHA),
        module="1",
        op="aten.index_put.default",   # index_add is decomposed to index_put(accumulate=True)
        direction="forward",
    ),
    Case(
        name="index_put_accumulate_twice",
        issue="pytorch#138908",
        what="index_put with accumulate=True adds its values twice",
        build=_vector_model(IndexPutBlock),
        inputs=_vector_inputs,
        config=_post_pass(DOUBLE_INDEX_PUT_ACCUMULATE),
        module="1",
        op="aten.index_put.default",
        direction="forward",
    ),
    Case(
        name="diagonal_scatter_grad_zero",
        issue="pytorch#182012",
        what="diagonal_scatter backward gives an all-zero gradient for the base tensor",
        build=_vector_model(DiagonalScatterBlock),
        inputs=_vector_inputs,
        config=_post_pass(ZERO_DIAGONAL_SCATTER_GRAD),
        module="1",
        op="aten.diagonal_scatter.default",
        direction="backward",
    ),
    Case(
        name="slice_scatter_grad_zero",
        issue="pytorch#180771",
        what="slice_scatter backward zeroes the gradient of the base tensor",
        build=_vector_model(SliceScatterBlock),
        inputs=_vector_inputs,
        config=_post_pass(ZERO_SLICE_SCATTER_GRAD),
        module="1",
        op="aten.slice_scatter.default",
        direction="backward",
    ),
    Case(
        name="max_pool_grad_misrouted",
        issue="pytorch#185509",
        what="max_pool2d backward routes each gradient to the wrong element of its window",
        build=_image_model(lambda: nn.MaxPool2d(2), flat=4 * 4 * 4),
        inputs=_image_inputs(8),
        config=_post_pass(MISROUTE_MAX_POOL_GRAD),
        module="1",
        # the index computation the bug misroutes: the first op whose output changes (an
        # integer one; the scatter_add that then writes the gradient is downstream of it)
        op="prims._low_memory_max_pool_offsets_to_indices.default",
        direction="backward",
    ),
    Case(
        name="upsample_nearest_grad_index",
        issue="pytorch#100794",
        what="nearest upsampling backward accumulates gradients at the wrong source index",
        build=_image_model(lambda: nn.Upsample(scale_factor=2, mode="nearest"),
                           flat=4 * 8 * 8),
        inputs=_image_inputs(4),
        config=_post_pass(SHIFT_UPSAMPLE_GRAD_INDEX),
        module="1",
        op="aten.index_put.default",     # the backward of _unsafe_index
        direction="backward",
    ),
    Case(
        name="log1p_injected",
        issue="inductor cpp.inject_log1p_bug_TESTING_ONLY",
        what="inductor's C++ codegen emits x + 1 for log1p(x) (its own accuracy fault switch)",
        build=_vector_model(Log1pBlock),
        inputs=_vector_inputs,
        config={"cpp.inject_log1p_bug_TESTING_ONLY": "accuracy"},
        module="1",
        op="aten.log1p.default",
        direction="forward",
    ),
    Case(
        name="norm_reduction_precision",
        issue="pytorch#142839",
        what="InstanceNorm2d's mean/variance reduction loses precision (emulated: bfloat16 input)",
        build=_image_model(lambda: ShiftedInstanceNorm(4), flat=4 * 8 * 8),
        inputs=_image_inputs(8),
        # emulate_precision_casts keeps the pass's float32 -> bfloat16 -> float32 round trip,
        # which inductor otherwise folds away (measured: no difference at all without it); the
        # other blocks are float32 throughout, so it changes nothing else.
        config={**_post_pass(LOW_PRECISION_NORM_REDUCTION), "emulate_precision_casts": True},
        module="1",
        op="aten.var_mean.correction",
        direction="forward",
    ),
    Case(
        name="shift_by_bit_width",
        issue="pytorch#143555",
        what="a right shift by 64 or more returns its input (the count taken modulo 64)",
        build=_vector_model(FixedPointBlock),
        inputs=_vector_inputs,
        config=_post_pass(MASK_SHIFT_COUNT),
        module="1",
        op="aten.bitwise_right_shift.Tensor",
        direction="forward",
    ),
    Case(
        name="argmax_physical_index",
        issue="pytorch#183082",
        what="the flat arg-max of a transposed tensor is an offset in memory order",
        build=_vector_model(ArgmaxPickBlock),
        inputs=_vector_inputs,
        config=_post_pass(PHYSICAL_ARGMAX_INDEX),
        module="1",
        op="aten.argmax.default",
        direction="forward",
    ),
    Case(
        name="stale_scalar_after_graph_break",
        issue="pytorch#185382",
        what="after an .item() graph break, addcmul's scalar keeps an earlier step's value",
        build=_vector_model(ItemScaledBlock),
        inputs=_vector_inputs,
        # inductor's caches off: the pass must see every compile (a cached stale graph keyed on
        # the right value would otherwise come back in a later process, and a right one too)
        config={**_post_pass(STALE_SCALAR), "fx_graph_cache": False},
        module="1",
        op="aten.addcmul.default",
        direction="forward",
        steps=2,   # the first step compiles right; the step after an update recompiles, stale
    ),
    Case(
        name="neutral_doubling",
        issue="negative control",
        what="a pass rewrites x * 2 as x + x: exact, so compiled matches eager",
        build=_vector_model(DoublingBlock),
        inputs=_vector_inputs,
        config=_post_pass(NEUTRAL_DOUBLING),
        module=None,
        op=None,
        direction=None,
    ),
    Case(
        name="reductions_no_bug",
        issue="negative control",
        what="no pass: layer norm, softmax, sums; inductor differs from eager by rounding only",
        build=_vector_model(ReductionBlock),
        inputs=_vector_inputs,
        config={},
        module=None,
        op=None,
        direction=None,
    ),
]
