"""Does the reference rule hold on real models in reduced precision? (docs/guide/diagnosis.md,
"Is it noise?"). For each transformers family of the test suite (tests/python/hf_models.py), in
bf16 and fp16, one single-pass training step under inductor with default settings, its blocks
wrapped:

- clean: the step as inductor compiles it; every row should pass;
- fault F: an inductor post-grad pass multiplies every ``aten.rsqrt`` (RMSNorm, and LayerNorm as
  inductor decomposes it) by F; the step should FAIL with the root cause at the first block.

Each configuration runs in a process of its own (inductor's config and caches stay apart). Prints
one markdown table: result, FAIL/WARN rows, rows passing only within reference noise, rsqrt
nodes the pass changed, the forward root cause, and the largest compiled error in units of the
noise among the step's rows (for a clean step: how close the rule, factor 2, came to failing it).

    .venv/bin/python bench/low_precision_sweep.py [--families Llama,GPT2] [--faults 1.05,1.01]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests", "python")


def run_one(family: str, dtype: str, fault: float, dump_dir: str) -> dict:
    """One checked training step (in this process); the figures of the table."""
    sys.path.insert(0, TESTS)
    import torch
    import torch._inductor.config as inductor_config
    from hf_models import families

    from dynaprobe import PrecisionChecker

    changed = []

    def scale_rsqrt(graph):
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target == torch.ops.aten.rsqrt.default:
                with graph.inserting_after(node):
                    scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, fault))
                node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
                changed.append(node.name)

    if fault != 1.0:
        inductor_config.post_grad_custom_post_pass = scale_rsqrt
    chosen = families()[family]
    torch.manual_seed(0)
    model = chosen.build().to(getattr(torch, dtype))
    batch = chosen.train_batch(model)

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(**batch).loss
        loss.backward()
        return loss

    checker = PrecisionChecker(backend="inductor", dump_dir=dump_dir)
    checker.wrap_by_policy(model, chosen.blocks)
    result = checker.compare(step, model)
    # Each row's compiled error in units of the noise, as the rule judges it (factor 2).
    ratios = [row.reference["noise_units"] for row in result.rows
              if row.reference and row.reference["noise_units"] is not None]
    cause = (result.root_cause or {}).get("forward") or {}
    counts = result.counts
    return {"result": counts["verdict"], "fail": counts["fail"], "warn": counts["warn"],
            "noise_pass": counts["noise_pass"],
            "referenced": sum(1 for row in result.rows if row.reference),
            "rows": sum(1 for row in result.rows if row.check_type != "note"),
            "rsqrt": len(changed), "root_cause": cause.get("module", ""),
            "max_ratio": max(ratios, default=float("nan"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="Llama,Qwen2,Mistral,Mixtral,GPT2,Bert,Bart,ViT")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--faults", default="1.05,1.01")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # family,dtype,fault: run it here
    args = parser.parse_args()
    if args.one:
        family, dtype, fault = args.one.split(",")
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(run_one(family, dtype, float(fault), os.path.join(folder, "dump"))))
        return
    print("| family | dtype | fault | result | FAIL | WARN | noise passes | referenced rows "
          "| rsqrt changed | forward root cause | max compiled/eager |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for family in args.families.split(","):
        for dtype in args.dtypes.split(","):
            for fault in ["1.0", *args.faults.split(",")]:
                label = "none" if fault == "1.0" else f"x{fault}"
                try:
                    done = subprocess.run(
                        [sys.executable, __file__, "--one", f"{family},{dtype},{fault}"],
                        capture_output=True, text=True, timeout=args.timeout)
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                except Exception as error:  # a family that cannot run: say so, go on
                    tail = getattr(error, "stderr", "") or ""
                    print(f"| {family} | {dtype} | {label} | error: {type(error).__name__} "
                          f"{tail.strip().splitlines()[-1][:80] if tail.strip() else ''} "
                          "| | | | | | | |", flush=True)
                    continue
                print(f"| {family} | {dtype} | {label} | {row['result']} | {row['fail']} "
                      f"| {row['warn']} | {row['noise_pass']} | {row['referenced']}/{row['rows']} "
                      f"| {row['rsqrt']} | {row['root_cause']} | {row['max_ratio']:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
