"""Scale benchmark: step time, dump volume and host memory of a checked training step on
GPT-2-style models from `transformers`, at several sizes, side by side in one run.

For each size (layers x hidden, vocabulary 50257, batch x sequence tokens), every configuration
below trains its own copy of the model, two steps at a time in turn (so that drift and neighbours
hit all alike), the second of each two measured: it runs while the first's step file is written,
as in a run, and that write is over before the next configuration's turn. The first --warmup
rounds (compilation, then the allocators' and the page tables' first growth) are not measured,
and the median of the next --steps is reported:
  compiled    the GPT2Blocks compiled with aot_eager, no checker
  inherent    compiled, plus what any single-pass checker must do: an eager forward and backward
              of every block call on its own inputs
  inherent+ref  (--dtype bfloat16) inherent, plus the reference's own arithmetic: a float32 copy
              of every block, its weights refreshed, run forward and backward on the call's
              inputs upcast, what the default reference="auto" adds in bf16; "x inherent+ref"
              compares against it
  full        dynaprobe's PrecisionChecker, single-pass, dump="full"
  failing     dump="failing"
  stats       dump="stats"
  with --replay failing,none: each dump mode once per replay setting, named e.g. full:none
  with --references auto,None: each once per reference setting, named e.g. full:ref=None
              (with --dtype bfloat16 the default "auto" runs a float32 reference of every call)
  msprobe     msProbe's PrecisionChecker (mindstudio-probe), when it can be imported (optional),
              in a process of its own right after the others: in the same process its hooks
              slow every model about tenfold
Per configuration: seconds per step, ratio to inherent, bytes of dump per step, host memory
growth during a step (peak RSS over the step minus RSS before it; Linux clear_refs), and the CPU
time the hypervisor took from this machine's CPUs during the step (the "steal" of /proc/stat,
summed over CPUs; 0 on bare metal). On a virtual machine whose disk is emulated by the host,
writing to the disk while training keeps every CPU busy shows up there, not as our CPU time.

    .venv/bin/python bench/scale_bench.py [--sizes 2x256,6x512,12x768] [--steps 3] [--warmup 2]
        [--dumps full,failing,stats] [--replay failing,none] [--threads N] [--no-msprobe]
        [--dtype bfloat16] [--references auto,None]
        [--json results.json] [--plot plot.svg]

msProbe: `pip install --no-deps --target DIR mindstudio-probe` plus the packages its import
needs (docs/performance.md lists them), then run with PYTHONPATH=DIR; never let it change torch.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
from torch.utils._pytree import tree_map

from dynaprobe import PrecisionChecker

warnings.filterwarnings("ignore")


def gpt2(layers: int, hidden: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64),
                        vocab_size=50257, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, use_cache=False)  # training: no KV cache
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def block_type():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return GPT2Block


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def stolen_seconds() -> float:
    """CPU time the hypervisor has taken from this machine's CPUs so far, summed over CPUs."""
    with open("/proc/stat") as f:
        fields = f.readline().split()  # cpu user nice system idle iowait irq softirq steal ...
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def recorder_cpu_seconds() -> float:
    """CPU time so far of this process's threads named dynaprobe-rec (the recorder's background
    thread and the TBB workers it started, which inherit the name)."""
    total = 0
    for thread in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{thread}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        if stat[stat.index("(") + 1:stat.rindex(")")].startswith("dynaprobe-rec"):
            fields = stat[stat.rindex(")") + 2:].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Config:
    """One configuration: a model copy and how a step runs on it."""

    def __init__(self, name, model, dump_dir=None, backend="aot_eager"):
        self.name = name
        self.model = model
        self.dump_dir = dump_dir
        self.backend = backend  # what the blocks are compiled with
        self.times, self.growth, self.bytes, self.stolen = [], [], [], []

    def setup(self):
        pass

    def step(self, ids):
        self.model.zero_grad(set_to_none=True)
        loss = self.model(ids, labels=ids).loss
        loss.backward()
        return loss

    def settle(self):
        """Waits for the work the last step left running (a step file still being written), so
        that it does not slow the next configuration's step."""

    def dump_bytes(self):
        """Bytes the last step added to the dump."""
        return 0


class Compiled(Config):
    def setup(self):
        for module in self.model.modules():
            if isinstance(module, block_type()):
                module.forward = torch.compile(module.forward, backend=self.backend)


class Inherent(Compiled):
    """Compiled blocks, then an eager forward and backward of every block call on its inputs."""

    def setup(self):
        self.calls = []
        for module in self.model.modules():
            if isinstance(module, block_type()):
                original = module.forward
                compiled = torch.compile(original, backend=self.backend)

                def forward(*args, _compiled=compiled, _original=original, **kwargs):
                    out = _compiled(*args, **kwargs)
                    detached = tree_map(
                        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, (args, kwargs))
                    detached[0][0].requires_grad_()
                    self.calls.append((_original,) + detached)
                    return out

                module.forward = forward

    def step(self, ids):
        loss = super().step(ids)
        for original, args, kwargs in self.calls:
            self.rerun(original, args, kwargs)
        self.calls.clear()
        return loss

    def rerun(self, original, args, kwargs):
        backward_of(original(*args, **kwargs))


def backward_of(out):
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))


class InherentWithReference(Inherent):
    """Inherent, plus a float32 copy of every block, its weights refreshed from the block's
    (into memory it keeps), run forward and backward on the call's inputs upcast: the arithmetic
    the reference adds, without the checker."""

    def setup(self):
        self.float_copies, self.weights = {}, {}
        for module in self.model.modules():
            if isinstance(module, block_type()):
                reference = self.float_copies[id(module)] = copy.deepcopy(module).float()
                self.weights[id(module)] = list(zip(reference.state_dict().values(),
                                                    module.state_dict().values()))
        super().setup()

    def rerun(self, original, args, kwargs):
        super().rerun(original, args, kwargs)
        upcast = tree_map(lambda x: x.float() if isinstance(x, torch.Tensor)
                          and x.is_floating_point() else x, (args, kwargs))
        upcast[0][0].requires_grad_()
        reference = self.float_copies[id(original.__self__)]
        with torch.no_grad():
            for kept, weight in self.weights[id(original.__self__)]:
                kept.copy_(weight)
        reference.zero_grad(set_to_none=True)
        backward_of(reference(*upcast[0], **upcast[1]))


class Dynaprobe(Config):
    def __init__(self, name, model, dump_dir, dump, replay=None, reference="auto",
                 backend="aot_eager"):
        super().__init__(name, model, dump_dir, backend)
        self.results = []
        self.checker = PrecisionChecker(backend=backend, dump=dump, dump_dir=dump_dir,
                                        replay=replay, reference=reference)
        self.checker.wrap_by_policy(model, (block_type(),))

    def setup(self):
        self.checker.install(self.model)

    def step(self, ids):
        loss = super().step(ids)
        self.results.append(self.checker.collect(loss))
        return loss

    def settle(self):
        self.checker.wait_committed()

    def dump_bytes(self):
        sizes = []
        for result in self.results:
            sizes.append(os.path.getsize(result.dump_file))
            os.remove(result.dump_file)  # keep the disk free; the size is what counts
        self.results.clear()
        return sizes[-1]


class MsProbe(Config):
    def __init__(self, name, model, dump_dir):
        super().__init__(name, model, dump_dir)
        from msprobe.pytorch.compile_accuracy_checker.precision_checker import (
            PrecisionChecker as MsChecker,
        )

        self.checker = MsChecker()
        self.checker.wrap_by_policy(model, (block_type(),))

    def setup(self):
        self.checker.install(self.model)

    def step(self, ids):
        loss = super().step(ids)
        self.checker.collect(loss)
        return loss


def msprobe_available() -> bool:
    try:
        import msprobe.pytorch.compile_accuracy_checker.precision_checker  # noqa: F401
        return True
    except Exception:
        return False


def measure(layers, hidden, batch, seq, steps, warmup, workdir, with_msprobe,
            dumps=("full", "failing", "stats"), replays=(None,), dtype=torch.float32,
            references=("auto",)):
    template = gpt2(layers, hidden)
    params = sum(p.numel() for p in template.parameters())
    state = template.state_dict()

    def copy_model():
        model = gpt2(layers, hidden)
        model.load_state_dict(state)
        return model.to(dtype)

    if with_msprobe == "worker":  # this process runs msProbe alone
        configs = [MsProbe("msprobe", copy_model(), workdir)]
    else:
        configs = [Compiled("compiled", copy_model()), Inherent("inherent", copy_model())]
        if dtype != torch.float32:
            configs.append(InherentWithReference("inherent+ref", copy_model()))
        for dump in dumps:
            for replay in replays:
                for reference in references:
                    name = dump if replay is None else f"{dump}:{replay}"
                    name += "" if reference == "auto" else f":ref={reference}"
                    configs.append(Dynaprobe(name, copy_model(), os.path.join(
                        workdir, f"{layers}x{hidden}-{name}"), dump, replay,
                        None if reference == "None" else reference))
    run_steps(configs, batch, seq, steps, warmup)
    if with_msprobe is True:
        configs.append(msprobe_in_its_own_process(layers, hidden, batch, seq, steps, warmup))
    if with_msprobe == "worker":
        return configs[0]
    inherent = statistics.median(next(c for c in configs if c.name == "inherent").times)
    with_reference = next((statistics.median(c.times) for c in configs
                           if c.name == "inherent+ref"), None)
    rows = []
    for config in configs:
        seconds = statistics.median(config.times)
        rows.append({
            "layers": layers, "hidden": hidden, "params": params, "config": config.name,
            "seconds": seconds, "vs_inherent": seconds / inherent,
            "vs_inherent_ref": seconds / with_reference if with_reference else None,
            "dump_bytes": statistics.median(config.bytes),
            "rss_growth_bytes": max(config.growth),
            "stolen_seconds": statistics.median(config.stolen),
            "step_seconds": config.times,  # per measured round, in order: for paired ratios
        })
    return rows


def run_steps(configs, batch, seq, steps, warmup):
    """Every configuration two steps in turn, `warmup` + `steps` times (the rounds of the first
    `warmup` are not measured). Of the two, the second is measured: it runs while the first's
    step file is written, as every step of a run does (PrecisionChecker.collect() returns
    before the disk is done); then that is waited for, untimed, so that no configuration's
    writes slow another's step."""
    for config in configs:
        config.setup()
    ids = torch.randint(0, 50257, (batch, seq), generator=torch.Generator().manual_seed(1))
    for round_ in range(warmup + steps):  # round 0 compiles
        for config in configs:
            config.step(ids)
            before = rss_bytes("VmRSS")
            reset_peak_rss()
            stolen_before = stolen_seconds()
            start = time.perf_counter()
            config.step(ids)
            elapsed = time.perf_counter() - start
            stolen = stolen_seconds() - stolen_before
            growth = rss_bytes("VmHWM") - before
            config.settle()
            written = config.dump_bytes()
            if round_ >= warmup:
                config.times.append(elapsed)
                config.growth.append(growth)
                config.bytes.append(written)
                config.stolen.append(stolen)


def msprobe_in_its_own_process(layers, hidden, batch, seq, steps, warmup):
    """msProbe's measurements, from `scale_bench.py --msprobe-worker` in a fresh process."""
    out = subprocess.run(
        [sys.executable, __file__, "--msprobe-worker", f"{layers}x{hidden}", "--batch", str(batch),
         "--seq", str(seq), "--steps", str(steps), "--warmup", str(warmup),
         "--threads", str(torch.get_num_threads())],
        capture_output=True, text=True, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    config = Config("msprobe", None)
    config.times, config.growth, config.bytes, config.stolen = (
        measured["times"], measured["growth"], measured["bytes"], measured["stolen"])
    return config


def print_table(rows):
    print(f"{'size':>9} {'params':>7} {'config':>13} {'s/step':>7} {'x inherent':>10} "
          f"{'x inh+ref':>9} {'dump/step':>10} {'RSS growth':>10} {'stolen s':>8}")
    for r in rows:
        with_reference = (f"{r['vs_inherent_ref']:9.2f}" if r.get("vs_inherent_ref")
                          else f"{'':9}")
        print(f"{r['layers']:>3}x{r['hidden']:<5} {r['params'] / 1e6:6.1f}M {r['config']:>13} "
              f"{r['seconds']:7.2f} {r['vs_inherent']:10.2f} {with_reference} "
              f"{r['dump_bytes'] / 1e6:8.2f}MB "
              f"{r['rss_growth_bytes'] / 1e6:8.0f}MB {r['stolen_seconds']:8.2f}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({(r["layers"], r["hidden"], r["params"]) for r in rows}, key=lambda s: s[2])
    labels = [f"{l}x{h}\n{p / 1e6:.0f}M" for l, h, p in sizes]
    names = [n for n in ("compiled", "inherent", "full", "failing", "stats", "msprobe")
             if any(r["config"] == n for r in rows)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        by_size = {(r["layers"], r["hidden"]): r for r in rows if r["config"] == name}
        left.plot(labels, [by_size[(l, h)]["seconds"] for l, h, _ in sizes], marker="o",
                  label=name)
        if name in ("full", "failing", "stats"):
            right.plot(labels, [max(by_size[(l, h)]["dump_bytes"], 1) / 1e6 for l, h, _ in sizes],
                       marker="o", label=name)
    left.set(title="step time", ylabel="seconds per step", yscale="log")
    right.set(title="dump per checked step", ylabel="MB", yscale="log")
    for axis in (left, right):
        axis.set_xlabel("layers x hidden, parameters")
        axis.legend()
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2x256,6x512,12x768")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="steps per configuration before "
                        "those (at least 1: the first compiles)")
    parser.add_argument("--json", help="write the rows there")
    parser.add_argument("--plot", help="write a plot of step time and dump size there (SVG/PNG)")
    parser.add_argument("--no-msprobe", action="store_true", help="leave msProbe out")
    parser.add_argument("--dumps", default="full,failing,stats",
                        help="dynaprobe's storage modes to measure")
    parser.add_argument("--replay", default=None,
                        help="replay settings to measure each storage mode with, e.g. "
                             "failing,none (default: the checker's default)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch's intra-op threads for training (default: every core); "
                             "fewer leaves cores to the checker's background thread, as a "
                             "training host with cores to spare per accelerator has")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the model's dtype (bfloat16: the reference is on by default)")
    parser.add_argument("--references", default="auto",
                        help="reference settings to measure each storage mode with, e.g. "
                             "auto,None (named e.g. full:ref=None; default: the checker's)")
    parser.add_argument("--msprobe-worker", metavar="LxH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first step compiles")
    torch.set_num_threads(args.threads)
    if args.msprobe_worker:
        layers, hidden = (int(x) for x in args.msprobe_worker.split("x"))
        workdir = tempfile.mkdtemp(prefix="dynaprobe-scale-msprobe-")
        os.chdir(workdir)  # msProbe writes into the working folder
        config = measure(layers, hidden, args.batch, args.seq, args.steps, args.warmup, workdir,
                         "worker")
        shutil.rmtree(workdir, ignore_errors=True)
        print(json.dumps({"times": config.times, "growth": config.growth, "bytes": config.bytes,
                          "stolen": config.stolen}))
        return
    with_msprobe = not args.no_msprobe and msprobe_available()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; msProbe: "
          f"{'measured' if with_msprobe else 'not installed, skipped'}", flush=True)
    rows = []
    workdir = tempfile.mkdtemp(prefix="dynaprobe-scale-")
    try:
        for size in args.sizes.split(","):
            layers, hidden = (int(x) for x in size.split("x"))
            rows += measure(layers, hidden, args.batch, args.seq, args.steps, args.warmup, workdir,
                            with_msprobe, args.dumps.split(","),
                            args.replay.split(",") if args.replay else (None,),
                            getattr(torch, args.dtype), args.references.split(","))
            print_table([r for r in rows if (r["layers"], r["hidden"]) == (layers, hidden)])
            sys.stdout.flush()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
