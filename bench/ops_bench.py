"""Op localisation benchmark: what `bisect --ops` costs on one transformers decoder layer.

In one run, on the CPU:
  compile    torch.compile of the layer with inductor, one training step (compile included): the
             reference, what a user pays anyway to see the layer compiled once
  localise   dynaprobe._offline.ops.localise of the layer's stored call under inductor with a post-grad
             pass that scales rsqrt (RMSNorm): replay, watched compile, eager and fp64
             evaluations of every node, the compile with every node exposed, the cut graph's
             compile, the op's repro
Target: localise <= 120 s (issue 31); the ratio to `compile` says how many compiles it is worth.

    .venv/bin/python bench/ops_bench.py [--hidden 512] [--seq 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch._inductor.config as inductor_config
import transformers

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0] + "/tests/python")
from models import rsqrt_too_large  # noqa: E402

from dynaprobe import PrecisionChecker  # noqa: E402
from dynaprobe._offline.ops import localise  # noqa: E402
from dynaprobe._offline.replay import load_call  # noqa: E402


def _model(hidden: int):
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=hidden,
                                      intermediate_size=hidden * 8 // 3, num_hidden_layers=1,
                                      num_attention_heads=8, num_key_value_heads=8)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _step(batch):
    def step(m):
        out = m(**batch)
        out.loss.backward()
        return out.loss
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    ids = torch.randint(0, 1000, (2, args.seq))
    batch = {"input_ids": ids, "labels": ids}
    compile_times, localise_times, found = [], [], set()
    for _ in range(args.repeat):
        torch._dynamo.reset()
        model = _model(args.hidden)
        layer = model.model.layers[0]
        start = time.perf_counter()
        layer.forward = torch.compile(layer.forward, backend="inductor")
        _step(batch)(model)
        compile_times.append(time.perf_counter() - start)

        torch._dynamo.reset()
        model = _model(args.hidden)
        with tempfile.TemporaryDirectory() as folder, \
                inductor_config.patch(post_grad_custom_post_pass=rsqrt_too_large):
            checker = PrecisionChecker(backend="inductor", dump_dir=folder)
            checker.wrap(model.model.layers[0])
            checker.compare(_step(batch), model)
            call = load_call(folder, "model.layers.0")
            start = time.perf_counter()
            result = localise(call, "inductor", call.inductor_config())
            localise_times.append(time.perf_counter() - start)
            found |= {f"{f.graph}:{f.op}" for f in result.findings}
    reference, cost = statistics.median(compile_times), statistics.median(localise_times)
    print(f"Llama decoder layer: hidden {args.hidden}, batch 2x{args.seq}, "
          f"{torch.get_num_threads()} threads, median of {args.repeat}")
    print(f"  compile + one step (inductor)   {reference:8.1f} s")
    print(f"  localise (bisect --ops)         {cost:8.1f} s   ({cost / reference:.1f}x compile; "
          f"target <= 120 s: {'met' if cost <= 120 else 'NOT met'})")
    print(f"  found: {', '.join(sorted(found)) or 'nothing'}")


if __name__ == "__main__":
    main()
