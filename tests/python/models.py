"""Small models and backends shared by the tests."""

import copy

import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.custom_graph_pass import CustomGraphPass


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    """A transformer block that takes the attention mask as a keyword and returns a tuple."""

    def __init__(self, width: int, heads: int = 2):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x, attn_mask=None):
        h = self.norm1(x)
        attended, weights = self.attn(h, h, h, attn_mask=~attn_mask if attn_mask is not None else None)
        x = x + attended
        x = x + self.mlp(self.norm2(x))
        return x, weights


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.head(x.mean(dim=(2, 3)))


class TiedTwice(nn.Module):
    """Calls the same submodule twice per step (weight sharing)."""

    def __init__(self, width: int):
        super().__init__()
        self.shared = nn.Linear(width, width)

    def forward(self, x):
        return self.shared(torch.tanh(self.shared(x)))


def _perturb_gelu(gm: torch.fx.GraphModule, example_inputs):
    """Like aot_eager, but GELU (and its backward) come out 1% larger: a fake compiler bug."""
    targets = (torch.ops.aten.gelu.default, torch.ops.aten.gelu_backward.default)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in targets:
            with gm.graph.inserting_after(node):
                scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.01))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    gm.recompile()
    return make_boxed_func(gm.forward)


perturbed_gelu_backend = aot_autograd(fw_compiler=_perturb_gelu, bw_compiler=_perturb_gelu)


def plain_compiler(gm: torch.fx.GraphModule, example_inputs):
    """aot_eager's compiler: the graph as it is."""
    return make_boxed_func(gm.forward)


# The fault in one direction only.
FORWARD_FAULT = aot_autograd(fw_compiler=_perturb_gelu, bw_compiler=plain_compiler)
BACKWARD_FAULT = aot_autograd(fw_compiler=plain_compiler, bw_compiler=_perturb_gelu)


class Stage(nn.Module):
    def __init__(self, act: nn.Module):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = act

    def forward(self, x):
        return self.act(self.lin(x))


class Chain(nn.Module):
    """stage1 is the only one with a GELU: the only place a GELU fault can be injected; the loss
    is the mean square of stage3's output."""

    def __init__(self):
        super().__init__()
        self.stage0 = Stage(nn.Tanh())
        self.stage1 = Stage(nn.GELU())
        self.stage2 = Stage(nn.Tanh())
        self.stage3 = Stage(nn.Tanh())

    def forward(self, x):
        return self.stage3(self.stage2(self.stage1(self.stage0(x)))).square().mean()


class TinyTransformer(nn.Module):
    """Embedding, causal transformer blocks and an LM head: a small language model."""

    def __init__(self, vocab: int = 50, width: int = 32, heads: int = 4, layers: int = 2,
                 dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril()
        h = self.drop(self.embed(ids))
        for block in self.blocks:
            h, _ = block(h, attn_mask=mask)
        return self.head(h)


def compiled_copy(model: nn.Module, classes: tuple, backend) -> nn.Module:
    """The user's own compiled setup, without the checker, to compare a checked step with: a deep
    copy of ``model`` with the forward of each module of ``classes`` compiled in place, as
    install() compiles them (not ``module.compile()``, which Dynamo skips for torch.nn's own
    modules: it compiles nothing)."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, classes):
            module.forward = torch.compile(module.forward, backend=backend)
    return model


def rsqrt_too_large(graph: torch.fx.Graph, factor: float = 1.05) -> None:
    """An inductor post-grad pass (``post_grad_custom_post_pass``) with a fault: every
    ``aten.rsqrt`` comes out ``factor`` times too large (5%), inside the fused kernel that
    computes it."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.aten.rsqrt.default:
            with graph.inserting_after(node):
                scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, factor))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)


def rsqrt_via_compile_fx(gm: torch.fx.GraphModule, example_inputs):
    """A backend of the user's own that wraps inductor: compile_fx with rsqrt_too_large as its
    post-grad pass, for this backend's graphs alone."""
    from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415

    return compile_fx(gm, example_inputs,
                      config_patches={"post_grad_custom_post_pass": rsqrt_too_large})


def rmsnorm_under_inductor(dump_dir: str):
    """(checker, model, x): an RMSNormMLP, module "0" of a Sequential, wrapped by a checker
    with backend="inductor" writing to ``dump_dir``; Dynamo reset and the seed set."""
    from dynaprobe import PrecisionChecker  # noqa: PLC0415 - the models need no dynaprobe

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(RMSNormMLP())
    x = torch.randn(4, 16, requires_grad=True)
    checker = PrecisionChecker(backend="inductor", dump_dir=dump_dir)
    checker.wrap(model[0])
    return checker, model, x


class RsqrtTooLarge(CustomGraphPass):
    """rsqrt_too_large as a ``CustomGraphPass`` instance, the form inductor's cache can key."""

    def __init__(self, factor: float = 1.05):
        self.factor = factor

    def __call__(self, graph: torch.fx.Graph) -> None:
        rsqrt_too_large(graph, self.factor)

    def uuid(self):
        return f"dynaprobe-tests-rsqrt-too-large-{self.factor}"


RSQRT_PASS = RsqrtTooLarge()
# 1% too large: in bfloat16 within the dtype's tolerances (its step is 0.8% relative), told from
# bfloat16's rounding only against a reference in a wider dtype.
RSQRT_BF16_PASS = RsqrtTooLarge(1.01)


def _rsqrt_too_large_compiler(gm: torch.fx.GraphModule, example_inputs):
    """aot_eager's compiler with rsqrt_too_large applied: the fault in a custom backend."""
    rsqrt_too_large(gm.graph)
    gm.recompile()
    return make_boxed_func(gm.forward)


# A custom backend whose forward computes rsqrt 5% too large (RMSNorm, in every Llama layer).
rsqrt_fault_backend = aot_autograd(fw_compiler=_rsqrt_too_large_compiler,
                                   bw_compiler=plain_compiler)


class RMSNormMLP(nn.Module):
    """RMSNorm (rsqrt) then a linear layer: what rsqrt_too_large breaks."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.proj(norm)


class DropoutBlock(nn.Module):
    """Dropout between two linear layers: under inductor, its masks are inductor's own unless
    fallback_random is set."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 64)
        self.drop = nn.Dropout(0.5)
        self.down = nn.Linear(64, 8)

    def forward(self, x):
        return self.down(self.drop(self.up(x)))
