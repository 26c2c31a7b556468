"""A diffusion model from `diffusers` (pinned in scripts/setup.sh; random init from a config, no
weights downloaded): a tiny UNet2DModel with its ResnetBlock2D and Attention blocks wrapped, one
DDPM training step under inductor, in fp32 and bf16. Its resnet blocks run at two resolutions and
its attention block takes a resnet block's output, what broke the step before; the attention of
the middle and upper blocks is left out, as it adds minutes of compilation and no case.

The checked step passes with forward and backward rows for every block, and it is the step the
user trains without the checker, bit for bit (loss and every gradient). Two mechanisms broke that
before (issue 47): the checker compiled each block apart from the other blocks of its class, so
the resnet blocks at the lower resolution stayed static where the user's compile them with
symbolic sizes; and its views of the blocks' outputs dropped the dimension markings AOTAutograd
leaves on them, so the attention blocks fed by them compiled static too.
"""

from __future__ import annotations

import diffusers
import pytest
import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.resnet import ResnetBlock2D
from models import compiled_copy

from dynaprobe import PrecisionChecker

BLOCKS = (ResnetBlock2D, Attention)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_inductor")]


def _unet(dtype):
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, block_out_channels=(32, 64),
        layers_per_block=1, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=8, add_attention=False)
    return model.to(dtype)


def _ddpm_batch(dtype):
    """Noisy images at two timesteps of a linear schedule, and the noise to predict."""
    images = torch.randn(2, 3, 16, 16)
    noise = torch.randn_like(images)
    timesteps = torch.tensor([10, 500])
    kept = torch.linspace(0.99, 0.01, 1000)[timesteps].view(-1, 1, 1, 1)
    noisy = kept.sqrt() * images + (1 - kept).sqrt() * noise
    return noisy.to(dtype), timesteps, noise


def _step(model, noisy, timesteps, noise):
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(noisy, timesteps).sample.float(), noise)
    loss.backward()
    return loss


def _state(model, loss):
    return [("loss", loss.detach())] + [(n, p.grad) for n, p in model.named_parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_unet_training_step_passes_and_is_the_step_trained_without_the_checker(dtype,
                                                                               tmp_path):
    model, batch = _unet(dtype), _ddpm_batch(dtype)
    unchecked = compiled_copy(model, BLOCKS, "inductor")
    expected = _state(unchecked, _step(unchecked, *batch))
    torch._dynamo.reset()

    checker = PrecisionChecker(backend="inductor", dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, BLOCKS)
    checker.install(model)
    loss = _step(model, *batch)
    result = checker.collect(loss)
    checker.uninstall()

    assert result.all_pass, result.text()
    blocks = [name for name, module in model.named_modules() if isinstance(module, BLOCKS)]
    assert len(blocks) == 9  # resnets at both resolutions, an attention block fed by one
    for name in blocks:
        kinds = {r.check_type for r in result.rows if r.module == name}
        assert {"fwd_output", "grad_input", "param_grad"} <= kinds, (name, kinds)
    for (name, got), (_, want) in zip(_state(model, loss), expected):
        assert torch.equal(got, want), name
