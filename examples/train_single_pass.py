"""Training, single-pass: check the steps of a real training loop (the recommended mode).

    .venv/bin/python examples/train_single_pass.py [OUT_DIR]      # OUT_DIR defaults to ./dynaprobe_runs

install() compiles the wrapped modules in place; the training loop itself is unchanged. Every call
of a wrapped module runs compiled (the training path) and is re-run eagerly on the same inputs;
collect(loss) writes the step's dump and returns its comparison. Exit status 0 when all pass.
"""

import os
import sys
import time

import torch
import torch.nn as nn

from dynaprobe import PrecisionChecker


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(0.1)  # same mask on both sides: the checker restores the RNG state

    def forward(self, x):
        return x + self.drop(self.mlp(self.norm(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([Block(32), Block(32)])
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


out = sys.argv[1] if len(sys.argv) > 1 else "dynaprobe_runs"
run_dir = os.path.join(out, time.strftime("train_single_pass-%Y%m%d-%H%M%S") + f"-{os.getpid()}")
torch.manual_seed(0)
model = Net()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(3)]

# Defaults: single_pass=True, backend="aot_eager" (try "inductor": docs/troubleshooting.md).
checker = PrecisionChecker(dump_dir=run_dir)
checker.wrap_by_policy(model, (Block,))       # compile and compare blocks.0 and blocks.1
checker.install(model)

for x, y in data:                             # the usual training step, untouched
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    result = checker.collect(loss)            # one step file per collect()
    print(f"step {result.step}: loss {loss.item():.4f}, {len(result.failures)} failing rows")

checker.uninstall()                           # the model runs plain eager again
checker.report(result, csv_path=os.path.join(run_dir, "report.csv"))
print(f"dump: {run_dir}  (re-check offline: dynaprobe compare {run_dir})")
sys.exit(0 if result.all_pass else 1)
