"""From a failing row to a fix: what the dump keeps of a call for replaying it (replay=), the
standalone repro folder (python -m dynaprobe.repro) and the stage bisection (checker.bisect,
python -m dynaprobe.bisect). docs/guide/diagnosis.md, From a failing row to a repro."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from functorch.compile import default_partition
from models import BACKWARD_FAULT, TiedTwice, _perturb_gelu, perturbed_gelu_backend, plain_compiler
from models import Stage as TanhStage
from test_storage import Chain  # norm -> mlp (GELU, perturbed by the backend) -> proj
from torch._dynamo.backends.common import aot_autograd

from dynaprobe import _C, PrecisionChecker
from dynaprobe._offline.replay import ClassReplay, GraphReplay, load_call, tensor_from_bytes
from dynaprobe.bisect import STAGES, Stage, bisect_call


def checked_step(tmp_path, backend=perturbed_gelu_backend, **kwargs):
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(8, 16)
    checker = PrecisionChecker(backend=backend, dump_dir=str(tmp_path / "dump"), **kwargs)
    checker.wrap_all_children(model, depth=0)

    def step(m):
        loss = m(x).square().sum()
        loss.backward()
        return loss

    result = checker.compare(step, model)
    return checker, model, result


def replay_records(step_file):
    return [r for r in _C.read_step(step_file)["records"] if r["kind"] == "replay"]


def read(step_file, record):
    return tensor_from_bytes(*_C.read_record(step_file, record["module"], record["call"],
                                             record["kind"], record["tensor_index"],
                                             record["side"]))


def test_a_failing_call_keeps_inputs_weights_grad_output_and_structure(tmp_path):
    checker, model, result = checked_step(tmp_path, dump="failing")
    assert {r.module for r in result.rows if r.status == "FAIL"} >= {"mlp"}
    records = replay_records(result.dump_file)
    assert {r["module"] for r in records} == {"mlp"}  # only the call whose output fails
    assert all(r["stored"] and r["side"] == "compiled" for r in records)
    labels = {r["label"]: r for r in records}
    # Two ways to replay it: the module's class with the call's inputs, and the graph Dynamo
    # captured (its parameters by name, its input, the gradient its output received, the RNG).
    # The graph's input is kept as its own argument: which index depends on what Dynamo lifts
    # before it (one size it marked dynamic after an earlier compile in the process adds one).
    graph_args = {label for label in labels if label.startswith("graph_arg:0.")}
    assert len(graph_args) == 1, labels
    assert set(labels) - graph_args == {
        "input:0", "param:up.weight", "param:up.bias", "param:down.weight", "param:down.bias",
        "rng:cpu", "structure:pickle", "grad_output:0", "graph_grad:0.0", "graph_rng:0.cpu"}
    assert torch.equal(read(result.dump_file, labels["param:up.weight"]), model.mlp.up.weight)
    # The input is norm's output: recomputed here from the seed's input.
    torch.manual_seed(0)
    Chain()
    x = torch.randn(8, 16)
    assert torch.equal(read(result.dump_file, labels["input:0"]), model.norm(x).detach())
    graph_input = read(result.dump_file, labels[next(iter(graph_args))])
    assert torch.equal(graph_input, model.norm(x).detach())
    assert read(result.dump_file, labels["grad_output:0"]).shape == (8, 16)
    info = dict(_C.read_step(result.dump_file)["modules"])
    replay = json.loads(info["mlp"]["replay"])
    assert replay["class"] == "models.MLP"
    assert replay["backend"] == {"import": "models:perturbed_gelu_backend"}
    assert replay["calls"]["0"]["leaves"] == [{"tensor": 0, "requires_grad": True}]
    assert replay["calls"]["0"]["grad_mode"] is True
    # The report is unchanged: replay records are never rows.
    assert {r.check_type for r in result.rows} <= {"fwd_input", "fwd_output", "grad_input",
                                                   "grad_output", "param_grad", "note"}


def test_stats_and_two_pass_keep_no_replay_data_and_replay_is_checked(tmp_path):
    _, _, result = checked_step(tmp_path / "stats", dump="stats")
    assert replay_records(result.dump_file) == []
    _, _, result = checked_step(tmp_path / "two_pass", single_pass=False)
    assert replay_records(result.dump_file) == []
    with pytest.raises(ValueError, match="replay='all' needs single_pass=True"):
        PrecisionChecker(single_pass=False, replay="all")
    with pytest.raises(ValueError, match="replay must be None or one of"):
        PrecisionChecker(replay="yes")


def _routes(call):
    """The two replays of a stored call: through the module (its pickle: LayerNorm and the
    test's MLP need constructor arguments) and from its captured graph."""
    return {"class": ClassReplay(call, call.build_module(unpickle=True)),
            "graph": GraphReplay(call)}


def test_replay_of_a_passing_module_reproduces_its_stored_outputs_bit_for_bit(tmp_path):
    checker, model, result = checked_step(tmp_path, backend="aot_eager", replay="all")
    assert result.all_pass
    step_file = result.dump_file
    for name in ("norm", "mlp", "proj"):
        call = load_call(checker.dump_dir, name)
        stored = {(r["side"], r["kind"], r["tensor_index"]): read(step_file, r)
                  for r in _C.read_step(step_file)["records"]
                  if r["module"] == name and r["kind"] in ("fwd_output", "grad_input",
                                                             "param_grad")}
        for route, replay in _routes(call).items():
            runs = {"eager": replay.run(), "compiled": replay.run(call.backend())}
            for side, run in runs.items():
                where = (name, route, side)
                assert torch.equal(run.outputs[0], stored[(side, "fwd_output", 0)]), where
                if name != "norm":  # the model's input needs no gradient: no grad_input
                    assert torch.equal(run.grad_input[0], stored[(side, "grad_input", 0)]), where
                assert len(run.param_grad) == len(list(model.get_submodule(name).parameters()))
                for index, (_, grad) in enumerate(run.param_grad):
                    assert torch.equal(grad, stored[(side, "param_grad", index)]), (where, index)


def test_each_call_of_a_module_called_twice_replays_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    model, x = TiedTwice(8), torch.randn(4, 8, requires_grad=True)
    checker = PrecisionChecker(backend="aot_eager", replay="all", dump_dir=str(tmp_path))
    checker.wrap(model.shared)

    def step(m):
        loss = m(x).square().sum()
        loss.backward()
        return loss

    result = checker.compare(step, model)
    stored = {(r["call"], r["side"], r["kind"]): read(result.dump_file, r)
              for r in _C.read_step(result.dump_file)["records"]
              if r["kind"] in ("fwd_output", "grad_input")}
    for call in (0, 1):  # the module's structure and its graph are stored once, with call 0
        replayed = load_call(checker.dump_dir, "shared", call)
        for route, replay in _routes(replayed).items():
            runs = {"eager": replay.run(), "compiled": replay.run(replayed.backend())}
            for side, run in runs.items():
                assert torch.equal(run.outputs[0], stored[(call, side, "fwd_output")]), route
                assert torch.equal(run.grad_input[0], stored[(call, side, "grad_input")]), route


USER_CODE = '''
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(2 * width, width)

    def forward(self, x, scale=1.0, extra=None):
        return self.down(self.act(self.up(x))) * scale + extra["bias"]


''' + inspect.getsource(_perturb_gelu) + '''

perturbed = aot_autograd(fw_compiler=_perturb_gelu, bw_compiler=_perturb_gelu)
'''


def test_a_repro_from_the_class_reproduces_the_failing_metric_in_a_fresh_process(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "user_model.py").write_text(USER_CODE)
    sys.path.insert(0, str(user))
    try:
        import user_model

        torch.manual_seed(0)
        model = nn.Sequential(user_model.Net(8))
        x, bias = torch.randn(4, 8), torch.randn(8)
        checker = PrecisionChecker(backend=user_model.perturbed, dump="failing",
                                   dump_dir=str(tmp_path / "dump"))
        checker.wrap(model[0])
        checker.install(model)
        loss = model[0](x, 0.5, extra={"bias": bias}).square().sum()
        loss.backward()
        result = checker.collect(loss)
        checker.uninstall()
    finally:
        sys.path.remove(str(user))
        sys.modules.pop("user_model", None)
    failing = next(r for r in result.rows if r.check_type == "fwd_output")
    assert failing.status == "FAIL"

    out = tmp_path / "repro"
    made = subprocess.run([sys.executable, "-m", "dynaprobe.repro", checker.dump_dir,
                           "--module", "0", "-o", str(out), "--from-class"], capture_output=True,
                          text=True)
    assert made.returncode == 0, made.stderr
    assert sorted(os.listdir(out)) == ["repro.py", "repro_data.pt"]
    assert "TORCHDYNAMO_REPRO_AFTER" in (out / "repro.py").read_text()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # Net needs constructor arguments: without --unpickle nothing from the dump runs, and the
    # message says how to opt in and what it risks.
    run = subprocess.run([sys.executable, str(out / "repro.py")], cwd=elsewhere,
                         capture_output=True, text=True, env={**env, "PYTHONPATH": str(user)})
    assert run.returncode != 0
    assert "cannot be built without arguments" in run.stderr and "--unpickle" in run.stderr
    assert "runs code the dump carries" in run.stderr
    run = subprocess.run([sys.executable, str(out / "repro.py"), "--unpickle"], cwd=elsewhere,
                         capture_output=True, text=True, env={**env, "PYTHONPATH": str(user)})
    assert run.returncode == 1, run.stdout + run.stderr  # the failure reproduces
    recorded, replayed = run.stdout.split("replayed:\n")
    line = next(l for l in replayed.splitlines() if "fwd_output[0]" in l)
    assert line.split()[0] == "FAIL"
    assert f"max_abs={failing.max_abs!r} " in line
    assert f"mean_abs={failing.mean_abs!r} " in line
    assert line in recorded  # the same metrics the dump recorded, to the bit

    # Without the user's code the module cannot be rebuilt: the message says what to do.
    run = subprocess.run([sys.executable, str(out / "repro.py"), "--unpickle"], cwd=elsewhere,
                         capture_output=True, text=True, env=env)
    assert run.returncode == 2, run.stderr  # never 1, "the failure reproduces"
    assert "PYTHONPATH" in run.stderr


# ---------------------------------------------------------------------- stage bisection
def _faulty_gelu_decomposition(x, approximate="none"):
    return 0.5 * x * (1 + torch.erf(x * 0.7071067811865476)) * 1.01


def _faulty_partition(joint, joint_inputs, **kwargs):
    forward, backward = default_partition(joint, joint_inputs, **kwargs)
    _perturb_gelu(forward, None)
    return forward, backward


def _stages(fault: str):
    """eager -> aot_eager -> decomposition -> partition -> codegen, each adding its component to
    the one before; the fault is injected into the component of stage ``fault``, so that every
    stage from it on carries it."""
    table = {torch.ops.aten.gelu.default: _faulty_gelu_decomposition} if fault == \
        "decomposition" else {}
    partition = _faulty_partition if fault == "partition" else default_partition
    compiler = _perturb_gelu if fault == "codegen" else plain_compiler
    return _stage_list(table, partition, fw_compiler=compiler, bw_compiler=plain_compiler)


def _stage_list(table, partition, fw_compiler, bw_compiler):
    """The stages eager -> aot_eager -> decomposition (``table``) -> partition (``partition``)
    -> codegen (the two compilers), each adding its component to the one before."""
    return [
        Stage("eager", "eager"),
        Stage("aot_eager", aot_autograd(fw_compiler=plain_compiler)),
        Stage("decomposition", aot_autograd(fw_compiler=plain_compiler, decompositions=table)),
        Stage("partition", aot_autograd(fw_compiler=plain_compiler, decompositions=table,
                                        partition_fn=partition)),
        Stage("codegen", aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                      decompositions=table, partition_fn=partition)),
    ]


@pytest.mark.parametrize("fault", ["decomposition", "partition", "codegen"])
def test_bisection_names_the_stage_a_fault_is_injected_into(tmp_path, fault):
    checker, _, result = checked_step(tmp_path, replay="all", backend="aot_eager")
    call = load_call(checker.dump_dir, "mlp")
    bisected = bisect_call(call, _stages(fault), unpickle=True)
    assert bisected.first_failing(forward=True) == fault
    assert bisected.first_changed(forward=True) == fault
    # Every stage before the fault gives eager's numbers, forward and backward, to the bit.
    before = bisected.stages[:[s.name for s in bisected.stages].index(fault)]
    assert all(s.max_abs(True) == 0 and s.max_abs(False) == 0 for s in before)
    assert bisected.first_changed(forward=False) == fault
    assert not bisected
    text = bisected.text()
    assert f"forward  first changes at: {fault}; first fails the tolerances at: {fault}" in text
    assert f"metrics at {fault}:" in text
    assert "  FAIL fwd_output[0]" in text.split(f"metrics at {fault}:")[1]


@pytest.mark.slow
def test_bisection_through_the_default_stages_and_the_cli(tmp_path):
    checker, _, result = checked_step(tmp_path, dump="failing")  # mlp fails: its call is kept
    bisected = checker.bisect("mlp", unpickle=True)
    assert [s.name for s in bisected.stages] == [
        "eager", "aot_eager", "aot_eager_decomp_partition", "inductor",
        "inductor_fallback_random", "recorded"]
    # The stored call replayed through PyTorch's own stages: eager and AOTAutograd change
    # nothing; the fault was the capture's backend, its own stage, which comes last.
    assert bisected.stages[0].max_abs(True) == 0 and bisected.stages[1].max_abs(True) == 0
    assert not any(s.failed(True) or s.failed(False) for s in bisected.stages[:-1])
    assert bisected.first_failing(True) == "recorded"
    assert "the difference comes from the backend's own changes" in bisected.text()
    command = [sys.executable, "-m", "dynaprobe.bisect", checker.dump_dir, "--module", "mlp",
               "--stages", "eager,aot_eager", "--unpickle"]
    out = subprocess.run(command, capture_output=True, text=True)
    assert out.returncode == 2  # the module's class (tests/python/models.py) is not importable
    assert "Make its class importable" in out.stderr
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(command, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": here})
    assert out.returncode == 0, out.stderr
    assert "forward  first changes at: no stage" in out.stdout


@pytest.mark.slow
def test_a_fault_in_an_inductor_lowering_is_named_by_compiler_bisector(tmp_path, monkeypatch):
    from torch._inductor import lowering  # noqa: PLC0415 - imports Inductor: only here

    torch.manual_seed(0)
    model = nn.Sequential(TanhStage(nn.Tanh()))
    x = torch.randn(4, 8)
    checker = PrecisionChecker(replay="all", dump_dir=str(tmp_path / "dump"))
    checker.wrap(model[0])
    checker.compare(lambda m: m(x).sum(), model)

    # Inductor's lowering of tanh made 1% too large; caches off, so that it is compiled again.
    tanh = torch.ops.aten.tanh.default
    correct = lowering.lowerings[tanh]
    monkeypatch.setitem(lowering.lowerings, tanh, lambda a: lowering.lowerings[
        torch.ops.aten.mul.Tensor](correct(a), 1.01))
    # The configs' own patch(): monkeypatch's undo deletes a torch config entry instead of
    # restoring it, which breaks every later compile in the process.
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        bisected = checker.bisect("0", stages=[s for s in STAGES if s.name in (
            "aot_eager_decomp_partition", "inductor")], inductor_subsystems=True, unpickle=True)
    assert bisected.first_failing() == "inductor"
    assert (bisected.inductor.backend, bisected.inductor.subsystem) == ("inductor", "lowerings")
    assert bisected.inductor.debug_info == "tanh"
    assert "inductor subsystem: BisectionResult(backend='inductor', subsystem='lowerings'" in \
        bisected.text()


# ---------------------------------------------------------------------- backward-only failures
BACKWARD_USER_CODE = USER_CODE.replace(
    "perturbed = aot_autograd(fw_compiler=_perturb_gelu, bw_compiler=_perturb_gelu)",
    "def plain(gm, example_inputs):\n    return make_boxed_func(gm.forward)\n\n\n"
    "backward_fault = aot_autograd(fw_compiler=plain, bw_compiler=_perturb_gelu)")


def test_a_backward_only_failure_is_kept_by_default_and_reproduces_in_a_fresh_process(tmp_path):
    """The forward passes, GELU's backward is 1% off: with the default replay setting, and the
    optimizer stepping before collect() (the parameters change after the backward), the call is
    kept, and its repro reproduces the failing grad_input metrics to the bit."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "user_model.py").write_text(BACKWARD_USER_CODE)
    sys.path.insert(0, str(user))
    try:
        import user_model

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), user_model.Net(8))
        x, bias = torch.randn(4, 8), torch.randn(8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        checker = PrecisionChecker(backend=user_model.backward_fault,
                                   dump_dir=str(tmp_path / "dump"))
        assert checker.replay == "failing"
        checker.wrap(model[1])
        checker.install(model)
        loss = model[1](model[0](x), 0.5, extra={"bias": bias}).square().sum()
        loss.backward()
        optimizer.step()
        result = checker.collect(loss)
        checker.uninstall()
    finally:
        sys.path.remove(str(user))
        sys.modules.pop("user_model", None)
    status = {(r.check_type, r.tensor_index): r for r in result.rows if r.module == "1"}
    assert status[("fwd_output", 0)].status == "PASS"
    failing = status[("grad_input", 0)]
    assert failing.status == "FAIL"
    assert {r["label"] for r in replay_records(result.dump_file)} >= {"input:0", "grad_output:0",
                                                                      "param:up.weight"}

    out = tmp_path / "repro"
    made = subprocess.run([sys.executable, "-m", "dynaprobe.repro", checker.dump_dir,
                           "--module", "1", "-o", str(out)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    # Replayed from the captured graph with torch alone: dynaprobe cannot be imported there, the
    # recorded backend's module can.
    run = run_elsewhere(tmp_path, out, user)
    assert run.returncode == 1, run.stdout + run.stderr
    rows = replayed_rows(run.stdout)
    assert rows["fwd_output[0]"]["status"] == "SAME"
    assert rows["grad_input[0]"]["status"] == "DIFF"
    assert rows["grad_input[0]"]["max_abs"] == failing.max_abs  # to the bit


def run_elsewhere(tmp_path, repro, *path, args=()):
    """Runs a repro folder's script from another folder, where dynaprobe cannot be imported and
    PYTHONPATH holds only ``path``."""
    blocked = tmp_path / "no_dynaprobe" / "dynaprobe"
    blocked.mkdir(parents=True, exist_ok=True)
    (blocked / "__init__.py").write_text("raise ImportError('dynaprobe is not installed here')\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(blocked.parent), *map(str, path)])
    return subprocess.run([sys.executable, str(repro / "repro.py"), *args], cwd=elsewhere,
                          capture_output=True, text=True, env=env)


def replayed_rows(stdout: str) -> dict:
    """The rows a graph repro prints after "replayed from the captured graph", by check."""
    rows = {}
    for line in stdout.split("replayed from the captured graph")[1].splitlines()[1:]:
        if not line.startswith("  "):  # the same() verdict after the rows
            continue
        fields = line.split()
        metrics = dict(f.split("=", 1) for f in fields if "=" in f)
        rows[fields[1]] = {"status": fields[0], "max_abs": float(metrics["max_abs"]),
                           "mean_abs": float(metrics["mean_abs"]), "line": line}
    return rows


def test_a_passing_call_keeps_nothing_and_a_parameter_only_failure_waits_for_collect(tmp_path):
    """Replay data of passing calls is dropped. A call whose inputs need no gradient shows a
    backward fault only in its parameter gradients, judged at collect(): kept when collect()
    comes before the optimizer step, else said in a warning."""
    _, _, result = checked_step(tmp_path / "pass", backend="aot_eager")
    assert result.all_pass and replay_records(result.dump_file) == []

    def run(folder, step_first):
        torch.manual_seed(0)
        model = nn.Sequential(Chain().mlp)  # its input (the model's) needs no gradient
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        checker = PrecisionChecker(backend=BACKWARD_FAULT, dump_dir=str(tmp_path / folder))
        checker.wrap(model[0])
        checker.install(model)
        loss = model(torch.randn(8, 16)).square().sum()
        loss.backward()
        if step_first:
            optimizer.step()
        result = checker.collect(loss)
        checker.uninstall()
        return result

    result = run("collect_first", step_first=False)
    failing = {(r.check_type, r.status) for r in result.rows}
    assert ("param_grad", "FAIL") in failing and ("fwd_output", "FAIL") not in failing
    assert {r["label"] for r in replay_records(result.dump_file)} >= {"param:up.weight"}
    with pytest.warns(UserWarning, match=r"replay data of call 0 was not kept: .*changed.*"
                                         r"Call collect\(\) before optimizer.step\(\)"):
        result = run("step_first", step_first=True)
    assert not result.all_pass and replay_records(result.dump_file) == []


def _backward_stages(fault: str):
    """As _stages, with the fault in the backward only: GELU's backward 1% off, in the
    decomposition table, the partitioned backward graph or the backward compiler."""
    def faulty_gelu_backward(grad, x, approximate="none"):
        cdf = 0.5 * (1 + torch.erf(x * 0.7071067811865476))
        pdf = torch.exp(-0.5 * x * x) * 0.3989422804014327
        return grad * (cdf + x * pdf) * 1.01

    def faulty_partition(joint, joint_inputs, **kwargs):
        forward, backward = default_partition(joint, joint_inputs, **kwargs)
        _perturb_gelu(backward, None)
        return forward, backward

    table = {torch.ops.aten.gelu_backward.default: faulty_gelu_backward} if fault == \
        "decomposition" else {}
    partition = faulty_partition if fault == "partition" else default_partition
    compiler = _perturb_gelu if fault == "codegen" else plain_compiler
    return _stage_list(table, partition, fw_compiler=plain_compiler, bw_compiler=compiler)


@pytest.mark.parametrize("fault", ["decomposition", "partition", "codegen"])
def test_a_backward_only_failure_kept_by_default_is_bisected_to_its_stage(tmp_path, fault):
    checker, _, result = checked_step(tmp_path, backend=BACKWARD_FAULT)  # replay: the default
    assert {(r.module, r.check_type) for r in result.rows if r.status == "FAIL"} >= {
        ("mlp", "grad_input")}
    assert all(r.status == "PASS" for r in result.rows if r.check_type == "fwd_output")
    kept = {r["module"] for r in replay_records(result.dump_file)}
    assert "mlp" in kept and "proj" not in kept  # proj's backward comes before the fault
    bisected = bisect_call(load_call(checker.dump_dir, "mlp"), _backward_stages(fault),
                           unpickle=True)
    assert bisected.first_failing(forward=False) == fault
    assert bisected.first_changed(forward=True) is None  # the forward is eager's everywhere
    assert (f"backward first changes at: {fault}; first fails against the float64 reference at: "
            f"{fault}") in bisected.text()


def test_replay_keeps_the_buffers_from_before_the_call(tmp_path):
    """Batch norm updates its running statistics in the forward: the replay keeps them as they
    were before the call (copied only because the training call changed them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))
    before = {n: b.clone() for n, b in model[0].named_buffers()}
    checker = PrecisionChecker(backend="aot_eager", replay="all", dump_dir=str(tmp_path))
    checker.wrap(model[0])
    checker.compare(lambda m: m(torch.randn(16, 8)).square().sum(), model)
    assert not torch.equal(model[0][1].running_mean, before["1.running_mean"])  # it trained
    call = load_call(checker.dump_dir, "0")
    for name, value in before.items():
        assert torch.equal(call.tensors[f"buffer:{name}"], value), name


def test_the_cli_runs_the_python_replay_tools(tmp_path, dynaprobe_cli):
    """dynaprobe repro / bisect run python -m dynaprobe.repro / bisect with their arguments and
    exit codes; a Python without dynaprobe, or none, is exit 2 with what to do."""
    checker, _, _ = checked_step(tmp_path, dump="failing")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "DYNAPROBE_PYTHON": sys.executable, "PYTHONPATH": here}
    out = tmp_path / "repro"
    made = subprocess.run([dynaprobe_cli, "repro", checker.dump_dir, "--module", "mlp", "-o",
                           str(out)], capture_output=True, text=True, env=env)
    assert made.returncode == 0, made.stderr
    assert made.stdout == f"Repro written to: {out / 'repro.py'}\n"
    assert sorted(os.listdir(out)) == ["graph_runner.py", "graphs.py", "repro.py",
                                       "repro_data.pt"]
    bisected = subprocess.run([dynaprobe_cli, "bisect", checker.dump_dir, "--module", "mlp",
                               "--stages", "eager,aot_eager"], capture_output=True, text=True,
                              env=env)
    assert bisected.returncode == 0, bisected.stderr
    assert "forward  first changes at: no stage" in bisected.stdout
    unknown = subprocess.run([dynaprobe_cli, "repro", checker.dump_dir, "--module", "nope", "-o",
                              str(out)], capture_output=True, text=True, env=env)
    assert unknown.returncode == 2
    assert "keeps replay data of module 'nope'" in unknown.stderr  # "no step of DUMP keeps ..."

    bare = subprocess.run([dynaprobe_cli, "repro", checker.dump_dir], capture_output=True,
                          text=True, env={**env, "DYNAPROBE_PYTHON": "/usr/bin/python3"})
    assert bare.returncode == 2
    assert "cannot import dynaprobe.repro" in bare.stderr and "DYNAPROBE_PYTHON" in bare.stderr
    missing = subprocess.run([dynaprobe_cli, "bisect", checker.dump_dir], capture_output=True,
                             text=True, env={**env, "DYNAPROBE_PYTHON": str(tmp_path / "none")})
    assert missing.returncode == 2
    assert missing.stderr.startswith("dynaprobe: error: bisect runs 'python -m dynaprobe.bisect'")


# ---------------------------------------------------------------------- untrusted dumps
class _Payload:
    """Unpickled, it runs a shell command that leaves a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _with_crafted_pickle(step_file, folder, marker):
    """The step rewritten through dynaprobe's own writer (every checksum valid), its module
    structure replaced by a pickle that runs a command."""
    import pickle

    import numpy as np

    info = _C.read_step(step_file)
    records = []
    for r in info["records"]:
        if not r["stored"]:
            continue
        dtype, shape, data = _C.read_record(step_file, r["module"], r["call"], r["kind"],
                                            r["tensor_index"], r["side"])
        array = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
        if r["label"] == "structure:pickle":
            array = np.frombuffer(pickle.dumps(_Payload(marker)), dtype=np.uint8)
        records.append((r["module"], r["call"], r["kind"], r["tensor_index"], r["side"],
                        r["label"], dtype, array))
    return _C.write_step(str(folder), info["step"], dict(info["provenance"]), records,
                         modules=list(info["modules"]))


def test_a_crafted_pickle_in_a_dump_never_runs_unless_asked_for(tmp_path, dynaprobe_cli):
    """Nothing a dump carries runs by default: not under repro, bisect, the generated script, the
    other commands or the Python API. The opt-in (--unpickle) says what it risks."""
    _, _, result = checked_step(tmp_path, dump="failing")
    marker = tmp_path / "pwned"
    crafted = tmp_path / "crafted"
    _with_crafted_pickle(result.dump_file, crafted, marker)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "DYNAPROBE_PYTHON": sys.executable, "PYTHONPATH": here}
    out, out_class = tmp_path / "repro", tmp_path / "repro_class"
    commands = [["compare", crafted], ["ls", crafted], ["graphs", crafted],
                ["repro", crafted, "--module", "mlp", "-o", out],
                ["repro", crafted, "--module", "mlp", "-o", out_class, "--from-class"],
                ["bisect", crafted, "--module", "mlp", "--stages", "eager,aot_eager"],
                ["bisect", crafted, "--module", "mlp", "--stages", "eager", "--from-class"],
                ["bundle", crafted, "-o", tmp_path / "bundle.tar.gz"]]
    for command in commands:
        run = subprocess.run([dynaprobe_cli, *map(str, command)], capture_output=True,
                             text=True, env=env, cwd=tmp_path)
        assert not marker.exists(), command
        assert run.returncode in (0, 1, 2, 3), (command, run.stderr)
    # The repro from the captured graph runs (the fault reproduces) and unpickles nothing.
    script = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True,
                            text=True, env=env, cwd=tmp_path)
    assert not marker.exists()
    assert script.returncode == 1, script.stdout + script.stderr
    # models.MLP needs its width: the module cannot be built from its class alone, and the
    # message offers the pickle only with its risk.
    script = subprocess.run([sys.executable, str(out_class / "repro.py")], capture_output=True,
                            text=True, env=env, cwd=tmp_path)
    assert not marker.exists()
    assert script.returncode != 0
    assert "--unpickle" in script.stderr and "runs code the dump carries" in script.stderr
    call = load_call(str(crafted), "mlp")
    with pytest.raises(ValueError, match="runs code the dump carries"):
        call.build_module()
    assert not marker.exists()
    helped = subprocess.run([sys.executable, "-m", "dynaprobe.bisect", "--help"],
                            capture_output=True, text=True)
    assert "--unpickle" in helped.stdout and "runs code the dump carries" in \
        " ".join(helped.stdout.split())
    # What the opt-in means, shown once: it runs the pickle.
    with pytest.raises(Exception):
        call.build_module(unpickle=True)
    assert marker.exists()


def test_a_dump_naming_a_class_that_is_not_a_module_is_refused(tmp_path):
    _, _, result = checked_step(tmp_path, dump="failing")
    call = load_call(result.dump_file, "mlp")
    call.replay["class"] = "os.getcwd"  # a callable without arguments
    with pytest.raises(ValueError, match="not an nn.Module class: refused"):
        call.build_module()


def test_bisect_replays_the_recorded_backend_after_the_stock_stages(tmp_path, dynaprobe_cli):
    """Inductor with a custom post-grad pass that scales rsqrt: every stock stage passes, the
    recorded backend (inductor with that pass, resolved from the captured inductor config)
    fails, and the bisection says the difference comes from the backend's own changes."""
    from models import rmsnorm_under_inductor, rsqrt_too_large

    checker, model, x = rmsnorm_under_inductor(str(tmp_path / "dump"))
    with torch._inductor.config.patch(post_grad_custom_post_pass=rsqrt_too_large,
                                      fx_graph_cache=False):
        result = checker.compare(lambda m: m(x).square().sum(), model)
    assert not result.all_pass
    replay = json.loads(dict(_C.read_step(result.dump_file)["modules"])["0"]["replay"])
    assert replay["inductor_config"]["post_grad_custom_post_pass"] == {
        "import": "models:rsqrt_too_large"}

    torch._dynamo.reset()
    stock = [s for s in STAGES if s.name in ("aot_eager", "inductor")]
    from dynaprobe.bisect import recorded_stage

    call = load_call(checker.dump_dir, "0")
    bisected = bisect_call(call, stock + [recorded_stage(call)])
    assert [s.name for s in bisected.stages] == ["aot_eager", "inductor", "recorded"]
    assert bisected.first_failing() == "recorded", bisected.text()
    said = ("every stock stage passes and the recorded backend (inductor, fx_graph_cache=False, "
            "post_grad_custom_post_pass=models:rsqrt_too_large) fails: the difference comes "
            "from the backend's own changes")
    assert said in " ".join(bisected.text().split()), bisected.text()

    # The command line: the recorded stage comes last, with the pass's module imported because
    # the user named it (--import); torch's config is untouched.
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "DYNAPROBE_PYTHON": sys.executable, "PYTHONPATH": here}
    run = subprocess.run([dynaprobe_cli, "bisect", checker.dump_dir, "--module", "0", "--stages",
                          "eager,recorded", "--import", "models"], capture_output=True,
                         text=True, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    assert ("forward  first changes at: recorded; first fails against the float64 reference at: "
            "recorded") in run.stdout
    assert torch._inductor.config.post_grad_custom_post_pass is None


def test_ls_shows_attributes_as_key_value_and_the_raw_form_with_json(tmp_path, dynaprobe_cli):
    """The replay description is hundreds of characters of JSON: the listing says how long it is
    and `ls --json` gives it whole, with everything else the listing shows."""
    _, _, result = checked_step(tmp_path, dump="failing")
    dump = os.path.dirname(result.dump_file)
    listed = subprocess.run([dynaprobe_cli, "ls", dump], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    line = next(l for l in listed.stdout.splitlines() if l.strip().startswith("mlp ")
                and "role=" in l)
    replay = dict(_C.read_step(result.dump_file)["modules"])["mlp"]["replay"]
    assert f"replay=<JSON, {len(replay)} characters: ls --json shows it>" in line
    assert len(line) < 300, line
    raw = subprocess.run([dynaprobe_cli, "ls", dump, "--json"], capture_output=True, text=True)
    assert raw.returncode == 0, raw.stderr
    step = json.loads(raw.stdout)
    assert step["file"] == result.dump_file and step["step"] == 0
    assert json.loads(step["modules"]["mlp"]["replay"])["class"] == "models.MLP"
    assert {r["kind"] for r in step["records"]} >= {"fwd_output", "replay"}


@pytest.mark.parametrize("tool", ["repro", "bisect", "bundle"])
def test_a_damaged_step_file_is_one_line_naming_it_and_exit_2(tmp_path, tool):
    """A step file that is no HDF5 file (truncated, overwritten): each offline tool says which
    file and what is wrong with it on one line and exits 2, never a traceback."""
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "step_00000000.h5").write_bytes(b"not an HDF5 file")
    args = {"repro": ["--module", "m", "-o", str(tmp_path / "out")],
            "bisect": ["--module", "m"], "bundle": ["-o", str(tmp_path / "b.tar.gz")]}[tool]
    run = subprocess.run([sys.executable, "-m", f"dynaprobe.{tool}", str(dump), *args],
                         capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        f"dynaprobe {tool}: {dump / 'step_00000000.h5'}: not an HDF5 file (no HDF5 signature): "
        "expected a dynaprobe step file; was it truncated at the start or overwritten?"]


def test_bisect_refuses_a_step_this_checker_did_not_write(tmp_path):
    """A reused dump_dir: the second checker's step 0 is refused (the earlier run's is there),
    so its bisect would replay the earlier run's call, with other weights: it says so instead."""
    from dynaprobe._offline.stored_call import ReplayError

    first, _, _ = checked_step(tmp_path)  # step 0 stored: mlp fails, its call is kept
    again, _, result = checked_step(tmp_path)
    assert not result.stored
    for step in (None, 0):
        with pytest.raises(ReplayError, match="this checker has stored no step in .*earlier run"):
            again.bisect("mlp", step=step)
    with pytest.raises(ReplayError, match=r"step 1 of .* was not written by this checker \(its "
                                          r"steps: 0\)"):
        first.bisect("mlp", step=1)
    bisected = first.bisect("mlp", stages=[STAGES[1]])  # the first checker's own step
    assert bisected.step == 0 and [s.name for s in bisected.stages] == ["aot_eager"]
