"""Capture cost on a GPU (issue 56): GPT-2 124M (transformers' GPT2Config default sizes, random
init, no downloads, dropout off) trained in bfloat16 with its blocks compiled by inductor, without
and with the checker (single-pass, the default float32 reference, dump "full" and "stats").

Figures, not assertions: step time of the unchecked compiled step, of the checked step and of
collect(); the peak GPU memory of each and what the checker adds; the dump's size on disk. Written
as JSON after each phase (a time limit keeps what was measured), and printed.

    python bench/gpu_capture_cost.py [--device cuda] [--steps 3] [--json FILE]
    python bench/gpu_capture_cost.py --device cpu --layers 2 --width 128 --seq 64   (a smoke run)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import tempfile
import time

import torch

from dynaprobe import PrecisionChecker


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peak_mib(device: str):
    return round(torch.cuda.max_memory_allocated() / 2**20, 1) if device.startswith("cuda") else None


def folder_mib(path: str) -> float:
    total = sum(os.path.getsize(os.path.join(root, name))
                for root, _, names in os.walk(path) for name in names)
    return round(total / 2**20, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--dump-dir", default=None, help="where the dumps go (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    device = args.device
    dump_root = args.dump_dir or tempfile.mkdtemp(prefix="gpu_capture_cost-")
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(device, torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
    figures = {
        "model": f"GPT-2 ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
                 f"{args.layers} layers, width {args.width}), bf16, batch {args.batch} x {args.seq}",
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "steps": args.steps,
    }

    def save():
        text = json.dumps(figures, indent=2)
        if args.json:
            with open(args.json, "w") as file:
                file.write(text + "\n")
        return text

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    # The unchecked compiled step: the same blocks compiled in place, on a copy.
    unchecked = copy.deepcopy(model)
    for module in unchecked.modules():
        if isinstance(module, GPT2Block):
            module.compile(backend="inductor")
    start = time.perf_counter()
    step(unchecked)
    sync(device)
    figures["unchecked_first_step_s (compiles)"] = round(time.perf_counter() - start, 2)
    times = []
    peak_reset(device)
    for _ in range(args.steps):
        start = time.perf_counter()
        step(unchecked)
        sync(device)
        times.append(time.perf_counter() - start)
    figures["unchecked_step_ms"] = round(1e3 * min(times), 2)
    figures["unchecked_peak_mib"] = peak_mib(device)
    # Kept, without gradients, so that both peaks include the same resident copies.
    unchecked.zero_grad(set_to_none=True)
    print(save(), flush=True)

    for dump in ("full", "stats"):
        folder = os.path.join(dump_root, dump)
        checker = PrecisionChecker(backend="inductor", dump=dump, dump_dir=folder)
        checker.wrap_by_policy(model, (GPT2Block,))
        checker.install(model)
        start = time.perf_counter()
        result = checker.collect(step(model))
        sync(device)
        figures[f"{dump}_first_step_s (compiles)"] = round(time.perf_counter() - start, 2)
        step_times, collect_times = [], []
        peak_reset(device)
        for _ in range(args.steps):
            start = time.perf_counter()
            loss = step(model)
            sync(device)
            middle = time.perf_counter()
            result = checker.collect(loss)
            collect_times.append(time.perf_counter() - middle)
            step_times.append(middle - start)
        checker.uninstall()
        best = min(range(args.steps), key=lambda i: step_times[i] + collect_times[i])
        figures[f"{dump}_step_ms"] = round(1e3 * step_times[best], 2)
        figures[f"{dump}_collect_ms"] = round(1e3 * collect_times[best], 2)
        figures[f"{dump}_checked_over_unchecked"] = round(
            (step_times[best] + collect_times[best]) * 1e3 / figures["unchecked_step_ms"], 2)
        figures[f"{dump}_peak_mib"] = peak_mib(device)
        if figures[f"{dump}_peak_mib"] is not None:
            figures[f"{dump}_peak_added_mib"] = round(figures[f"{dump}_peak_mib"]
                                                      - figures["unchecked_peak_mib"], 1)
        figures[f"{dump}_dump_mib ({args.steps + 1} steps)"] = folder_mib(folder)
        figures[f"{dump}_all_pass"] = result.all_pass
        figures[f"{dump}_rows"] = len(result.rows)
        figures[f"{dump}_failures"] = [f"{r.module} {r.check_type}" for r in result.failures][:10]
        print(save(), flush=True)
    if not args.dump_dir:
        shutil.rmtree(dump_root, ignore_errors=True)


if __name__ == "__main__":
    main()
