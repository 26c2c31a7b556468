"""Cross-machine: capture the eager and the compiled side in separate processes, compare offline.

    .venv/bin/python examples/cross_machine.py [OUT_DIR]          # OUT_DIR defaults to ./dynaprobe_runs

The two captures could run on different machines (a GPU node and a reference box, two PyTorch
versions, ...): each is a plain process that runs the same model code with the same seed and
inputs and writes one side of a dump. Here this script starts itself twice:

    cross_machine.py --capture eager    RUN_DIR/eager
    cross_machine.py --capture compiled RUN_DIR/compiled

and then compares them with the CLI, as you would on the machine where the two dumps meet:

    dynaprobe compare RUN_DIR/eager RUN_DIR/compiled --csv RUN_DIR/report.csv
"""

import os
import subprocess
import sys
import time

import torch
import torch.nn as nn

from dynaprobe import PrecisionChecker


def capture(side: str, dump_dir: str) -> None:
    torch.manual_seed(0)  # same weights and inputs in both processes
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.LayerNorm(16))
    x = torch.randn(8, 16)

    def train_step(model):
        model.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    checker = PrecisionChecker(dump_dir=dump_dir, scenario="cross-machine")
    checker.wrap_all_children(model, depth=0)
    step_file = checker.capture(train_step, model, side=side)  # one side only, no comparison
    print(f"[{side}] wrote {step_file}")


if len(sys.argv) == 4 and sys.argv[1] == "--capture":
    capture(side=sys.argv[2], dump_dir=sys.argv[3])
    sys.exit(0)

out = sys.argv[1] if len(sys.argv) > 1 else "dynaprobe_runs"
run_dir = os.path.join(out, time.strftime("cross_machine-%Y%m%d-%H%M%S") + f"-{os.getpid()}")
for side in ("eager", "compiled"):  # two separate processes
    subprocess.run([sys.executable, __file__, "--capture", side, os.path.join(run_dir, side)],
                   check=True)

# Before the report: where each side was captured, and what differs (here only `mode`).
cli = os.path.join(os.path.dirname(sys.executable), "dynaprobe")
compare = subprocess.run([cli, "compare", os.path.join(run_dir, "eager"),
                          os.path.join(run_dir, "compiled"), "--csv", os.path.join(run_dir, "report.csv")])
print(f"dynaprobe compare exited with {compare.returncode} (0: all pass, 1: differences)")
sys.exit(compare.returncode)
