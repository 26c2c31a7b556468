"""Writes the seed corpus of the fuzz target (tests/data/fuzz_seeds): real step files of the
current format, small enough to mutate quickly. Run after a format change:

    .venv/bin/python tests/fuzz/make_seeds.py tests/data/fuzz_seeds

- single_pass.h5: PrecisionChecker's single-pass capture of a small model with real torch.compile
  (aot_eager): inputs, outputs, gradients, parameter gradients, loss, /modules, /graphs, /metrics;
- two_pass_raw_chunks.h5: several records of several chunks stored as they are (fp32 noise) and
  compressed (bf16-rounded values), a complex64 record, an empty and a 0-d one, graphs, modules.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from dynaprobe import _C, PrecisionChecker


def single_pass(out):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    with tempfile.TemporaryDirectory() as folder:
        checker = PrecisionChecker(dump_dir=folder)
        checker.wrap(model[0])
        checker.wrap(model[2])
        checker.compare(lambda m: m(torch.randn(4, 8)).square().mean(), model)
        shutil.copy(Path(folder) / "step_00000000.h5", out)


def two_pass_raw_chunks(out):
    rng = np.random.default_rng(17)
    noise = rng.standard_normal((8, 512)).astype(np.float32)
    rounded = (rng.standard_normal((8, 512)).astype(np.float32).view(np.uint32)
               & 0xFFFF0000).view(np.float32)
    wave = (rng.standard_normal(64) + 1j * rng.standard_normal(64)).astype(np.complex64)
    records = []
    for side in ("eager", "compiled"):
        records += [("layers.0", 0, "fwd_input", 0, side, "", "float32", noise),
                    ("layers.0", 0, "fwd_output", 0, side, "", "float32", rounded),
                    ("layers.1", 0, "fwd_output", 0, side, "", "complex64", wave),
                    ("layers.1", 0, "fwd_output", 1, side, "", "float32", np.zeros((0, 3), np.float32)),
                    ("LOSS", 0, "loss", 0, side, "", "float32", np.array(1.5, np.float32))]
    graphs = [("__compiled_fn_1.Forward_Graph.abcd", "forward", "def forward(self, x):\n    return x\n",
               {"module": "layers.0"})]
    modules = [("layers.0", {"role": "wrapped", "compiled_functions": "__compiled_fn_1"}),
               ("layers.1", {"role": "wrapped", "note": "NOT_COMPILED"})]
    with tempfile.TemporaryDirectory() as folder:
        path = _C.write_step(folder, 0, {"mode": "two_pass", "atol": "0.0001", "rtol": "0.001"},
                             records, graphs, chunk_bytes=4 << 10, modules=modules)
        shutil.copy(path, out)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    single_pass(target / "single_pass.h5")
    two_pass_raw_chunks(target / "two_pass_raw_chunks.h5")
