"""The main job: find where torch.compile changes a small transformer's numbers.

One training step of a small transformer runs with its blocks compiled by inductor, checked by
dynaprobe in single-pass mode. One block has a real compile-side difference, made honestly: its
MLP applies dropout in training mode, and inductor generates dropout masks with its own random
number generator, so the compiled block drops different elements than eager PyTorch would. Nothing
is faked or injected; every other block computes the same numbers both ways, within tolerance.

    .venv/bin/python examples/main_job.py [RUN_FOLDER] [--device cuda]
"""

import argparse
import datetime
import os
import sys

import torch
import torch.nn as nn

from dynaprobe import PrecisionChecker


class Block(nn.Module):
    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 100, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        # Only the second block uses dropout.
        self.blocks = nn.ModuleList([Block(width, 0.0), Block(width, 0.1), Block(width, 0.0)])
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description="One checked training step of a small transformer.")
    parser.add_argument("run", nargs="?", metavar="RUN_FOLDER",
                        help="where the dump and graphs go (default: dynaprobe_runs/main_job-<time>)")
    parser.add_argument("--device", default="cpu", help="where the model trains: cpu (default), cuda")
    args = parser.parse_args()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run = args.run or os.path.join("dynaprobe_runs", f"main_job-{stamp}")
    torch.manual_seed(0)
    model = TinyTransformer().to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 100, (4, 32)).to(args.device)
    targets = torch.randint(0, 100, (4, 32)).to(args.device)

    checker = PrecisionChecker(backend="inductor", dump_graphs=True,
                               graph_dir=os.path.join(run, "graphs"),
                               dump_dir=os.path.join(run, "dump"))
    checker.wrap_by_policy(model, (Block,))
    checker.install(model)

    optimizer.zero_grad()
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()

    result = checker.collect(loss)
    csv_path = os.path.join(run, "precision_report.csv")
    checker.report(result, csv_path=csv_path)

    print()
    failing = sorted({row.module for row in result.failures})
    print(f"Modules whose compiled numbers differ: {', '.join(failing) or 'none'}")
    print("  blocks.1 applies dropout in training mode; inductor draws its own dropout mask, so the")
    print("  compiled block drops other elements than eager. Set")
    print("  torch._inductor.config.fallback_random = True to make inductor use eager's RNG.")
    print(f"Dump:   {result.dump_file}")
    print(f"Graphs: {checker.graph_dir}/ (Captured, Forward and Backward graph of each block)")
    # The CLI installed next to this Python: a path that works from any folder, also when the
    # environment is not activated.
    cli = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "dynaprobe")
    print("Analyse again, here or on another machine (`dynaprobe` when the environment is active):")
    print(f"  {cli} compare {checker.dump_dir} --csv report.csv --json report.json")
    print(f"  {cli} ls {checker.dump_dir}")
    print(f"  {cli} graphs {checker.dump_dir} -o graphs_from_dump")


if __name__ == "__main__":
    main()
