#!/usr/bin/env python3
"""The h5py + numpy reference of analyze_bench: the spec's metrics computed the way a user would
script them, to show what the C++ analyzer is worth.

    analyze_reference.py EAGER_FILE COMPILED_FILE [--atol A] [--rtol R] [--reps N]

Every eager dataset /tensors/<module>/<kind>.eager.<call>.<index> of EAGER_FILE is compared with
the compiled dataset of the same name in COMPILED_FILE (the same file when one dump holds both
sides): each dataset is read whole with h5py (hdf5plugin provides the zstd filter, id 32015) and
compared with numpy in float32, as torch compares float32 tensors:

    max_abs = max |a - b|    mean_abs = mean |a - b|    max_rel = max |a - b| / (|a| + 1e-8)
    allclose = numpy.allclose(a, b, rtol, atol)  (|a - b| <= atol + rtol * |b|, as torch.allclose)

Prints one line that analyze_bench parses:

    RESULT pairs=N bytes=B seconds=S max_abs=X mean_abs=Y max_rel=Z allclose=K

seconds is the best of --reps runs of opening, listing, reading and computing (interpreter start-up
and imports are not counted); bytes counts both sides' uncompressed bytes; max_abs and max_rel are
the largest over all pairs, mean_abs the mean over pairs of their mean_abs, allclose the number of
pairs that are allclose.
"""

import argparse
import sys
import time

import h5py
import hdf5plugin  # noqa: F401  (registers the zstd filter with HDF5)
import numpy as np


def as_float32(dataset):
    data = dataset[()]
    if dataset.attrs.get("dtype") == "bfloat16":  # stored as its 2-byte pattern
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32, copy=False)


def metrics(a, b, atol, rtol):
    diff = np.abs(a - b)
    if diff.size == 0:
        return 0.0, 0.0, 0.0, True
    max_abs = float(diff.max())
    mean_abs = float(diff.mean(dtype=np.float64))
    max_rel = float((diff / (np.abs(a) + np.float32(1e-8))).max())
    allclose = bool(np.allclose(a, b, rtol=rtol, atol=atol))
    return max_abs, mean_abs, max_rel, allclose


def compare(eager_path, compiled_path, atol, rtol):
    pairs = 0
    nbytes = 0
    max_abs = max_rel = mean_sum = 0.0
    allclose = 0
    with h5py.File(eager_path, "r") as eager_file, h5py.File(compiled_path, "r") as compiled_file:
        tensors = eager_file["tensors"]
        compiled_tensors = compiled_file["tensors"]
        for module, group in tensors.items():
            for name in group:
                kind, side, call, index = name.split(".")
                if side != "eager":
                    continue
                other = f"{module}/{kind}.compiled.{call}.{index}"
                if other not in compiled_tensors:
                    continue
                a = as_float32(group[name])
                b = as_float32(compiled_tensors[other])
                m = metrics(a, b, atol, rtol)
                pairs += 1
                nbytes += a.nbytes + b.nbytes
                max_abs = max(max_abs, m[0])
                mean_sum += m[1]
                max_rel = max(max_rel, m[2])
                allclose += m[3]
    return pairs, nbytes, max_abs, mean_sum / max(pairs, 1), max_rel, allclose


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("eager_file")
    parser.add_argument("compiled_file")
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--rtol", type=float, default=1e-3)
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args()
    best = float("inf")
    for _ in range(max(args.reps, 1)):
        start = time.perf_counter()
        result = compare(args.eager_file, args.compiled_file, args.atol, args.rtol)
        best = min(best, time.perf_counter() - start)
    pairs, nbytes, max_abs, mean_abs, max_rel, allclose = result
    print(f"RESULT pairs={pairs} bytes={nbytes} seconds={best:.6f} max_abs={max_abs:.9g} "
          f"mean_abs={mean_abs:.17g} max_rel={max_rel:.9g} allclose={allclose}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
