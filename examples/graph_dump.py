"""Graph dump: see what Dynamo and AOTAutograd made of each wrapped module.

    .venv/bin/python examples/graph_dump.py [OUT_DIR]             # OUT_DIR defaults to ./dynaprobe_runs

Every compiled function leaves a Captured graph (what Dynamo traced), a Forward and a Backward graph
(what AOTAutograd derived from it), named as PyTorch names them:
__compiled_fn_<n>.Captured_Graph.<hash>.py. They are always stored in the dump; dump_graphs=True
also writes them to graph_dir, and `dynaprobe graphs DUMP -o FOLDER` extracts them later.
"""

import os
import subprocess
import sys
import time
from collections import OrderedDict

import torch
import torch.nn as nn

from dynaprobe import PrecisionChecker


class Gated(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        h = self.proj(x)
        if h.sum() > 0:  # a data-dependent branch: Dynamo breaks the graph here (two functions)
            h = h * 2
        return torch.tanh(h)


out = sys.argv[1] if len(sys.argv) > 1 else "dynaprobe_runs"
run_dir = os.path.join(out, time.strftime("graph_dump-%Y%m%d-%H%M%S") + f"-{os.getpid()}")

torch.manual_seed(0)
model = nn.Sequential(OrderedDict(embed=nn.Linear(8, 8), gated=Gated(8)))
x = torch.randn(4, 8)


def train_step(model):
    model.zero_grad()
    loss = model(x).square().mean()
    loss.backward()  # a training step: every function gets a Forward and a Backward graph
    return loss


checker = PrecisionChecker(dump_graphs=True, graph_dir=os.path.join(run_dir, "graphs"),
                           dump_dir=os.path.join(run_dir, "dump"))
checker.wrap_all_children(model, depth=0)  # embed and gated
result = checker.compare(train_step, model)
checker.report(result)

# Each file starts with a comment naming its graph and the wrapped module it belongs to.
graph_dir = os.path.join(run_dir, "graphs")
print(f"\ngraphs written to {graph_dir}:")
for name in sorted(os.listdir(graph_dir)):
    with open(os.path.join(graph_dir, name)) as f:
        print("  " + f.readline().removeprefix("# ").strip())

# The same graphs, extracted from the dump (as on a machine that only has the dump).
cli = os.path.join(os.path.dirname(sys.executable), "dynaprobe")
extracted = os.path.join(run_dir, "from_dump")
subprocess.run([cli, "graphs", os.path.join(run_dir, "dump"), "-o", extracted], check=True,
               stdout=subprocess.DEVNULL)
print(f"`dynaprobe graphs` extracted {len(os.listdir(extracted))} graphs into {extracted}")
