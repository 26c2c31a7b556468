"""Inference, two-pass: run the whole model once eagerly and once compiled, then compare.

    .venv/bin/python examples/inference_two_pass.py [OUT_DIR]     # OUT_DIR defaults to ./dynaprobe_runs

compare() deep-copies the model twice (one eager copy, one with the wrapped modules compiled),
runs the same step on each from the same RNG state and compares every wrapped module's inputs and
outputs, plus the scalar the step returns: a real loss_eager / loss_compiled pair. A module whose
input already differs (FORWARD INPUT) inherited the difference from upstream. The model itself is
left untouched. Exit status 0 when all pass.
"""

import os
import sys
import time

import torch
import torch.nn as nn

from dynaprobe import PrecisionChecker


class TinyClassifier(nn.Module):
    def __init__(self, vocab: int = 100, width: int = 32, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.encoder = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.LayerNorm(width))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


out = sys.argv[1] if len(sys.argv) > 1 else "dynaprobe_runs"
run_dir = os.path.join(out, time.strftime("inference_two_pass-%Y%m%d-%H%M%S") + f"-{os.getpid()}")

torch.manual_seed(0)
model = TinyClassifier().eval()
tokens = torch.randint(0, 100, (4, 12))


def infer_step(model):
    # Two-pass needs a scalar to compare as "the loss": inference has none, so use a statistic of
    # the output. It takes no part in any backward.
    with torch.no_grad():
        return model(tokens).mean()


# inductor generates its own kernels: expect tiny (float32 rounding) differences, well in tolerance.
checker = PrecisionChecker(single_pass=False, backend="inductor", dump_dir=run_dir)
# depth=0: the direct children, a Sequential looked through: embed, encoder.0-2 and head.
checker.wrap_all_children(model, depth=0)
result = checker.compare(infer_step, model)  # no install(): compare() runs both sides

checker.report(result, csv_path=os.path.join(run_dir, "report.csv"))
print(f"loss_eager={result.loss_eager:.6f} loss_compiled={result.loss_compiled:.6f}")
sys.exit(0 if result else 1)  # bool(result) is result.all_pass
