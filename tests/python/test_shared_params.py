"""Parameters of a wrapped module that the model also uses outside it: DiT's final layer calls
``transformer_blocks[0].norm1.emb`` again for its conditioning, and a weight may be tied to a
layer outside the block. The training backward sums every use into the parameter's gradient; the
eager re-run can only give the uses inside the module. The compiled side of a ``param_grad`` row
is therefore the share the module's calls sent the parameter, taken from the call's own autograd
nodes, so a clean step passes, and a fault in the block is still found at the block.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
from models import compiled_copy

from dynaprobe import _C, PrecisionChecker

pytestmark = pytest.mark.usefixtures("fresh_inductor")
WIDTH = 16


class ConditionedBlock(nn.Module):
    """A residual block modulated by an embedding of its conditioning, as DiT's blocks are."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(WIDTH, WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, condition):
        return x + self.proj(torch.tanh(x)) * self.emb(condition)


class ReusesBlockParameters(nn.Module):
    """Block 0's embedding is called again after the blocks, and the output layer's weight is
    tied to block 1's projection: both get gradient from inside and outside their blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ConditionedBlock(), ConditionedBlock()])
        self.out = nn.Linear(WIDTH, WIDTH)
        self.out.weight = self.blocks[1].proj.weight

    def forward(self, x, condition):
        for block in self.blocks:
            x = block(x, condition)
        return self.out(x * self.blocks[0].emb(condition))


def _data():
    torch.manual_seed(0)
    return ReusesBlockParameters(), torch.randn(4, WIDTH), torch.randn(4, WIDTH)


def _step(model, x, condition, scale: float):
    model.zero_grad(set_to_none=True)
    loss = model(x, condition).square().mean() * scale
    loss.backward()
    return loss


def _param_grad(result, module: str, index: int, side: str) -> torch.Tensor:
    dtype, shape, data = _C.read_record(result.dump_file, module, 0, "param_grad", index, side)
    assert dtype == "float32"
    return torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(shape).copy())


def _checked(model, backend, x, condition, dump_dir, scale: float = 1.0):
    checker = PrecisionChecker(backend=backend, dump_dir=str(dump_dir))
    checker.wrap_by_policy(model, (ConditionedBlock,))
    checker.install(model)
    loss = _step(model, x, condition, scale)
    result = checker.collect(loss)
    checker.uninstall()
    return result, loss


def _share_of_block(model, block: int, x, condition, scale: float) -> dict:
    """Each parameter's gradient from the calls of block ``block`` alone, eagerly: the loss's
    gradient with respect to the block's output, sent back through the block only."""
    blocks = model.blocks
    with torch.no_grad():
        for earlier in blocks[:block]:
            x = earlier(x, condition)
    entry = x.clone()
    out = blocks[block](entry, condition)
    probe = out.detach().requires_grad_(True)
    rest = probe
    for later in blocks[block + 1:]:
        rest = later(rest, condition)
    loss = model.out(rest * blocks[0].emb(condition)).square().mean() * scale
    (grad_output,) = torch.autograd.grad(loss, probe)
    params = list(blocks[block].parameters())
    return dict(zip([n for n, _ in blocks[block].named_parameters()],
                    torch.autograd.grad(out, params, grad_output)))


@pytest.mark.parametrize("scale", [1.0, 1e-3], ids=["loss", "loss_x1e-3"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_parameters_used_outside_their_block_pass_and_are_compared_by_their_share(
        backend, scale, tmp_path):
    model, x, condition = _data()
    unchecked = compiled_copy(model, (ConditionedBlock,), backend)
    expected = [_step(unchecked, x, condition, scale).detach()] + [
        p.grad.clone() for p in unchecked.parameters()]
    torch._dynamo.reset()

    result, loss = _checked(model, backend, x, condition, tmp_path / "dump", scale)

    assert result.all_pass, result.text()
    for block in ("blocks.0", "blocks.1"):
        assert len([r for r in result.rows if r.module == block
                    and r.check_type == "param_grad"]) == 4, result.text()
    # the compiled side is the block's own share, not the sum the training backward made
    for block in (0, 1):
        share = _share_of_block(model, block, x, condition, scale)
        for index, name in enumerate(share):
            compiled = _param_grad(result, f"blocks.{block}", index, "compiled")
            torch.testing.assert_close(compiled, share[name], rtol=1e-5, atol=1e-7 * scale)
    # and training is untouched: the step's parameter gradients sum every use
    got = [loss.detach()] + [p.grad for p in model.parameters()]
    for name, (g, e) in zip(["loss"] + [n for n, _ in model.named_parameters()],
                            zip(got, expected)):
        assert torch.equal(g, e), name


def test_a_fault_in_a_block_whose_parameters_are_used_outside_it_is_found_there(tmp_path):
    """An inductor post-grad pass scales the blocks' tanh by 1.02 inside their kernels: the
    first block is the root cause, with the loss as returned and scaled by 1e-3."""
    def fault(graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target == torch.ops.aten.tanh.default:
                with graph.inserting_after(node):
                    moved = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.02))
                node.replace_all_uses_with(moved, delete_user_cb=lambda user: user is not moved)

    inductor_config.post_grad_custom_post_pass = fault
    for scale in (1.0, 1e-3):
        model, x, condition = _data()
        torch._dynamo.reset()
        result, _ = _checked(model, "inductor", x, condition, tmp_path / f"dump{scale}", scale)
        assert not result.all_pass, result.text()
        assert result.root_cause["forward"]["module"] == "blocks.0", result.text()


def test_shares_add_up_over_the_micro_batches_of_gradient_accumulation(tmp_path):
    """Three micro-batches before one optimizer step: each call's share of the parameters used
    outside their block adds to its module's side, as the training backward adds every use, so
    the step passes with its param_grad rows, and training accumulates as without the checker."""
    model, _, _ = _data()
    batches = [(torch.randn(4, WIDTH), torch.randn(4, WIDTH)) for _ in range(3)]

    def accumulate(m):
        m.zero_grad(set_to_none=True)
        for x, condition in batches:
            loss = m(x, condition).square().mean() / len(batches)
            loss.backward()
        return loss

    unchecked = compiled_copy(model, (ConditionedBlock,), "aot_eager")
    accumulate(unchecked)
    torch._dynamo.reset()
    checker = PrecisionChecker(backend="aot_eager", dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, (ConditionedBlock,))
    checker.install(model)
    result = checker.collect(accumulate(model))
    checker.uninstall()

    assert result.all_pass, result.text()
    for block in ("blocks.0", "blocks.1"):
        assert len([r for r in result.rows if r.module == block
                    and r.check_type == "param_grad"]) == 4, result.text()
    for (name, param), twin in zip(model.named_parameters(), unchecked.parameters()):
        assert torch.equal(param.grad, twin.grad), name
