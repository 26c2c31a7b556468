"""Mixed precision: check the wrapped modules under torch.autocast(bfloat16), then judge the same
dump again with tolerances that fit bfloat16.

    .venv/bin/python examples/autocast_bf16.py [OUT_DIR]          # OUT_DIR defaults to ./dynaprobe_runs

cast_dtype=torch.bfloat16 runs every wrapped module under autocast on both sides. Inductor fuses
the elementwise work and keeps fp32 intermediates where eager rounds each op to bf16, so small
differences at bf16's resolution (about 2**-8 relative) are expected; the default fp32 tolerances
(atol=1e-4, rtol=1e-3) will often flag them. Exit status 0 when the bf16 tolerances pass.
"""

import os
import subprocess
import sys
import time

import torch
import torch.nn as nn

from dynaprobe import PrecisionChecker

out = sys.argv[1] if len(sys.argv) > 1 else "dynaprobe_runs"
run_dir = os.path.join(out, time.strftime("autocast_bf16-%Y%m%d-%H%M%S") + f"-{os.getpid()}")


class SwiGLU(nn.Module):
    """A LLaMA-style MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, width: int):
        super().__init__()
        self.gate = nn.Linear(width, 4 * width, bias=False)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        # Eager rounds silu's output to bf16 before the multiply; inductor fuses silu * up in fp32.
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


torch.manual_seed(0)
model = nn.Sequential(SwiGLU(32), SwiGLU(32))
x, y = torch.randn(64, 32), torch.randn(64, 32)


def train_step(model):
    model.zero_grad()
    loss = nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    return loss


checker = PrecisionChecker(backend="inductor", cast_dtype=torch.bfloat16, dump_dir=run_dir)
checker.wrap_by_policy(model, (SwiGLU,))  # whole MLPs: inductor fuses inside each
result = checker.compare(train_step, model)  # single-pass: install, one step, collect, uninstall
checker.report(result)
print(f"default tolerances: {len(result.failures)} failing row(s)")

# The dump keeps every tensor: re-judge it with bf16 tolerances alone (--verdict tolerances: the
# float32 reference, which decided the report above, set aside), without re-running the model.
# rtol=1.6e-2 is about four bf16 steps (2**-8 each); atol covers values near zero.
cli = os.path.join(os.path.dirname(sys.executable), "dynaprobe")
bf16 = subprocess.run([cli, "compare", run_dir, "--atol", "1e-2", "--rtol", "1.6e-2",
                       "--verdict", "tolerances"],
                      capture_output=True, text=True)
print("bf16 tolerances:", next(line for line in bf16.stdout.splitlines() if "RESULT:" in line).strip())
sys.exit(bf16.returncode)  # the CLI exits 0 when all pass, 1 when some rows fail
