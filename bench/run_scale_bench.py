"""Cluster-scale analysis: peak memory and time of `dynaprobe compare RUN --merged-csv --json
--junit` on runs of many rank folders, side by side in one run.

Each run has RANKS rank folders of --steps step files; a step holds --modules modules (a
fwd_input and a fwd_output of 256 float32 each, one rank's last step off by 0.5 in one module),
written by dynaprobe's own writer. The reference, measured in the same run, is the same command on
a run of one rank folder: peak RSS (Linux ru_maxrss of the command's process, which counts the
process it was started from: the runs are written by a child process, so this one stays small
without torch) and seconds per step file. Streaming keeps peak RSS flat: the ratio to the reference stays near 1 however many ranks
(the target: at most 256 MiB for 512 step files). Each command runs --repeat times; medians.

    .venv/bin/python bench/run_scale_bench.py [--ranks 512,4096] [--steps 2] [--modules 32]
        [--repeat 3] [--keep DIR] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CLI = os.environ.get("DYNAPROBE_CLI") or shutil.which("dynaprobe") or os.path.join(
    HERE, "..", "build", "analyze", "dynaprobe")


def write_run(run: str, ranks: int, steps: int, modules: int) -> None:
    import numpy as np

    from dynaprobe import _C
    rng = np.random.default_rng(0)
    x = rng.standard_normal(256).astype(np.float32)
    attributes = [(f"layers.{m}", {"role": "wrapped"}) for m in range(modules)]
    for rank in range(ranks):
        provenance = {"mode": "single_pass", "rank": str(rank), "world_size": str(ranks),
                      "torch_version": "2.13.0", "backend": "inductor"}
        for step in range(steps):
            records = [("LOSS", 0, "loss", 0, "compiled", "", "float32", np.array(0.5, np.float32))]
            for m in range(modules):
                y = x + np.float32(0.5) if (rank, step, m) == (ranks - 1, steps - 1, 3) else x
                records += [(f"layers.{m}", 0, "fwd_input", 0, "compiled", "", "float32", x),
                            (f"layers.{m}", 0, "fwd_output", 0, "eager", "", "float32", x),
                            (f"layers.{m}", 0, "fwd_output", 0, "compiled", "", "float32", y)]
            _C.write_step(os.path.join(run, f"rank{rank}"), step, provenance, records, [],
                          modules=attributes)


def measure(run: str, out: str) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of one compare of `run`, its reports written under `out`."""
    command = [CLI, "compare", run, "--merged-csv", os.path.join(out, "merged.csv"),
               "--json", os.path.join(out, "report.json"), "--junit", os.path.join(out, "j.xml")]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):
        raise SystemExit(f"{' '.join(command)} exited {code}: {process.stderr.read().decode()}")
    process.stderr.close()
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="512,4096")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--modules", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", help="write the runs here and keep them")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--write", nargs=2, metavar=("RUN", "RANKS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:  # in a child process: numpy and torch stay out of the measuring one
        write_run(args.write[0], int(args.write[1]), args.steps, args.modules)
        return
    sizes = [1] + [int(n) for n in args.ranks.split(",")]
    root = args.keep or tempfile.mkdtemp(prefix="dynaprobe-run-scale-")
    os.makedirs(root, exist_ok=True)
    results = []
    try:
        for ranks in sizes:
            run = os.path.join(root, f"run{ranks}")
            if not os.path.isdir(run):
                start = time.perf_counter()
                subprocess.run([sys.executable, __file__, "--write", run, str(ranks), "--steps",
                                str(args.steps), "--modules", str(args.modules)], check=True)
                print(f"wrote {ranks} rank folder(s) in {time.perf_counter() - start:.1f} s",
                      file=sys.stderr)
        for ranks in sizes:
            samples = [measure(os.path.join(root, f"run{ranks}"), root) for _ in range(args.repeat)]
            seconds = statistics.median(s for s, _ in samples)
            rss = statistics.median(r for _, r in samples)
            files = ranks * args.steps
            results.append({"ranks": ranks, "step_files": files, "seconds": seconds,
                            "seconds_per_file": seconds / files, "peak_rss_mib": rss,
                            "report_json_mib": os.path.getsize(os.path.join(root, "report.json")) / 2**20})
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    reference = results[0]
    print(f"dynaprobe compare RUN --merged-csv --json --junit; {args.steps} steps of "
          f"{args.modules} modules per rank; medians of {args.repeat}")
    print(f"{'ranks':>6} {'files':>6} {'seconds':>8} {'ms/file':>8} {'x ref':>6} "
          f"{'peak RSS MiB':>13} {'x ref':>6} {'JSON MiB':>9}")
    for r in results:
        print(f"{r['ranks']:>6} {r['step_files']:>6} {r['seconds']:>8.2f} "
              f"{1e3 * r['seconds_per_file']:>8.2f} "
              f"{r['seconds_per_file'] / reference['seconds_per_file']:>6.2f} "
              f"{r['peak_rss_mib']:>13.1f} {r['peak_rss_mib'] / reference['peak_rss_mib']:>6.2f} "
              f"{r['report_json_mib']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
