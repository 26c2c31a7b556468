"""Capture benchmark: what the checker costs a training step, beyond the work it has to do.

In one run, on a small transformer on the CPU:
  compiled   step time of the model with its blocks compiled (no checker)
  eager      step time of the plain eager model (forward + backward)
  checker    step time with PrecisionChecker in single-pass (install, step, collect)
The checker inherently runs the wrapped blocks compiled and once more eagerly (forward and
backward), so its overhead beyond that work is  checker / (compiled + eager) - 1  (target <= 25%).

Then the training thread's cost per captured byte: Recorder.record() of activation-sized tensors
(a snapshot into host memory; compression and writes run in the background) against a plain
memcpy of the same bytes (torch.Tensor.clone) (target <= 2x).

    .venv/bin/python bench/capture_bench.py [--steps 10] [--blocks 4] [--width 256]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0] + "/tests/python")
from models import Block  # noqa: E402

from dynaprobe import _C, PrecisionChecker  # noqa: E402


class Transformer(nn.Module):
    def __init__(self, blocks: int, width: int):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width, heads=4) for _ in range(blocks)])
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for block in self.blocks:
            x, _ = block(x)
        return self.head(x)


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    base = Transformer(args.blocks, args.width)
    x = torch.randn(args.batch, args.seq, args.width, requires_grad=True)

    eager = copy.deepcopy(base)
    compiled = copy.deepcopy(base)
    for block in compiled.blocks:
        block.forward = torch.compile(block.forward, backend="aot_eager")
    checked = copy.deepcopy(base)
    with tempfile.TemporaryDirectory() as folder:
        checker = PrecisionChecker(dump_dir=f"{folder}/dump")
        checker.wrap_by_policy(checked, (Block,))
        checker.install(checked)

        def checked_step():
            loss = step(checked, x)
            checker.collect(loss)

        runs = {"eager": lambda: step(eager, x), "compiled": lambda: step(compiled, x),
                "checker": checked_step}
        for fn in runs.values():
            fn()  # warm up: compile, allocate
            fn()
        # Interleaved, so that load changes on the machine affect the three alike.
        times = {name: [] for name in runs}
        for _ in range(args.steps):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        t_eager, t_compiled, t_checker = (statistics.median(times[n]) for n in runs)
        checker.uninstall()

    inherent = t_compiled + t_eager
    overhead = t_checker / inherent - 1
    print(f"transformer: {args.blocks} blocks, width {args.width}, batch {args.batch}x{args.seq}, "
          f"{torch.get_num_threads()} threads")
    print(f"  eager step                 {t_eager * 1e3:9.1f} ms")
    print(f"  compiled step              {t_compiled * 1e3:9.1f} ms")
    print(f"  checker step (single-pass) {t_checker * 1e3:9.1f} ms")
    print(f"  overhead beyond compiled + eager: {overhead * 100:6.1f} %   (target <= 25 %)  "
          f"{'met' if overhead <= 0.25 else 'NOT met'}")

    # The training thread's share of capture: snapshot per byte against memcpy.
    tensors = [torch.randn(args.batch, args.seq, args.width) for _ in range(64)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    with tempfile.TemporaryDirectory() as folder:
        recorder = _C.Recorder(folder, {"mode": "single_pass"})
        step_index = [0]

        def record_all():
            recorder.begin_step(step_index[0])
            start = time.perf_counter()
            for i, t in enumerate(tensors):
                recorder.record("m", 0, "fwd_output", i, "eager", t)
            elapsed = time.perf_counter() - start
            recorder.end_step()  # the background write is not on the training thread's clock
            step_index[0] += 1
            return elapsed

        def copy_all():
            start = time.perf_counter()
            copies = [t.clone() for t in tensors]
            elapsed = time.perf_counter() - start
            del copies
            return elapsed

        record_all()
        copy_all()
        # Interleaved, like the steps above: a change of load on the machine hits both alike.
        rounds = [(copy_all(), record_all()) for _ in range(7)]
        t_copy = statistics.median(c for c, _ in rounds)
        t_record = statistics.median(r for _, r in rounds)
    ratio = t_record / t_copy
    print(f"snapshot of {len(tensors)} tensors, {total / 2**20:.0f} MiB:")
    print(f"  memcpy (clone)             {total / t_copy / 1e9:9.2f} GB/s")
    print(f"  Recorder.record            {total / t_record / 1e9:9.2f} GB/s")
    print(f"  training-thread time per byte vs memcpy: {ratio:5.2f}x   (target <= 2x)  "
          f"{'met' if ratio <= 2 else 'NOT met'}")


if __name__ == "__main__":
    main()
