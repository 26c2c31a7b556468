"""Multi-rank FSDP2 training, single-pass: per-rank reports and one merged CSV for the whole job.

    torchrun --nproc-per-node 2 examples/fsdp2_multirank.py [OUT_DIR]
    .venv/bin/python examples/fsdp2_multirank.py [OUT_DIR]     # spawns 2 CPU ranks itself (gloo)

Every rank shards a small transformer with fully_shard (each block, then the root), installs the
checker (single-pass, the only mode FSDP2 allows) and trains two steps per scenario: ``core`` and
``bf16`` (cast_dtype=torch.bfloat16). Each rank prints its own report and writes
``precision_<scenario>_rank<R>.csv``; its dumps go to ``dynaprobe_runs/<run>/rank<R>``, one run
folder per scenario shared by all ranks. Rank 0 then gathers every rank's rows over the job's
process group into ``precision_merged.csv`` (``rank,scenario`` + the 9 columns). Everything is
written under OUT_DIR (default: the current folder). Exit status 0 when every rank passes.

On GPUs: use backend "nccl" (or "hccl"), torch.cuda.set_device(local_rank) and .cuda() the model
and batches; nothing else changes.
"""

import datetime
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from dynaprobe import PrecisionChecker

VOCAB, WIDTH, HEADS, BATCH, SEQ = 64, 32, 4, 4, 16
# FSDP2's note that the root returns a view (the LM head's 3-D output): not an in-place case here.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, attn_mask=None):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=attn_mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([Block(WIDTH, HEADS) for _ in range(layers)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)  # True: masked
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, attn_mask=causal)
        return self.head(x)


def run_step(model, rank: int, step: int):
    generator = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    model.zero_grad()
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss


def main() -> int:
    rank = dist.get_rank()
    results = []
    for scenario, cast_dtype in (("core", None), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)  # the same initial weights on every rank
        model = TinyLM()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        checker = PrecisionChecker(scenario=scenario, cast_dtype=cast_dtype)  # single-pass
        checker.wrap_by_policy(model, (Block,))
        checker.install(model)  # every rank: they agree on one run folder here
        for step in range(2):
            loss = run_step(model, rank, step)
            result = checker.collect(loss)
            optimizer.step()
        checker.uninstall()
        for turn in range(dist.get_world_size()):  # each rank its own report, one after another
            if turn == rank:
                print(f"[{scenario}] rank {rank}:", flush=True)
                checker.report(result, csv_path=f"precision_{scenario}_rank{rank}.csv")
                sys.stdout.flush()
            dist.barrier()
        results.append(result)
        if rank == 0:
            print(f"[{scenario}] run folder: {checker.run_dir}  (all ranks: dynaprobe compare "
                  f"{checker.run_dir} --merged-csv merged_{scenario}.csv)")

    # One CSV for the job: rank 0 gathers every rank's rows over the default process group.
    checker.gather_report(results, csv_path="precision_merged.csv", timeout=120)
    failed = torch.tensor([sum(not r.all_pass for r in results)])
    dist.all_reduce(failed)
    if rank == 0:
        print("ALL RANKS PASS" if failed.item() == 0 else f"{failed.item()} rank report(s) FAILED")
    return 0 if failed.item() == 0 else 1


def _spawned(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    sys.exit(_run(out))


def _run(out: str) -> int:
    os.makedirs(out, exist_ok=True)
    os.chdir(out)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        return main()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    if "RANK" in os.environ:  # started by torchrun
        sys.exit(_run(out))
    with socket.socket() as s:  # started by hand: spawn 2 CPU ranks
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_spawned, args=(2, port, os.path.abspath(out)), nprocs=2)
    except mp.ProcessExitedException as error:  # a rank failed, or found differences
        sys.exit(error.exit_code or 1)
