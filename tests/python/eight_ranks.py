"""A real 8-rank gloo training run with one fault: rank 5's compiled side is off at step 7.

    python eight_ranks.py RUN_DIR [STEPS]

Spawns 8 CPU ranks (torch.multiprocessing, gloo). Each trains a small MLP with its blocks
checked (PrecisionChecker, single-pass, dump_dir=RUN_DIR: rank<R>/ folders), compiled by a
backend that runs the captured graph as it is, except on rank 5 at step 7, where it adds 0.05 to
the first block's output. Exits 0 when every rank finished (whatever the verdicts).
"""

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

WORLD, FAULT_RANK, FAULT_STEP = 8, 5, 7
FAULT = {"on": False}


def faulty_backend(gm, example_inputs):
    """The captured graph run as it is; with FAULT on, its first output is 0.05 too large."""
    def run(*args):
        outputs = gm(*args)
        if FAULT["on"]:
            first = outputs[0] + 0.05 if isinstance(outputs, (tuple, list)) else outputs + 0.05
            outputs = (first, *outputs[1:]) if isinstance(outputs, (tuple, list)) else first
        return outputs
    return run


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def train(rank: int, run_dir: str, steps: int) -> None:
    from dynaprobe import PrecisionChecker
    torch.manual_seed(0)
    model = nn.Sequential(Block(16), Block(16), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    checker = PrecisionChecker(backend=faulty_backend, dump_dir=run_dir, reference=None)
    checker.wrap_by_policy(model, (Block,))
    checker.install(model)
    for step in range(steps):
        FAULT["on"] = rank == FAULT_RANK and step == FAULT_STEP
        generator = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 16, generator=generator)
        model.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        checker.collect(loss)
        optimizer.step()
    checker.uninstall()


def _entry(rank: int, port: int, run_dir: str, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    try:
        train(rank, run_dir, steps)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_dir, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_entry, args=(port, os.path.abspath(run_dir), steps), nprocs=WORLD,
                       start_method="spawn")
