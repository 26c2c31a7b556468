"""Dumps are untrusted input (issue 17): the `dynaprobe` CLI never crashes, hangs or passes by
accident on a damaged or crafted dump, and never writes outside the folders it was given.

The mutation test damages real step files of format 2.0 as a bad disk or an attacker would (bit
flips in data and metadata, zeroed blocks, truncation, appended garbage) and asserts, for each
mutant: exit code 1 or 3, or a report identical to the undamaged file's; never a signal, never a
timeout. Format 2.0 holds nothing in HDF5's global heap, so the damage that crashed libhdf5 in
format 1 (variable-length strings of /index, attributes, graphs) is read in-process, in Python,
as a clean FormatError (test_damaged_format_2_files_read_in_process_raise_clean_errors).

Under ASan + UBSan (a -DDYNAPROBE_SANITIZE=ON build; DYNAPROBE_CLI=<its dynaprobe>,
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1) the mutation test passes too: what ASan reports is
inside libhdf5's global heap (H5HG_read), and the CLI contains it as exit 3. The memory-limit test
does not apply there (RLIMIT_AS is not set under ASan, whose shadow memory needs the address
space).
"""

import json
import os
import random
import signal
import subprocess

import h5py
import numpy as np
import pytest
from dump_checksum import index_checksum, set_text_attribute, widened, xxh3, xxh64

from dynaprobe import _C

MUTANTS = 300  # about 30 s on 2 cores
RNG = np.random.default_rng(17)


def run_cli(cli, *args, env=None, timeout=60):
    return subprocess.run([cli, *map(str, args)], capture_output=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def rec(module, kind, side, array, label="", index=0):
    return (module, 0, kind, index, side, label, "float32", array)


def real_step(folder, provenance=None, modules=None, sides=("eager", "compiled")):
    """A step file as a two-pass capture writes one: several modules, raw multi-chunk records (fp32
    noise does not compress), zstd-compressed ones (bf16-rounded values), small ones, a loss, a
    graph and module attributes."""
    x = RNG.standard_normal((64, 512)).astype(np.float32)
    y = (RNG.standard_normal((64, 512)).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    small = RNG.standard_normal(16).astype(np.float32)
    records = []
    for side in sides:
        records += [rec("layers.0", "fwd_input", side, x),
                    rec("layers.0", "fwd_output", side, y if side == "eager" else y + np.float32(1e-6)),
                    rec("layers.1", "fwd_output", side, small),
                    rec("layers.1", "param_grad", side, small[:4].reshape(2, 2), label="weight"),
                    rec("LOSS", "loss", side, np.array(1.5, np.float32))]
    graphs = [("__compiled_fn_1.Forward_Graph.abcd", "forward", "def forward(self, x):\n    return x\n",
               {"module": "layers.0"})]
    modules = modules or [("layers.0", {"role": "wrapped", "compiled_functions": "__compiled_fn_1"}),
                          ("layers.1", {"role": "wrapped"})]
    provenance = provenance or {"mode": "two_pass", "atol": "0.0001", "rtol": "0.001", "backend": "inductor"}
    return _C.write_step(str(folder), 0, provenance, records, graphs, chunk_bytes=32 << 10, modules=modules)


def mutate(data, rng):
    b = bytearray(data)
    kind = rng.choice(["flip", "flip", "metadata", "zero", "truncate", "append"])
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == "metadata":  # HDF5 keeps its superblock and most metadata at the ends
        where = rng.choice([rng.randrange(4096), len(b) - 1 - rng.randrange(8192)])
        b[where] ^= 1 << rng.randrange(8)
    elif kind == "zero":
        start = rng.randrange(len(b))
        length = min(rng.choice([8, 64, 512, 4096]), len(b) - start)
        b[start:start + length] = bytes(length)
    elif kind == "truncate":
        del b[rng.randrange(len(b)):]
    else:
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 4096)))
    return kind, bytes(b)


def test_mutated_step_files_exit_1_or_3_or_report_as_before(tmp_path, dynaprobe_cli):
    original = real_step(tmp_path / "original")
    with h5py.File(original) as f:
        assert f.attrs["dynaprobe_format_version"] == b"2.0"
    data = original.read_bytes()
    before = run_cli(dynaprobe_cli, "compare", original)
    # It passes, so a mutant that exits 0 must print exactly its report: damage never passes
    # with other numbers.
    assert before.returncode == 0 and b"RESULT: ALL PASS" in before.stdout, before.stderr
    rng = random.Random(17)
    outcomes, bad = {}, []
    folder = tmp_path / "mutant"
    folder.mkdir()
    for i in range(MUTANTS):
        kind, damaged = mutate(data, rng)
        (folder / "step_00000000.h5").write_bytes(damaged)
        try:
            proc = run_cli(dynaprobe_cli, "compare", folder, "--time-limit", "10", timeout=30)
        except subprocess.TimeoutExpired:
            bad.append((i, kind, "timeout"))
            continue
        rc = proc.returncode
        outcomes[rc] = outcomes.get(rc, 0) + 1
        same_report = rc == before.returncode and proc.stdout == before.stdout
        if rc < 0 or not (rc in (1, 3) or same_report):
            bad.append((i, kind, rc, proc.stdout[-200:], proc.stderr[-300:]))
        elif rc == 3:  # (under ASan, its report of an HDF5 bug comes first)
            assert b"dynaprobe: error: " in proc.stderr, proc.stderr
    assert not bad, f"{len(bad)} mutants misread (outcomes {outcomes}): {bad[:5]}"
    assert outcomes.get(3, 0) > MUTANTS // 4  # most damage is detected, not just survived


def test_a_reader_that_runs_out_of_memory_or_time_is_exit_3_naming_the_file(tmp_path, dynaprobe_cli):
    real_step(tmp_path / "dump")
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--memory-limit", "1")
    assert proc.returncode == 3, proc.stderr
    assert b"dynaprobe: error: " in proc.stderr
    # A step whose comparison takes far longer than the limit (2 x 64 MiB of raw float32), so the
    # reader is still at work when the limit passes however the machine schedules the two.
    big = RNG.standard_normal(16 << 20).astype(np.float32)
    slow = _C.write_step(str(tmp_path / "big"), 0, {"mode": "two_pass"},
                         [rec("layers.0", "fwd_output", side, big) for side in ("eager", "compiled")],
                         [], modules=[("layers.0", {"role": "wrapped"})])
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "big", "--time-limit", "0.001")
    assert proc.returncode == 3, proc.stderr
    assert f"{slow}: reading did not finish within 0.001 s".encode() in proc.stderr or \
        f"{tmp_path / 'big'}: reading did not finish within 0.001 s".encode() in proc.stderr, proc.stderr
    assert run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--time-limit", "0").returncode == 0


def test_only_unfinished_steps_or_an_empty_folder_is_an_error_for_every_command(tmp_path, dynaprobe_cli):
    (tmp_path / "empty").mkdir()
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "step_00000000.h5.partial").write_bytes(b"killed mid-write")
    for command in (["compare"], ["ls"], ["graphs", "-o", tmp_path / "graphs"]):
        proc = run_cli(dynaprobe_cli, command[0], tmp_path / "empty", *command[1:])
        assert proc.returncode == 3 and b"no step files" in proc.stderr, (command, proc.stderr)
        proc = run_cli(dynaprobe_cli, command[0], tmp_path / "killed", *command[1:])
        assert proc.returncode == 3, (command, proc.stderr)
        assert b"no committed step, only 1 unfinished one(s) (step_00000000.h5.partial)" in proc.stderr
        assert b"RESULT" not in proc.stdout


def test_swapped_sides_are_a_usage_error(tmp_path, dynaprobe_cli):
    real_step(tmp_path / "eager", provenance={"mode": "eager_only"}, sides=("eager",))
    real_step(tmp_path / "compiled", provenance={"mode": "compiled_only"}, sides=("compiled",))
    assert run_cli(dynaprobe_cli, "compare", tmp_path / "eager", tmp_path / "compiled").returncode == 1
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "compiled", tmp_path / "eager")
    assert proc.returncode == 2, proc.stdout
    assert b"the two sides look swapped" in proc.stderr and b"give the eager dump first" in proc.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "-0.5"])
def test_tolerance_that_is_not_a_finite_non_negative_number_is_refused(tmp_path, dynaprobe_cli, value):
    real_step(tmp_path / "dump")
    for option in ("--atol", "--rtol"):
        proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", f"{option}={value}")
        assert proc.returncode == 2, (option, value, proc.stdout, proc.stderr)
        assert b"RESULT" not in proc.stdout


def test_names_with_control_characters_or_invalid_utf8_are_escaped(tmp_path, dynaprobe_cli):
    x = RNG.standard_normal(4).astype(np.float32)
    # h5py writes the damaged name: dynaprobe's own writer refuses nothing here, but a file can
    # hold any bytes.
    real_step(tmp_path / "dump")
    step = tmp_path / "dump" / "step_00000000.h5"
    evil = "evil\nname\u0085"
    _C.write_step(str(tmp_path / "named"), 0, {"mode": "two_pass", "note\x01": "v\nw"},
                  [rec(evil, "fwd_output", "eager", x), rec(evil, "fwd_output", "compiled", x + 1)])
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "named", "--json", tmp_path / "r.json",
                   "--csv", tmp_path / "r.csv")
    assert proc.returncode == 1
    lines = proc.stdout.decode().splitlines()
    assert any(line.startswith("  FAIL  evil\\x0Aname\\xC2\\x85 ") for line in lines), lines
    report = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert report["ranks"][0]["steps"][0]["rows"][0]["module"] == "evil\\x0Aname\\xC2\\x85"
    assert report["ranks"][0]["provenance"]["eager"]["note\\x01"] == "v\\x0Aw"
    assert (tmp_path / "r.csv").read_text().splitlines()[2].startswith("evil\\x0Aname\\xC2\\x85,fwd_output,0,FAIL,")
    # Invalid UTF-8 in a module name, as a crafted /index (checksum recomputed) may hold it.
    def rename(index):
        for row in index:
            if row["module"] == b"layers.1":
                row["module"] = b"layers.\xcf"

    rewrite_index(step, rename)
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--json", tmp_path / "d.json")
    assert proc.returncode == 0, proc.stderr  # both sides renamed alike: still a pair
    text = (tmp_path / "d.json").read_bytes()
    report = json.loads(text.decode("utf-8"))  # valid UTF-8 and valid JSON
    assert b"\xcf" not in text and b"\xcf" not in proc.stdout
    assert "layers.\\xCF" in {row["module"] for row in report["ranks"][0]["steps"][0]["rows"]}
    assert b"  pass  layers.\\xCF " in proc.stdout
    proc = run_cli(dynaprobe_cli, "ls", tmp_path / "named")
    assert proc.returncode == 0 and b"evil\\x0Aname\\xC2\\x85" in proc.stdout and b"evil\n" not in proc.stdout


def test_the_index_checksum_is_the_documented_one(tmp_path):
    assert xxh64(b"") == 0xEF46DB3751D8E999 and xxh3(b"") == 0x2D06800538D394C2
    step = real_step(tmp_path / "dump")
    with h5py.File(step) as f:
        assert int(f["index"].attrs["checksum"]) == index_checksum(f)
        assert len(f["chunk_hashes"]) > 0  # the raw multi-chunk record's chunks


def test_damage_to_a_compressed_chunk_is_found_before_zstd_sees_it(tmp_path, dynaprobe_cli):
    # Format 2.0 reads compressed chunks without zstd's content checksum (their stored bytes are
    # checked against their XXH3 first): damage to any byte of the frame, its last four (the
    # content checksum zstd would have verified) included, is still exit 3 naming the chunk.
    for where in ("payload", "content_checksum"):
        step = real_step(tmp_path / where)
        with h5py.File(step) as f:
            chunks = f["tensors/layers.0/fwd_output.eager.0.0"]
            assert chunks.id.get_num_chunks() > 1
            info = chunks.id.get_chunk_info(1)
            assert info.filter_mask == 0  # shuffled and compressed
        data = bytearray(step.read_bytes())
        offset = info.byte_offset + (info.size // 2 if where == "payload" else info.size - 1)
        data[offset] ^= 0x01
        step.write_bytes(bytes(data))
        proc = run_cli(dynaprobe_cli, "compare", tmp_path / where)
        assert proc.returncode == 3, proc.stdout
        assert b"fwd_output.eager.0.0: chunk 1 is corrupt" in proc.stderr, proc.stderr
        assert b"XXH3 in /chunk_hashes" in proc.stderr, proc.stderr


def rewrite_index(step, change, version=None, reseal=True):
    """Changes /index with h5py; `reseal` recomputes its checksum, as a crafted file would."""
    with h5py.File(step, "r+") as f:
        index = widened(f["index"][()], module=32, kind=32)
        change(index)
        del f["index"]
        f.create_dataset("index", data=index)
        if version:
            set_text_attribute(f, "dynaprobe_format_version", version)
        if reseal:
            f["index"].attrs.create("checksum", index_checksum(f), dtype="<u8")


def test_damage_to_a_chunk_stored_as_it_is_or_to_the_index_is_found(tmp_path, dynaprobe_cli):
    # A bit flipped in a raw chunk (no zstd checksum) of a multi-chunk record: exit 3 naming the
    # chunk, never numbers read as real.
    step = real_step(tmp_path / "data")
    with h5py.File(step) as f:
        chunks = f["tensors/layers.0/fwd_input.eager.0.0"]
        assert chunks.id.get_num_chunks() > 1
        info = chunks.id.get_chunk_info(1)
        assert info.filter_mask == 0b11  # stored as it is
    data = bytearray(step.read_bytes())
    data[info.byte_offset + 100] ^= 0x01
    step.write_bytes(bytes(data))
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "data")
    assert proc.returncode == 3, proc.stdout
    assert b"fwd_input.eager.0.0: chunk 1 is corrupt" in proc.stderr and b"/chunk_hashes" in proc.stderr
    # The tolerance in the provenance changed in place: the index checksum covers it.
    step = real_step(tmp_path / "provenance")
    with h5py.File(step, "r+") as f:
        f.attrs["atol"] = "1.0"
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "provenance")
    assert proc.returncode == 3 and b"damaged /index: its XXH3 checksum does not match" in proc.stderr
    # A row changed without resealing.
    step = real_step(tmp_path / "row")
    def shrink(index):
        index["stored_bytes"][0] = 1

    rewrite_index(step, shrink, reseal=False)
    assert run_cli(dynaprobe_cli, "compare", tmp_path / "row").returncode == 3


def test_damaged_index_is_reported_as_damage_not_as_a_newer_version(tmp_path, dynaprobe_cli):
    def blank_kind(index):
        index[0]["kind"] = b""

    step = real_step(tmp_path / "damaged")
    rewrite_index(step, blank_kind)
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "damaged")
    assert proc.returncode == 3, proc.stdout
    assert b"damaged /index" in proc.stderr and b"newer" not in proc.stderr
    assert str(step).encode() in proc.stderr
    assert run_cli(dynaprobe_cli, "ls", tmp_path / "damaged").returncode == 3

    def new_kind(index):
        index[0]["kind"] = b"activation"

    step = real_step(tmp_path / "newer")
    rewrite_index(step, new_kind, version="2.9")
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "newer")
    assert b"unknown kind 'activation', written by a newer dynaprobe (format 2.9)" in proc.stderr
    assert proc.returncode == 1  # the rest is compared


def test_graphs_never_write_through_a_link_and_long_names_fit(tmp_path, dynaprobe_cli):
    x = RNG.standard_normal(4).astype(np.float32)
    name = "__compiled_fn_1.Forward_Graph.abcd"
    long_name = "__compiled_fn_2.Forward_Graph." + "x" * 300
    _C.write_step(str(tmp_path / "dump"), 0, {"mode": "two_pass"},
                  [rec("m", "fwd_output", "eager", x), rec("m", "fwd_output", "compiled", x)],
                  [(name, "forward", "def f(): pass\n", {}), (long_name, "forward", "def g(): pass\n", {})])
    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "outside.py"
    outside.write_text("precious")
    (out / f"{name}.py").symlink_to(outside)
    proc = run_cli(dynaprobe_cli, "graphs", tmp_path / "dump", "-o", out)
    assert proc.returncode == 3 and b"symbolic link" in proc.stderr, proc.stderr
    assert outside.read_text() == "precious"
    (out / f"{name}.py").unlink()
    proc = run_cli(dynaprobe_cli, "graphs", tmp_path / "dump", "-o", out)
    assert proc.returncode == 0, proc.stderr
    written = sorted(p.name for p in out.iterdir())
    assert f"{name}.py" in written and len(written) == 2
    assert all(len(p) <= 255 for p in written) and any(p.startswith("__compiled_fn_2.Forward_Graph.xxx") for p in written)


IN_PROCESS = r"""
import random, shutil, sys
from pathlib import Path
import dynaprobe
from dynaprobe import _C

original, folder, regions = Path(sys.argv[1]), Path(sys.argv[2]), eval(sys.argv[3])
data = original.read_bytes()
rng = random.Random(17)
outcomes = {"read": 0, "error": 0}
for i in range(300):
    start, size = regions[i % len(regions)]
    damaged = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        damaged[start + rng.randrange(size)] ^= 1 << rng.randrange(8)
    (folder / "step_00000000.h5").write_bytes(bytes(damaged))
    path = str(folder / "step_00000000.h5")
    try:
        info = _C.read_step(path)
        for r in info["records"]:
            if r["stored"]:
                _C.read_record(path, r["module"], r["call"], r["kind"], r["tensor_index"], r["side"])
        _C.compare(str(folder), str(folder))
        outcomes["read"] += 1
    except (dynaprobe.FormatError, dynaprobe.DumpIOError):
        outcomes["error"] += 1
print(outcomes)
"""


def test_damaged_format_2_files_read_in_process_raise_clean_errors(tmp_path):
    """The damage that crashed libhdf5 1.10 in-process in format 1 (flipped bytes in /index's
    strings, attribute values, graph text: variable-length data in the unchecksummed global heap)
    is, in format 2.0, a FormatError raised to Python: no crash, no other exception. Run in a
    child Python so that a crash fails this test instead of killing the test session."""
    step = real_step(tmp_path / "original")
    with h5py.File(step) as f:
        regions = [(f[name].id.get_offset(), f[name].id.get_storage_size())
                   for name in ("index", "chunk_hashes", "graphs/__compiled_fn_1.Forward_Graph.abcd")]
        assert all(offset and size for offset, size in regions)
    data = step.read_bytes()
    assert b"GCOL" not in data  # no global heap collection: nothing variable-length at all
    regions.append((0, len(data)))  # and anywhere: object headers, B-trees, chunks
    folder = tmp_path / "mutant"
    folder.mkdir()
    proc = subprocess.run([os.sys.executable, "-c", IN_PROCESS, str(step), str(folder), repr(regions)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]  # a signal is a negative return code
    outcomes = eval(proc.stdout.strip().splitlines()[-1])
    assert outcomes["error"] > 200, outcomes  # damage to checksummed bytes is found


def test_a_reader_of_the_output_that_goes_away_is_not_called_damage(tmp_path, dynaprobe_cli):
    # `dynaprobe compare | head -1`: the contained reader dies of SIGPIPE; that says nothing about the
    # file, so no "damaged" error, and the exit status is the shell's for SIGPIPE.
    # 3,000 modules: a report far larger than a pipe's buffer, so the writer is still writing.
    value = np.ones(4, np.float32)
    names = [f"layers.{i}" for i in range(3000)]
    _C.write_step(str(tmp_path / "dump"), 0, {"mode": "two_pass"},
                  [rec(n, "fwd_output", side, value) for n in names for side in ("eager", "compiled")],
                  [], modules=[(n, {"role": "wrapped"}) for n in names])
    proc = subprocess.Popen([str(dynaprobe_cli), "compare", str(tmp_path / "dump")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after the first line
    stderr = proc.stderr.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGPIPE, stderr
    assert b"damaged" not in stderr and b"crashed" not in stderr, stderr
