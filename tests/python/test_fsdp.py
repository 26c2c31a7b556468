"""FSDP2 on CPU: two processes (gloo), fully_shard on each block and the root, single-pass.

Each test spawns its ranks itself (torch.multiprocessing, spawn) and joins them with a timeout, so a
hanging rank fails the test instead of the suite. The ranks write what they saw to JSON files; the
assertions run here, in the test process.
"""

import csv
import datetime
import io
import json
import math
import os
import socket
import subprocess
import sys
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from models import Block, TinyTransformer, perturbed_gelu_backend
from torch.distributed.fsdp import fully_shard

from dynaprobe import _C, PrecisionChecker

WORLD = 2
VOCAB, WIDTH, HEADS, BATCH, SEQ = 32, 16, 2, 2, 8
MERGED_HEADER = ("rank,scenario,module_name,check_type,tensor_index,status,max_abs_diff,"
                 "mean_abs_diff,max_rel_diff,shape,note")
# Block's parameters in order, with their full shapes (FSDP2 shards dim 0 between the 2 ranks).
BLOCK_PARAMS = [
    ("norm1.weight", (16,)), ("norm1.bias", (16,)),
    ("attn.in_proj_weight", (48, 16)), ("attn.in_proj_bias", (48,)),
    ("attn.out_proj.weight", (16, 16)), ("attn.out_proj.bias", (16,)),
    ("norm2.weight", (16,)), ("norm2.bias", (16,)),
    ("mlp.up.weight", (32, 16)), ("mlp.up.bias", (32,)),
    ("mlp.down.weight", (16, 32)), ("mlp.down.bias", (16,)),
]


# --------------------------------------------------------------------------- harness
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker, out, timeout: float, linger_ok=()):
    """Runs worker(rank, out) in WORLD spawned processes; returns their exit codes. Ranks in
    ``linger_ok`` may still be running once the others are done: they are killed then."""
    port = _free_port()
    context = mp.get_context("spawn")
    processes = [context.Process(target=_entry, args=(worker, rank, port, str(out)))
                 for rank in range(WORLD)]
    for p in processes:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for rank, p in enumerate(processes):
            if rank in linger_ok:
                continue
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                pytest.fail(f"rank {rank} still running after {timeout} s: a hang")
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [p.exitcode for p in processes]


def _entry(worker, rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on a small machine
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    os.chdir(out)
    summary = {"rank": rank}
    try:
        worker(rank, summary)
    except BaseException as error:  # reported to the test through the summary
        summary["error"] = f"{type(error).__name__}: {error}"
        summary["traceback"] = traceback.format_exc()
        raise
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(summary, f, indent=1)
    dist.destroy_process_group()


def _summaries(out):
    summaries = []
    for rank in range(WORLD):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no summary"
        summaries.append(json.loads(path.read_text()))
    return summaries


def _sharded_model(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    model = TinyTransformer(vocab=VOCAB, width=WIDTH, heads=HEADS, layers=2)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, targets


def _loss(model, rank: int, step: int):
    ids, targets = _batch(rank, step)
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def _rows(result):
    return [{"module": r.module, "check_type": r.check_type, "index": r.tensor_index,
             "status": r.status, "note": r.note, "reason": r.reason, "label": r.label,
             "shape": list(r.shape) if r.shape is not None else None} for r in result]


# --------------------------------------------------------------------------- the training run
def _train_worker(rank: int, summary: dict) -> None:
    """The scenarios one after the other in the same processes: core (2 steps with the
    optimizer), bf16 (cast_dtype), ignore (blocks.0 ignored) and gelu (a backend that computes
    GELU 1% off, left out of the merged CSV)."""
    results = []
    for scenario, options in (("core", {}), ("bf16", {"cast_dtype": torch.bfloat16}),
                              ("ignore", {}), ("gelu", {"backend": perturbed_gelu_backend})):
        model = _sharded_model()
        # core: the default run folder, which the ranks agree on; the others name theirs.
        dump_dir = None if scenario == "core" else f"run_{scenario}"
        checker = PrecisionChecker(scenario=scenario, dump_dir=dump_dir, **options)
        checker.wrap_by_policy(model, (Block,))
        if scenario == "ignore":
            checker.ignore(model.blocks[0])
        checker.install(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        info = summary[scenario] = {"run_dir": checker.run_dir, "dump_dir": checker.dump_dir}
        for step in range(2 if scenario == "core" else 1):
            optimizer.zero_grad()
            loss = _loss(model, rank, step)
            loss.backward()
            result = checker.collect(loss)
            if step == 0:
                if scenario != "gelu":
                    results.append(result)
                info["rows"] = _rows(result)
                info["all_pass"] = result.all_pass
                csv_name = ("precision_rank{}.csv" if scenario == "core"
                            else f"precision_{scenario}_rank{{}}.csv").format(rank)
                checker.report(result, csv_path=csv_name)
                info["csv"] = csv_name
                if scenario == "core":
                    info.update(_check_gradients(model, result, rank))
            optimizer.step()
            info.setdefault("losses", []).append(loss.item())
        checker.uninstall()
    merged = checker.gather_report(results, csv_path="merged.csv", timeout=60)
    summary["gather_report_returned_text"] = merged is not None


def _check_gradients(model, result, rank: int) -> dict:
    """The training step is the one FSDP2 computes without the checker, and the param_grad
    records are what the docs say: this rank's shard of the gradient of its own batch."""
    torch.manual_seed(0)
    reference = TinyTransformer(vocab=VOCAB, width=WIDTH, heads=HEADS, layers=2)
    local = {}  # the gradient of this rank's batch alone, full parameters
    averaged = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}
    for r in range(WORLD):  # FSDP2's .grad: the mean over the ranks' batches
        reference.zero_grad()
        _loss(reference, r, 0).backward()
        for name, p in reference.named_parameters():
            averaged[name] += p.grad / WORLD
            if r == rank:
                local[name] = p.grad.clone()
    training_diff = 0.0
    for name, p in model.named_parameters():
        start = p.to_local().shape[0] * rank
        expected = averaged[name][start:start + p.to_local().shape[0]]
        training_diff = max(training_diff, (p.grad.to_local() - expected).abs().max().item())
    record_diff, records = 0.0, 0
    for index, (name, shape) in enumerate(BLOCK_PARAMS):
        for side in ("compiled", "eager"):
            dtype, shape_read, data = _C.read_record(result.dump_file, "blocks.1", 0, "param_grad",
                                                     index, side)
            got = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape_read)
            rows = shape[0] // WORLD
            expected = local[f"blocks.1.{name}"][rows * rank:rows * (rank + 1)]
            record_diff = max(record_diff, (got - expected).abs().max().item())
            records += 1
    return {"training_grad_diff": training_diff, "param_grad_record_diff": record_diff,
            "param_grad_records": records,
            "grads_are_shards": all(p.grad.to_local().shape == p.to_local().shape
                                    for p in model.parameters())}


def _parse(text: str):
    return list(csv.reader(io.StringIO(text)))


def _expected_block_rows(rank: int, block: str):
    """(module, check_type, tensor_index, shape) of one compared block, in report order."""
    rows = [(block, "fwd_input", "0", f"({BATCH}, {SEQ}, {WIDTH})"),
            (block, "fwd_input", "1", f"({SEQ}, {SEQ})"),  # the attention mask (a keyword)
            (block, "fwd_output", "0", f"({BATCH}, {SEQ}, {WIDTH})"),
            (block, "fwd_output", "1", f"({BATCH}, {SEQ}, {SEQ})"),
            (block, "grad_input", "0", f"({BATCH}, {SEQ}, {WIDTH})"),
            (block, "grad_output", "0", f"({BATCH}, {SEQ}, {WIDTH})")]
    for index, (_, shape) in enumerate(BLOCK_PARAMS):
        shard = (shape[0] // WORLD,) + shape[1:]
        rows.append((block, "param_grad", str(index),
                     "(" + ", ".join(map(str, shard)) + ("," if len(shard) == 1 else "") + ")"))
    return rows


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    exit_codes = _spawn(_train_worker, out, timeout=240)
    summaries = _summaries(out)
    for summary in summaries:
        assert "error" not in summary, summary.get("traceback")
    assert exit_codes == [0] * WORLD
    return out, summaries


def test_each_rank_dumps_into_one_shared_run_folder(fsdp_run):
    out, summaries = fsdp_run
    for scenario in ("core", "bf16", "ignore"):
        run_dirs = {s[scenario]["run_dir"] for s in summaries}
        assert len(run_dirs) == 1, f"{scenario}: the ranks wrote to different run folders"
        run_dir = out / run_dirs.pop()
        assert sorted(os.listdir(run_dir)) == ["rank0", "rank1"]
        for rank in range(WORLD):
            steps = sorted(f for f in os.listdir(run_dir / f"rank{rank}") if f.startswith("step_"))
            assert steps == ["step_00000000.h5", "step_00000001.h5"][:2 if scenario == "core" else 1]
            provenance = _C.read_step(str(run_dir / f"rank{rank}" / steps[0]))["provenance"]
            assert provenance["rank"] == str(rank) and provenance["world_size"] == str(WORLD)
            assert provenance["scenario"] == scenario and provenance["mode"] == "single_pass"
            assert provenance["cast_dtype"] == ("torch.bfloat16" if scenario == "bf16" else "None")
    # The default folder (core) is rank 0's name; the named ones (dump_dir) are run folders.
    assert summaries[0]["core"]["run_dir"].startswith("dynaprobe_runs" + os.sep)
    assert summaries[1]["bf16"]["dump_dir"] == os.path.join("run_bf16", "rank1")


def test_a_full_train_step_is_fsdp2s_own_and_every_record_compares(fsdp_run):
    _, summaries = fsdp_run
    for rank, summary in enumerate(summaries):
        core = summary["core"]
        assert core["all_pass"], [r for r in core["rows"] if r["status"] != "PASS"]
        # The checker changed nothing in training: FSDP2's sharded .grad is the reference mean.
        assert core["grads_are_shards"]
        assert core["training_grad_diff"] < 1e-5
        assert len(core["losses"]) == 2 and all(math.isfinite(x) for x in core["losses"])
        # param_grad: this rank's shard of its own batch's gradient, on both sides.
        assert core["param_grad_records"] == 2 * len(BLOCK_PARAMS)
        assert core["param_grad_record_diff"] < 1e-5
        kinds = {(r["module"], r["check_type"]) for r in core["rows"]}
        for block in ("blocks.0", "blocks.1"):
            for kind in ("fwd_input", "fwd_output", "grad_input", "grad_output", "param_grad"):
                assert (block, kind) in kinds, (rank, block, kind)
        labels = [r["label"] for r in core["rows"]
                  if r["module"] == "blocks.0" and r["check_type"] == "param_grad"]
        half = 24 * rank
        assert labels[2] == (f"attn.in_proj_weight (shard [{half}:{half + 24}] of (48, 16), "
                             "this rank's batch, before reduce-scatter)")


def test_a_compile_difference_fails_on_every_rank(fsdp_run):
    _, summaries = fsdp_run
    for summary in summaries:
        gelu = summary["gelu"]
        assert not gelu["all_pass"]
        status = {(r["module"], r["check_type"], r["index"]): r["status"] for r in gelu["rows"]}
        assert status[("blocks.0", "fwd_input", 0)] == "PASS"  # the first block's input: same
        for block in ("blocks.0", "blocks.1"):
            assert status[(block, "fwd_output", 0)] == "FAIL"
            assert status[(block, "param_grad", 8)] == "FAIL"  # mlp.up.weight: GELU's backward
            # norm1.weight: within tolerance, but the GELU's difference reaches it in the
            # backward: the block's output failed, so it got an fp64 reference, whose verdict
            # decides (a divergence, not noise).
            assert status[(block, "param_grad", 0)] == "FAIL"


def test_a_failing_fsdp2_module_names_what_to_do_instead_of_a_repro(fsdp_run, tmp_path):
    """FSDP2's full parameters exist only while a block runs: the dump says why it keeps no
    replay data, and the repro and bisect tools print it, with the alternative."""
    out, summaries = fsdp_run
    dump_dir = os.path.join(out, summaries[0]["gelu"]["dump_dir"])
    for tool in ("repro", "bisect"):
        command = [sys.executable, "-m", f"dynaprobe.{tool}", dump_dir, "--module", "blocks.0"]
        if tool == "repro":
            command += ["-o", str(tmp_path / "repro")]
        made = subprocess.run(command, capture_output=True, text=True)
        assert made.returncode == 2, made.stdout + made.stderr
        assert "the module blocks.0 is sharded by FSDP2 (fully_shard)" in made.stderr
        assert "full_state_dict=True" in made.stderr
    assert not (tmp_path / "repro").exists()


def test_per_rank_csv_files(fsdp_run):
    out, summaries = fsdp_run
    for rank, summary in enumerate(summaries):
        assert summary["core"]["csv"] == f"precision_rank{rank}.csv"
        rows = _parse((out / f"precision_rank{rank}.csv").read_text())
        assert rows[0] == ["module_name", "check_type", "tensor_index", "status", "max_abs_diff",
                           "mean_abs_diff", "max_rel_diff", "shape", "note"]
        assert rows[1][:4] == ["LOSS", "loss", "0", "PASS"] and rows[1][8] == "single_pass mode"
        expected = _expected_block_rows(rank, "blocks.0") + _expected_block_rows(rank, "blocks.1")
        assert [(r[0], r[1], r[2], r[7]) for r in rows[2:]] == expected
        assert all(r[3] == "PASS" for r in rows[1:])
        ignore_rows = _parse((out / f"precision_ignore_rank{rank}.csv").read_text())
        assert ignore_rows[2] == ["blocks.0", "note", "0", "SKIP", "", "", "", "", "IGNORED"]


def test_merged_csv_row_by_row(fsdp_run):
    out, summaries = fsdp_run
    assert [s["gather_report_returned_text"] for s in summaries] == [True, False]
    rows = _parse((out / "merged.csv").read_text())
    assert ",".join(rows[0]) == MERGED_HEADER
    body = rows[1:]
    # Scenario by scenario (the order given to gather_report), rank by rank within each.
    expected_keys = []
    for scenario in ("core", "bf16", "ignore"):
        for rank in range(WORLD):
            expected_keys.append((str(rank), scenario, "LOSS", "loss", "0", None))
            if scenario == "ignore":
                expected_keys.append((str(rank), scenario, "blocks.0", "-", "0", ""))
            for block in (("blocks.1",) if scenario == "ignore" else ("blocks.0", "blocks.1")):
                expected_keys += [(str(rank), scenario, *row)
                                  for row in _expected_block_rows(rank, block)]
    assert len(body) == len(expected_keys)
    for row, (rank, scenario, module, kind, index, shape) in zip(body, expected_keys):
        assert row[:5] == [rank, scenario, module, kind, index], row
        if shape is not None:
            assert row[9] == shape, row
    for row in body:
        if row[2] == "LOSS":
            assert row[3:] == ["loss", "0", "PASS", "N/A", "N/A", "N/A", row[9], "single_pass mode"]
            assert row[9].startswith("compiled=")
        elif row[3] == "-":  # the spec's multi-rank example, exactly
            assert row[2:] == ["blocks.0", "-", "0", "SKIP", "N/A", "N/A", "N/A", "", "IGNORED"]
        else:
            assert row[5] == "PASS", row
            assert all(float(x) >= 0 for x in row[6:9])
            # bf16 (cast_dtype): a float32 reference decides each compared row, said in the note
            # (inputs and grad_outputs are shared by the sides in single-pass: no reference).
            if row[1] == "bf16" and row[3] in ("fwd_output", "grad_input", "param_grad"):
                assert row[10].startswith("fp32: noise, "), row
            else:
                assert row[10] == "", row
    # Each rank's rows are its own CSV's rows (core: no note rows, so the columns agree).
    for rank in range(WORLD):
        own = _parse((out / f"precision_rank{rank}.csv").read_text())[1:]
        assert [r[2:] for r in body if r[:2] == [str(rank), "core"]] == own


def test_cli_merged_csv_of_each_run_folder_matches(fsdp_run, dynaprobe_cli):
    out, summaries = fsdp_run
    python_rows = _parse((out / "merged.csv").read_text())[1:]
    for scenario in ("core", "bf16", "ignore"):
        run_dir = out / summaries[0][scenario]["run_dir"]
        target = out / f"cli_{scenario}.csv"
        cli = subprocess.run([dynaprobe_cli, "compare", str(run_dir), "--step", "0",
                              "--merged-csv", str(target)], capture_output=True, text=True)
        assert cli.returncode in (0, 1), cli.stderr  # 1: something FAILs (bf16 may)
        assert cli.stdout.startswith(f"Summary: {WORLD} steps on {WORLD} ranks, ")
        cli_rows = _parse(target.read_text())
        assert ",".join(cli_rows[0]) == MERGED_HEADER
        assert cli_rows[1:] == [r for r in python_rows if r[1] == scenario]


# --------------------------------------------------------------------------- failures
class FlakyBlock(Block):
    """A Block whose eager path raises on the ranks that set ``fail_eager``."""

    fail_eager = False

    def forward(self, x, attn_mask=None):
        if self.fail_eager and not torch.compiler.is_compiling():
            raise RuntimeError(f"eager path broken on rank {dist.get_rank()}")
        return super().forward(x, attn_mask)


def _failure_worker(rank: int, summary: dict) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, width=WIDTH, heads=HEADS, layers=2)
    model.blocks[1] = FlakyBlock(WIDTH, HEADS)
    model.blocks[1].fail_eager = rank == 1
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

    # Two-pass deep-copies the model, which FSDP2 forbids: a clear error, before any collective.
    two_pass = PrecisionChecker(single_pass=False)
    two_pass.wrap_by_policy(model, (Block,))
    for call in (lambda: two_pass.compare(lambda m: _loss(m, rank, 0), model),
                 lambda: two_pass.install(model)):
        try:
            call()
        except RuntimeError as error:
            summary.setdefault("two_pass_errors", []).append(str(error))

    # Wrapping a module that holds fully_shard units: installs, with a warning that their
    # parameters' gradients are not compared.
    nested = PrecisionChecker(dump_dir="nested")
    nested.wrap(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nested.install(model)
    nested.uninstall()
    summary["nested_warnings"] = [str(w.message) for w in caught if "dynaprobe" in str(w.message)]

    # The eager re-run failing on rank 1 only: caught there, so every rank runs the same
    # collectives and the training step completes on both.
    checker = PrecisionChecker(dump_dir="run")
    checker.wrap_by_policy(model, (Block,))
    checker.install(model)
    loss = _loss(model, rank, 0)
    loss.backward()
    result = checker.collect(loss)
    summary["rows"] = _rows(result)
    summary["all_pass"] = result.all_pass
    summary["grads"] = all(p.grad is not None for p in model.parameters())
    if rank == 1:
        # Then rank 1's own code fails before gather_report(); it stays alive (a stuck rank):
        # rank 0 must not wait for it forever.
        summary["failed"] = True
        with open("rank1.json", "w") as f:
            json.dump(summary, f)
        time.sleep(120)
        return
    start = time.monotonic()
    try:
        checker.gather_report(result, csv_path="merged.csv", timeout=5)
    except RuntimeError as error:
        summary["gather_error"] = str(error)
    summary["gather_seconds"] = time.monotonic() - start


def test_a_failing_rank_does_not_hang_the_others(tmp_path):
    exit_codes = _spawn(_failure_worker, tmp_path, timeout=120, linger_ok=(1,))
    rank0, rank1 = _summaries(tmp_path)
    assert "error" not in rank0, rank0.get("traceback")
    assert "error" not in rank1, rank1.get("traceback")
    assert exit_codes[0] == 0

    for summary in (rank0, rank1):
        assert len(summary["two_pass_errors"]) == 2
        for message in summary["two_pass_errors"]:
            assert "FSDP2" in message and "single_pass=True" in message
        assert summary["grads"]  # the training step finished on both ranks
        assert summary["nested_warnings"] == [
            "dynaprobe: wrapped module FSDPTinyTransformer contains fully_shard units (blocks.0, "
            "blocks.1): the gradients of their parameters are not compared (they are sharded when "
            "it is called); wrap the fully_shard units themselves to compare them"]

    assert rank0["all_pass"]
    assert not rank1["all_pass"]
    errors = [r for r in rank1["rows"] if r["note"] == "HOOK_ERROR"]
    assert [r["module"] for r in errors] == ["blocks.1"]
    assert "eager path broken on rank 1" in errors[0]["reason"]

    # Rank 0 gave up after its timeout, saying which rank did not come.
    message = rank0["gather_error"]
    assert "not all 2 ranks reached gather_report() within 5 s" in message
    assert "Ranks 1 failed to pass monitoredBarrier" in message
    assert 4 <= rank0["gather_seconds"] < 60
    assert not (tmp_path / "merged.csv").exists()


# --------------------------------------------------------------------------- the example
def test_the_example_runs_spawned_and_its_run_folders_merge(tmp_path, dynaprobe_cli):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    example = os.path.join(repo, "examples", "fsdp2_multirank.py")
    run = subprocess.run([sys.executable, example, str(tmp_path)], capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ALL RANKS PASS" in run.stdout
    for scenario in ("core", "bf16"):
        for rank in range(WORLD):
            rows = _parse((tmp_path / f"precision_{scenario}_rank{rank}.csv").read_text())
            assert rows[1][:4] == ["LOSS", "loss", "0", "PASS"]
    merged = _parse((tmp_path / "precision_merged.csv").read_text())
    assert ",".join(merged[0]) == MERGED_HEADER
    sections = [r[:2] for r in merged[1:] if r[2] == "LOSS"]  # each rank's rows start with LOSS
    assert sections == [["0", "core"], ["1", "core"], ["0", "bf16"], ["1", "bf16"]]
    # The example reports each scenario's last step (1): the CLI merges its run folder the same.
    runs = sorted(os.listdir(tmp_path / "dynaprobe_runs"))
    assert len(runs) == 2
    for scenario, run_name in zip(("core", "bf16"), runs):
        target = tmp_path / f"cli_{scenario}.csv"
        cli = subprocess.run([dynaprobe_cli, "compare", str(tmp_path / "dynaprobe_runs" / run_name),
                              "--step", "1", "--merged-csv", str(target)], capture_output=True,
                             text=True)
        assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr
        assert _parse(target.read_text())[1:] == [r for r in merged[1:] if r[1] == scenario]


# --------------------------------------------------------------------------- one process
def test_a_failing_eager_backward_is_a_warning_and_training_goes_on(tmp_path):
    """An error in the eager backward (run inside the training backward) must not reach the
    training backward: on one rank of an FSDP2 job it would leave the others waiting."""

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("eager backward is broken")

    class OnlyCompiledBackward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.linear(x)
            return y if torch.compiler.is_compiling() else Boom.apply(y)

    torch._dynamo.reset()
    model = torch.nn.Sequential(OnlyCompiledBackward(), torch.nn.Linear(4, 2))
    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    checker.wrap(model[0])
    checker.install(model)
    x = torch.randn(3, 4, requires_grad=True)
    loss = model(x).pow(2).mean()
    loss.backward()  # the training backward succeeds
    assert model[0].linear.weight.grad is not None and x.grad is not None
    result = checker.collect(loss)
    checker.uninstall()
    notes = [r for r in result if r.note == "HOOK_ERROR"]
    assert [r.module for r in notes] == ["0"]
    assert "eager backward failed: RuntimeError: eager backward is broken" in notes[0].reason
    assert not result.all_pass
