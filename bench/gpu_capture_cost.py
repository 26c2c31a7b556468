"""Capture cost on a GPU (issues 46 and 56): GPT-2 124M (transformers' GPT2Config default sizes,
random init, no downloads, dropout off) trained in bfloat16 (or --dtype float32) with its blocks
compiled by inductor, side by side in one process (scale_bench.py's configurations, on the device):

  compiled      the GPT2Blocks compiled, no checker
  inherent      compiled, plus an eager forward and backward of every block call on its inputs
  inherent+ref  (bf16) inherent, plus the float32 reference's own arithmetic: a float32 copy of
                every block, its weights refreshed, run forward and backward on the inputs upcast
  full, stats   PrecisionChecker(backend="inductor", dump=...), single-pass, the default reference
                (bf16: float32 for every call; float32: float64 for the calls whose outputs
                or gradients fail, decided when the backward ends from the verdicts of the
                recorder's background thread)

Each configuration trains its own copy of the model, one step each in turn, a round that compiles
and then --steps measured rounds; medians. Per configuration: the step, synchronised with the
device, and for the checked ones its training (forward and backward) and collect() apart, with
the CPU time of the recorder's threads (judging and writing) in each; the step against
inherent+ref, or inherent in float32 (issue 46's targets: 1.15x in full, 1.05x in stats) and
against compiled; the peak
device memory of the step and what it adds to the compiled step's; the dump per step.
--profile: one more `stats` step under torch.profiler, its ops by self device time and by self
CPU time, and the calls in which the host waited for the device (synchronisations, values read
back), so that one run on a GPU says where a checked step's time goes.

Figures, not assertions: written as JSON after each phase (a time limit keeps what was measured)
and printed.

    python bench/gpu_capture_cost.py [--device cuda] [--dtype float32] [--steps 3] [--profile]
        [--json FILE]
    python bench/gpu_capture_cost.py --device cpu --layers 2 --width 128 --seq 64   (a smoke run)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_bench import (  # noqa: E402
    Compiled,
    Config,
    Dynaprobe,
    Inherent,
    InherentWithReference,
    recorder_cpu_seconds,
)

# What issue 46's targets are ratios to: the inherent work of a check, with the reference's
# arithmetic where every call has a reference (bf16).
BASELINES = {torch.bfloat16: "inherent+ref", torch.float32: "inherent"}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peak_mib(device: str):
    return round(torch.cuda.max_memory_allocated() / 2**20, 1) if device.startswith("cuda") else None


def timed_step(config: Config, ids: torch.Tensor, device: str) -> dict:
    """One step of ``config``: seconds of its training (forward and backward, synchronised) and
    of collect() (a checked configuration's), the recorder's CPU seconds in each, the peak
    device memory; then what the step left running (its file's commit) is waited for, untimed."""
    checked = isinstance(config, Dynaprobe)
    peak_reset(device)
    cpu, start = recorder_cpu_seconds(), time.perf_counter()
    loss = Config.step(config, ids) if checked else config.step(ids)
    sync(device)
    trained_cpu, trained = recorder_cpu_seconds(), time.perf_counter()
    if checked:
        config.results.append(config.checker.collect(loss))
        sync(device)
    end = time.perf_counter()
    figures = {"train_s": trained - start, "collect_s": end - trained, "step_s": end - start,
               "train_recorder_cpu_s": trained_cpu - cpu,
               "collect_recorder_cpu_s": recorder_cpu_seconds() - trained_cpu,
               "peak_mib": peak_mib(device)}
    config.settle()
    return figures


def summary(rounds: list, dump_bytes: list) -> dict:
    """Medians of a configuration's measured rounds (the largest peak)."""
    row = {key: round(statistics.median(r[key] for r in rounds), 4)
           for key in ("step_s", "train_s", "collect_s", "train_recorder_cpu_s",
                       "collect_recorder_cpu_s")}
    peaks = [r["peak_mib"] for r in rounds if r["peak_mib"] is not None]
    row["peak_mib"] = max(peaks) if peaks else None
    if dump_bytes:
        row["dump_mib_per_step"] = round(statistics.median(dump_bytes) / 2**20, 2)
    return row


def summarize(figures: dict, rounds: dict, dump_bytes: dict, last_results: dict) -> dict:
    """Each configuration's summary of the rounds measured so far, its ratios to the others,
    and a checked one's last verdict, into ``figures``; returns the summaries."""
    rows = {name: summary(rounds[name], dump_bytes[name]) for name in rounds}
    for name, row in rows.items():
        for against in dict.fromkeys(("compiled", "inherent", figures["baseline"])):
            row[f"x_{against}"] = round(row["step_s"] / rows[against]["step_s"], 3)
        if row["peak_mib"] is not None:
            row["peak_added_mib"] = round(row["peak_mib"] - rows["compiled"]["peak_mib"], 1)
        figures["configs"][name].update(row)
    for name, result in last_results.items():
        figures["configs"][name].update({
            "all_pass": result.all_pass, "rows": len(result.rows),
            "failures": [f"{r.module} {r.check_type}" for r in result.failures][:10]})
    return rows


def print_table(rows: dict, baseline: str) -> None:
    print(f"{'config':>13} {'step ms':>9} {'x ' + baseline:>15} {'x compiled':>11} "
          f"{'train ms':>9} {'collect ms':>11} {'rec CPU s':>10} {'peak +MiB':>10} "
          f"{'dump MiB':>9}")
    for name, row in rows.items():
        added = row.get("peak_added_mib")
        print(f"{name:>13} {1e3 * row['step_s']:9.1f} {row['x_' + baseline]:15.2f} "
              f"{row['x_compiled']:11.2f} {1e3 * row['train_s']:9.1f} "
              f"{1e3 * row['collect_s']:11.1f} "
              f"{row['train_recorder_cpu_s'] + row['collect_recorder_cpu_s']:10.3f} "
              f"{'' if added is None else added:>10} {row.get('dump_mib_per_step', ''):>9}",
              flush=True)


# The profiler's names of the calls in which the host waits for the device.
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "aten::_local_scalar_dense")


def profile_checked_step(config: Dynaprobe, ids: torch.Tensor, device: str, limit: int) -> dict:
    """One more checked step under torch.profiler: the ops with the most self device time (on
    a GPU) and self CPU time, as torch's tables, and the host's waits for the device."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        loss = Config.step(config, ids)
        config.checker.collect(loss)
        sync(device)
    config.settle()
    averages = profiler.key_averages()
    tables = {"by self CPU time": averages.table(sort_by="self_cpu_time_total", row_limit=limit)}
    if cuda:
        tables["by self device time"] = averages.table(sort_by="self_cuda_time_total",
                                                       row_limit=limit)
    waits = [f"{event.key}: {event.count} calls, {event.cpu_time_total / 1e3:.1f} ms"
             for event in averages if event.key in HOST_WAITS]
    tables["the host waiting for the device"] = "\n".join(waits) or "none recorded"
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="what the model trains in (default bfloat16)")
    parser.add_argument("--steps", type=int, default=3, help="measured rounds")
    parser.add_argument("--profile", action="store_true",
                        help="one more stats step under torch.profiler, its top ops printed")
    parser.add_argument("--dump-dir", default=None, help="where the dumps go (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, but is {args.steps}")

    import transformers

    device, backend = args.device, "inductor"
    dump_root = args.dump_dir or tempfile.mkdtemp(prefix="gpu_capture_cost-")
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    baseline = BASELINES[dtype]
    template = transformers.GPT2LMHeadModel(config).to(dtype)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
    figures = {
        "model": f"GPT-2 ({sum(p.numel() for p in template.parameters()) / 1e6:.0f}M parameters, "
                 f"{args.layers} layers, width {args.width}), {args.dtype}, batch {args.batch} x {args.seq}",
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "measured_rounds": args.steps, "baseline": baseline, "configs": {},
    }

    def save():
        text = json.dumps(figures, indent=2)
        if args.json:
            with open(args.json, "w") as file:
                file.write(text + "\n")
        return text

    def model_copy():
        return copy.deepcopy(template).to(device)

    configs = [Compiled("compiled", model_copy(), backend=backend),
               Inherent("inherent", model_copy(), backend=backend)]
    if dtype == torch.bfloat16:
        configs.append(InherentWithReference(baseline, model_copy(), backend=backend))
    configs += [Dynaprobe(dump, model_copy(), os.path.join(dump_root, dump), dump, backend=backend)
                for dump in ("full", "stats")]
    rounds = {c.name: [] for c in configs}
    dump_bytes = {c.name: [] for c in configs}
    last_results = {}  # a checked configuration's last CheckResult
    for config in configs:
        config.setup()
    for round_ in range(1 + args.steps):  # round 0 compiles
        for config in configs:
            start = time.perf_counter()
            measured = timed_step(config, ids, device)
            if isinstance(config, Dynaprobe):
                last_results[config.name] = config.results[-1]
                written = config.dump_bytes()  # the step file's size (the file is removed)
            if round_ == 0:
                figures["configs"][config.name] = {
                    "first_step_s (compiles)": round(time.perf_counter() - start, 2)}
                continue
            rounds[config.name].append(measured)
            if isinstance(config, Dynaprobe):
                dump_bytes[config.name].append(written)
        if round_ > 0:  # the figures so far, kept should a time limit stop the run
            rows = summarize(figures, rounds, dump_bytes, last_results)
            save()
        print(f"round {round_} of {args.steps} done", flush=True)
    print(save(), flush=True)
    print_table(rows, baseline)

    if args.profile:
        stats = next(c for c in configs if c.name == "stats")
        figures["profile"] = profile_checked_step(stats, ids, device, limit=25)
        save()
        for title, table in figures["profile"].items():
            print(f"\nA checked stats step under torch.profiler, {title}:\n{table}",
                  flush=True)
    for config in configs:
        if isinstance(config, Dynaprobe):
            config.checker.uninstall()
    if not args.dump_dir:
        shutil.rmtree(dump_root, ignore_errors=True)


if __name__ == "__main__":
    main()
