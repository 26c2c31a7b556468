"""Beyond transformers: which diffusers models and vision-style CNNs does dynaprobe fully check?

The sibling of zoo_sweep.py (issue 47). Models, each built at tiny sizes from a config in code
(random init, nothing downloaded), with a tuple of block classes wrapped (written down in MODELS):

- diffusers: UNet2DModel, UNet2DConditionModel, ControlNetModel, AutoencoderKL, VQModel,
  UNet1DModel, Transformer2DModel, DiTTransformer2DModel, PixArtTransformer2DModel,
  SD3Transformer2DModel, FluxTransformer2DModel; a DDPM-style step (mse against the noise, on
  ``.sample.float()``), for the autoencoders reconstruction mse plus the KL term (or the VQ
  commitment loss), for ControlNet the mean square of its residuals;
- hand-built CNNs with the patterns vision code uses: BatchNorm2d in training mode,
  ``nn.ReLU(inplace=True)``, residual ``out += identity``, a channels_last variant, MobileNet-style
  depthwise inverted residuals with ``ReLU6(inplace=True)``, and a variant with every leaf
  module wrapped; cross-entropy on random labels.

Per config (aot_eager fp32, inductor fp32, inductor bf16) it trains one step eagerly, then with
each block's forward compiled (``torch.compile(module.forward, backend=...)`` on a deep copy)
without the checker: a model that fails either is *not checkable* in that column. Then the same
step single-pass with the checker: *checked* when every row passes, every block that ran has
forward and backward rows, and loss, every gradient and every buffer (BatchNorm's running
statistics) are bit-identical to the unchecked compiled step; else *short*, and why. Last, one
two-pass inference under aot_eager, every row expected to pass.

Each model runs in a process of its own, under a memory limit and a time limit. Prints a markdown
table and the totals; --json keeps one line per model.

    .venv/bin/python bench/vision_sweep.py [--only resnet,unet2d]
        [--configs aot_eager:float32,inductor:float32,inductor:bfloat16] [--jobs 1]
        [--timeout 900] [--memory-gb 8] [--json results.jsonl]
    .venv/bin/python bench/vision_sweep.py --coverage results.jsonl   (the latest line of a model
        wins)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_sweep import (  # noqa: E402
    CHECKED,
    NOT_CHECKABLE,
    SHORT,
    compiled_layers,
    coverage,
    layers_run,
    run_worker,
    single_pass_checked,
    table,
    two_pass_checked,
)

CONFIGS = "aot_eager:float32,inductor:float32,inductor:bfloat16"
SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
BATCH = 2


# ---------------------------------------------------------------------------- hand-built CNNs
def _cnn_classes():
    import torch.nn as nn

    class BasicBlock(nn.Module):
        """ResNet's: conv-bn-relu-conv-bn, ``out += identity``, in-place ReLUs."""

        def __init__(self, cin, cout, stride=1):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            out += identity
            return self.relu(out)

    class InvertedResidual(nn.Module):
        """MobileNetV2's: 1x1 expand, 3x3 depthwise (groups=channels), 1x1 project, ReLU6
        in place, a residual when the shape stays."""

        def __init__(self, cin, cout, stride=1, expand=4):
            super().__init__()
            hidden = cin * expand
            self.use_residual = stride == 1 and cin == cout
            self.conv = nn.Sequential(
                nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden),
                nn.ReLU6(inplace=True),
                nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
                nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            return x + self.conv(x) if self.use_residual else self.conv(x)

    class Net(nn.Module):
        def __init__(self, block, widths, classes=10):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                      nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True))
            blocks, cin = [], widths[0]
            for i, cout in enumerate(widths):
                blocks += [block(cin, cout, 1 if i == 0 else 2), block(cout, cout)]
                cin = cout
            self.blocks = nn.Sequential(*blocks)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x):
            return self.fc(self.pool(self.blocks(self.stem(x))).flatten(1))

    return BasicBlock, InvertedResidual, Net


def cnn(block_name: str, leaves: bool = False, channels_last: bool = False):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    BasicBlock, InvertedResidual, Net = _cnn_classes()
    block = {"BasicBlock": BasicBlock, "InvertedResidual": InvertedResidual}[block_name]
    model = Net(block, (16, 32) if block is BasicBlock else (8, 16))
    classes = (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.ReLU6, nn.Linear) if leaves else (block,)
    memory = torch.channels_last if channels_last else torch.contiguous_format

    def batch(dtype):
        return {"x": torch.randn(BATCH, 3, 16, 16).to(dtype).to(memory_format=memory),
                "labels": torch.tensor([3, 7])}

    def loss(m, b):
        return F.cross_entropy(m(b["x"]).float(), b["labels"])

    return model.to(memory_format=memory), classes, batch, loss


# ---------------------------------------------------------------------------- diffusers models
def _ddpm(shape, **conditions):
    """A DDPM-style batch: noisy samples at two timesteps of a linear schedule, the noise to
    predict, and the conditioning tensors of the given shapes (or values)."""
    import torch

    def batch(dtype):
        images, noise = torch.randn(shape), torch.randn(shape)
        timesteps = torch.tensor([10, 500])
        kept = torch.linspace(0.99, 0.01, 1000)[timesteps].view(-1, *[1] * (len(shape) - 1))
        out = {"sample": (kept.sqrt() * images + (1 - kept).sqrt() * noise).to(dtype),
               "timestep": timesteps, "noise": noise}
        for key, value in conditions.items():
            out[key] = torch.randn(value).to(dtype) if isinstance(value, tuple) else value
        return out

    return batch


def _denoise(sample_name="sample"):
    """The DDPM loss: the model called with the batch (``sample`` under ``sample_name``, other
    keys as they are), mse of ``.sample.float()`` against the noise."""
    import torch.nn.functional as F

    def loss(m, b):
        kwargs = {k: v for k, v in b.items() if k not in ("sample", "noise")}
        return F.mse_loss(m(**{sample_name: b["sample"]}, **kwargs).sample.float(), b["noise"])

    return loss


def _unet_blocks():
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import ResnetBlock2D

    return ResnetBlock2D, BasicTransformerBlock


def unet2d():
    import diffusers
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D

    model = diffusers.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, block_out_channels=(32, 64),
        layers_per_block=1, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8)
    return model, (ResnetBlock2D, Attention), _ddpm((BATCH, 3, 16, 16)), _denoise()


_CROSS_ATTENTION_UNET = dict(
    block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
    attention_head_dim=8, norm_num_groups=8, down_block_types=("CrossAttnDownBlock2D",
                                                              "DownBlock2D"))


def unet2d_condition():
    import diffusers

    model = diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4,
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), **_CROSS_ATTENTION_UNET)
    batch = _ddpm((BATCH, 4, 16, 16), encoder_hidden_states=(BATCH, 7, 32))
    return model, _unet_blocks(), batch, _denoise()


def controlnet():
    import diffusers

    model = diffusers.ControlNetModel(in_channels=4, conditioning_embedding_out_channels=(16, 32),
                                      **_CROSS_ATTENTION_UNET)

    def loss(m, b):
        out = m(b["sample"], b["timestep"], encoder_hidden_states=b["encoder_hidden_states"],
                controlnet_cond=b["controlnet_cond"], return_dict=False)
        residuals = list(out[0]) + [out[1]]
        return sum(r.float().pow(2).mean() for r in residuals)

    return model, _unet_blocks(), _ddpm((BATCH, 4, 16, 16), encoder_hidden_states=(BATCH, 7, 32),
                                        controlnet_cond=(BATCH, 3, 32, 32)), loss


def _autoencoder_blocks():
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D

    return ResnetBlock2D, Attention


_AUTOENCODER = dict(in_channels=3, out_channels=3, block_out_channels=(32, 64),
                    down_block_types=("DownEncoderBlock2D",) * 2,
                    up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8, sample_size=16)


def _images(dtype):
    import torch

    return {"x": torch.randn(BATCH, 3, 16, 16).to(dtype)}


def autoencoder_kl():
    import diffusers
    import torch.nn.functional as F

    model = diffusers.AutoencoderKL(latent_channels=4, **_AUTOENCODER)

    def loss(m, b):
        posterior = m.encode(b["x"]).latent_dist
        recon = m.decode(posterior.sample()).sample
        return F.mse_loss(recon.float(), b["x"].float()) + 1e-3 * posterior.kl().float().mean()

    return model, _autoencoder_blocks(), _images, loss


def vq_model():
    import diffusers
    import torch.nn.functional as F

    model = diffusers.VQModel(latent_channels=4, num_vq_embeddings=32, **_AUTOENCODER)

    def loss(m, b):
        out = m(b["x"])
        return F.mse_loss(out.sample.float(), b["x"].float()) + out.commit_loss.float().mean()

    return model, _autoencoder_blocks(), _images, loss


def unet1d():
    import diffusers
    from diffusers.models.unets.unet_1d_blocks import ResConvBlock, SelfAttention1d

    model = diffusers.UNet1DModel(
        sample_size=64, in_channels=2, out_channels=2, block_out_channels=(32, 32, 64),
        down_block_types=("DownBlock1DNoSkip", "DownBlock1D", "AttnDownBlock1D"),
        up_block_types=("AttnUpBlock1D", "UpBlock1D", "UpBlock1DNoSkip"),
        mid_block_type="UNetMidBlock1D", time_embedding_type="fourier", time_embedding_dim=16,
        extra_in_channels=16, flip_sin_to_cos=True, use_timestep_embedding=False)
    return model, (ResConvBlock, SelfAttention1d), _ddpm((BATCH, 2, 64)), _denoise()


def transformer2d():
    import diffusers
    import torch.nn.functional as F
    from diffusers.models.attention import BasicTransformerBlock

    model = diffusers.Transformer2DModel(num_attention_heads=2, attention_head_dim=8,
                                         in_channels=16, num_layers=2, norm_num_groups=8,
                                         cross_attention_dim=16)

    def loss(m, b):
        out = m(b["sample"], encoder_hidden_states=b["encoder_hidden_states"]).sample
        return F.mse_loss(out.float(), b["noise"])

    return model, (BasicTransformerBlock,), _ddpm((BATCH, 16, 8, 8),
                                                  encoder_hidden_states=(BATCH, 7, 16)), loss


def dit():
    import diffusers
    import torch
    from diffusers.models.attention import BasicTransformerBlock

    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=2,
        sample_size=8, patch_size=2, norm_num_groups=4)
    return model, (BasicTransformerBlock,), _ddpm((BATCH, 4, 8, 8),
                                                  class_labels=torch.tensor([1, 5])), \
        _denoise("hidden_states")


def pixart():
    import diffusers
    from diffusers.models.attention import BasicTransformerBlock

    model = diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=2,
        sample_size=8, patch_size=2, cross_attention_dim=16, caption_channels=16,
        norm_num_groups=4)
    conditions = {"resolution": None, "aspect_ratio": None}
    return model, (BasicTransformerBlock,), _ddpm(
        (BATCH, 4, 8, 8), encoder_hidden_states=(BATCH, 7, 16),
        added_cond_kwargs=conditions), _denoise("hidden_states")


def sd3():
    import diffusers
    from diffusers.models.attention import JointTransformerBlock

    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
        caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=16)
    return model, (JointTransformerBlock,), _ddpm(
        (BATCH, 4, 8, 8), encoder_hidden_states=(BATCH, 7, 16), pooled_projections=(BATCH, 16)), \
        _denoise("hidden_states")


def flux():
    import diffusers
    import torch
    import torch.nn.functional as F
    from diffusers.models.transformers.transformer_flux import (
        FluxSingleTransformerBlock,
        FluxTransformerBlock,
    )

    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8))

    def batch(dtype):
        return {"hidden_states": torch.randn(BATCH, 16, 16).to(dtype),
                "encoder_hidden_states": torch.randn(BATCH, 7, 32).to(dtype),
                "pooled_projections": torch.randn(BATCH, 32).to(dtype),
                "timestep": torch.tensor([0.1, 0.7]).to(dtype),
                "img_ids": torch.randn(16, 3), "txt_ids": torch.zeros(7, 3),
                "noise": torch.randn(BATCH, 16, 16)}

    def loss(m, b):
        out = m(**{k: v for k, v in b.items() if k != "noise"}).sample
        return F.mse_loss(out.float(), b["noise"])

    return model, (FluxTransformerBlock, FluxSingleTransformerBlock), batch, loss


# name -> (kind, builder returning (model, block classes, batch(dtype), loss(model, batch)))
MODELS = {
    "resnet": ("cnn", lambda: cnn("BasicBlock")),
    "resnet-channels-last": ("cnn", lambda: cnn("BasicBlock", channels_last=True)),
    "mobilenet": ("cnn", lambda: cnn("InvertedResidual")),
    "resnet-leaves": ("cnn", lambda: cnn("BasicBlock", leaves=True)),
    "mobilenet-channels-last-leaves": ("cnn", lambda: cnn("InvertedResidual", leaves=True,
                                                          channels_last=True)),
    "UNet2DModel": ("diffusers", unet2d),
    "DiTTransformer2DModel": ("diffusers", dit),
    "PixArtTransformer2DModel": ("diffusers", pixart),
    "SD3Transformer2DModel": ("diffusers", sd3),
    "AutoencoderKL": ("diffusers", autoencoder_kl),
    "UNet2DConditionModel": ("diffusers", unet2d_condition),
    "ControlNetModel": ("diffusers", controlnet),
    "FluxTransformer2DModel": ("diffusers", flux),
    "Transformer2DModel": ("diffusers", transformer2d),
    "VQModel": ("diffusers", vq_model),
    "UNet1DModel": ("diffusers", unet1d),
}


# ---------------------------------------------------------------------------- one model
def train_step(model, batch: dict, loss_fn):
    """One step: its loss, every parameter's gradient, every buffer after it."""
    import torch

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = loss_fn(model, batch)
    loss.backward()
    return (loss.detach(),
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()})


def column(backend: str, dtype_name: str) -> str:
    return f"{backend} {SHORT_DTYPE.get(dtype_name, dtype_name)}"


def check_model(name: str, configs: list) -> dict:
    import torch
    import torch._inductor.config

    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 1024  # as zoo_sweep.check_family, and why
    torch._dynamo.config.accumulated_recompile_limit = 4096
    torch._inductor.config.compile_threads = 1
    kind, build = MODELS[name]
    entry = {"kind": kind, "family": name}

    def outcome(status: str, why: str = "", **more) -> dict:
        entry.update(status=status, why=why[:300], **more)
        return entry

    try:
        torch.manual_seed(0)
        model, classes, make_batch, loss_fn = build()
    except Exception as error:
        return outcome(NOT_CHECKABLE, f"does not build at tiny sizes: {type(error).__name__}: "
                       f"{error}")
    entry["layers"] = [c.__name__ for c in classes]
    results, ran = {}, set()
    for backend, dtype_name in configs:
        key = column(backend, dtype_name)
        dtype = getattr(torch, dtype_name)
        base = copy.deepcopy(model).to(dtype).train()
        torch.manual_seed(2)
        batch = make_batch(dtype)
        try:
            ran = layers_run(copy.deepcopy(base), classes, lambda m: train_step(m, batch, loss_fn))
        except Exception as error:
            results[key] = f"{NOT_CHECKABLE}: eager training fails: {type(error).__name__}: " \
                           f"{error}"
            continue
        if not ran:
            return outcome(NOT_CHECKABLE, "its training step runs none of its blocks")
        compiled = compiled_layers(base, ran, backend)
        torch._dynamo.reset()
        try:
            expected = train_step(compiled, batch, loss_fn)
        except Exception as error:
            results[key] = f"{NOT_CHECKABLE}: torch cannot compile its blocks without the " \
                           f"checker: {type(error).__name__}: {error}"
            continue
        results[key] = single_pass_checked(base, ran, backend,
                                           lambda m: train_step(m, batch, loss_fn), expected)
        torch._dynamo.reset()
    if ran:
        results["inference"] = two_pass_inference(model, ran, make_batch, loss_fn)
    shorts = [f"{k}: {v.split(': ', 1)[1]}" for k, v in results.items() if v != CHECKED]
    if results and all(v.startswith(NOT_CHECKABLE) for v in results.values()):
        return outcome(NOT_CHECKABLE, "; ".join(shorts), **results)
    return outcome(SHORT if shorts else CHECKED, "; ".join(shorts), **results)


def two_pass_inference(model, ran: set, make_batch, loss_fn) -> str:
    import torch

    model = copy.deepcopy(model).eval()
    torch.manual_seed(2)
    batch = make_batch(torch.float32)

    def step(m):
        torch.manual_seed(1)
        with torch.no_grad():
            return loss_fn(m, batch)

    return two_pass_checked(model, ran, step)


# ---------------------------------------------------------------------------- the sweep
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="model names, comma-separated (e.g. resnet)")
    parser.add_argument("--configs", default=CONFIGS, help="backend:dtype, comma-separated")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per model")
    parser.add_argument("--memory-gb", type=int, default=8, help="address space per model")
    parser.add_argument("--json", help="also write one JSON line per model here")
    parser.add_argument("--coverage", metavar="JSONL",
                        help="print a coverage section (as zoo_sweep's) from a --json file")
    parser.add_argument("--worker", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    configs = [tuple(c.split(":")) for c in args.configs.split(",") if c]
    if args.worker:
        print(json.dumps(check_model(args.worker, configs)), flush=True)
        return
    if args.coverage:
        with open(args.coverage) as f:
            latest = {e["family"]: e for e in map(json.loads, f)}
        print(coverage(list(latest.values()), library="diffusers", noun="models"))
        return
    only = {o for o in args.only.split(",") if o}
    todo = [name for name in MODELS if not only or name in only]
    entries = []

    def run(name):
        command = [sys.executable, os.path.abspath(__file__), "--worker", name,
                   "--configs", args.configs]
        return run_worker(command, {"kind": MODELS[name][0], "family": name}, args.timeout,
                          args.memory_gb)

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for entry in pool.map(run, todo):
            entries.append(entry)
            print(f"[{len(entries)}/{len(todo)}] {entry['family']}: {entry['status']} "
                  f"{entry.get('why', '')[:120]} ({entry['seconds']} s)", file=sys.stderr,
                  flush=True)
            if args.json:
                with open(args.json, "a") as out:
                    out.write(json.dumps(entry) + "\n")
    columns = [column(b, d) for b, d in configs] + ["inference"]
    print(table(entries, columns, noun="models"))


if __name__ == "__main__":
    main()
