"""Replays from the graph Dynamo captured (docs/guide/diagnosis.md, From a failing row to a
repro): the graph is stored as data and rebuilt only from torch's own operators; a repro folder
runs with torch alone, elsewhere, without the model's source; transformers layers given a cache
replay; a dump naming anything else is refused and runs nothing."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint
from models import rsqrt_fault_backend
from test_replay import checked_step, replayed_rows, run_elsewhere

from dynaprobe import _C, PrecisionChecker
from dynaprobe._mechanics.graph_data import (
    UntrustedGraph,
    graph_from_data,
    graph_to_data,
    python_source,
)
from dynaprobe._offline.judging import judge
from dynaprobe._offline.replay import GraphReplay, load_call, replay_of, tensor_from_bytes
from dynaprobe._offline.stored_call import ReplayError
from dynaprobe.bisect import STAGES, bisect_call, recorded_stage
from dynaprobe.repro import write_repro

HERE = os.path.dirname(os.path.abspath(__file__))


def _captured(module: nn.Module, *args):
    """The graphs Dynamo captures of ``module(*args)``, with their example inputs."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=keep)(*args)
    return graphs


class _Checkpointed(nn.Module):
    """A higher-order operator (activation checkpointing: a subgraph), slicing, a tensor
    constant, keyword arguments and dtype arguments."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor([2.0, 1.0, 0.5, 0.25]))

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda y: torch.relu(self.lin(y)), x,
                                              use_reentrant=False)
        return (h * self.scale).sum(dim=(0,), keepdim=True).to(torch.float64) + x[..., :1]


def test_a_captured_graph_stored_as_data_rebuilds_and_writes_as_python_that_computes_the_same():
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    for gm, example in _captured(_Checkpointed(), x):
        data, tensors = graph_to_data(gm)
        rebuilt = graph_from_data(json.loads(json.dumps(data)), tensors)  # JSON: no objects
        expected = gm(*example)
        assert all(torch.equal(a, b) for a, b in zip(expected, rebuilt(*example)))
        namespace = {}
        exec(compile(python_source(rebuilt, "Graph"), "graphs.py", "exec"), namespace)
        written = namespace["Graph"](rebuilt.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(expected, written(*example)))


def _graph_of_linear():
    data, tensors = graph_to_data(_captured(nn.Linear(2, 2), torch.randn(1, 2))[0][0])
    return data, tensors


@pytest.mark.parametrize("change, refused", [
    (lambda n: n.update(target="os.system"), "the graph calls os.system"),
    (lambda n: n.update(target="torch.load"), "does not run"),
    (lambda n: n.update(target="torch.hub.load"), "does not run"),
    (lambda n: n.update(target="eval"), "does not run"),
    (lambda n: n.update(target="operator.methodcaller"), "does not run"),
    (lambda n: n.update(target="torch.__builtins__.eval"), "does not have"),
    (lambda n: n.update(op="call_method", target="register_hook"), "method 'register_hook'"),
    (lambda n: n.update(op="call_module", target="lin"), "of kind 'call_module'"),
    (lambda n: n.update(args={"tuple": [{"node": "later"}]}), "defined nowhere before"),
    (lambda n: n.update(args={"tuple": [{"pickle": "gASV"}]}), "not one a stored graph holds"),
    (lambda n: n.update(name="x; import os"), "a node is named"),
])
def test_a_graph_naming_anything_but_torch_operators_is_refused(change, refused):
    data, tensors = _graph_of_linear()
    node = next(n for n in data["nodes"] if n["op"] == "call_function")
    change(node)
    with pytest.raises(UntrustedGraph, match=refused):
        graph_from_data(data, tensors)


def test_source_lines_a_dump_carries_stay_comments_in_the_written_python():
    data, tensors = _graph_of_linear()
    node = next(n for n in data["nodes"] if n["op"] == "call_function")
    node["source"] = 'File "a.py", line 1, in f\rimport os; os.system("touch pwned")\n  x = 1'
    source = python_source(graph_from_data(data, tensors), "Graph")
    assert all(line.lstrip().startswith("#") for line in source.splitlines() if "pwned" in line)
    assert "\r" not in source


def _tampered(step_file, folder, target):
    """A copy of a dump, written through dynaprobe's own writer (every checksum valid), whose
    stored graph calls ``target``."""
    import numpy as np

    info = _C.read_step(step_file)
    modules = []
    for name, attributes in info["modules"]:
        attributes = dict(attributes)
        if "replay" in attributes:
            replay = json.loads(attributes["replay"])
            for stored in replay["graph_data"].values():
                node = next(n for n in stored["graph"]["nodes"] if n["op"] == "call_function")
                node["target"] = target
                node["args"] = {"tuple": ["touch " + str(folder / "pwned")]}
            attributes["replay"] = json.dumps(replay)
        modules.append((name, attributes))
    records = []
    for r in info["records"]:
        if r["stored"]:
            dtype, shape, data = _C.read_record(step_file, r["module"], r["call"], r["kind"],
                                                r["tensor_index"], r["side"])
            records.append((r["module"], r["call"], r["kind"], r["tensor_index"], r["side"],
                            r["label"], dtype, np.frombuffer(data, np.dtype(dtype)).reshape(shape)))
    return _C.write_step(str(folder), info["step"], dict(info["provenance"]), records,
                         modules=modules)


def test_a_dump_whose_graph_names_os_system_runs_nothing_under_repro_or_bisect(tmp_path):
    _, _, result = checked_step(tmp_path, dump="failing")
    crafted = tmp_path / "crafted"
    _tampered(result.dump_file, crafted, "os.system")
    call = load_call(str(crafted), "mlp")
    with pytest.raises(ReplayError, match="refused: the graph calls os.system"):
        GraphReplay(call)
    env = {**os.environ, "PYTHONPATH": HERE}
    for tool, extra in (("repro", ["-o", str(tmp_path / "repro")]),
                        ("bisect", ["--stages", "eager"])):
        run = subprocess.run([sys.executable, "-m", f"dynaprobe.{tool}", str(crafted),
                              "--module", "mlp", *extra], capture_output=True, text=True,
                             env=env, cwd=tmp_path)
        assert not (crafted / "pwned").exists(), tool
        # The captured graph is refused, said, and the replay falls back to the module's class,
        # which needs constructor arguments here: a clear error, nothing run.
        assert "the graph calls os.system" in run.stdout + run.stderr, tool
    assert not (crafted / "pwned").exists()


CAPTURE_SCRIPT = '''
import sys

import torch
import torch.nn as nn

from dynaprobe import PrecisionChecker


class Body(nn.Module):  # defined in __main__: nowhere to import it from
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.lin(x)))


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), Body(8))
checker = PrecisionChecker(backend="inductor", dump_dir=sys.argv[1])
checker.wrap(model[1])
x = torch.randn(4, 8)


def step(m):
    loss = m(x).sum()
    loss.backward()
    return loss


checker.compare(step, model)
'''


@pytest.fixture(scope="module")
def script_dump(tmp_path_factory):
    """A dump of dropout under inductor (inductor draws its own random numbers: a real
    difference), captured by a training script whose module class lives in its __main__."""
    source = tmp_path_factory.mktemp("training")
    (source / "train.py").write_text(CAPTURE_SCRIPT)
    dump = source / "dump"
    captured = subprocess.run([sys.executable, "train.py", str(dump)], cwd=source,
                              capture_output=True, text=True)
    assert captured.returncode == 0, captured.stderr
    return dump


def _reproduces(run):
    """The repro's replayed rows equal the rows the dump recorded as failing, to the bit."""
    assert run.returncode == 1, run.stdout + run.stderr
    recorded = {line.split()[1]: line for line in
                run.stdout.split("replayed from")[0].splitlines()[1:]}
    rows = replayed_rows(run.stdout)
    for check in ("fwd_output[0]", "grad_input[0]"):
        assert recorded[check].split()[0] == "FAIL"
        assert rows[check]["status"] == "DIFF"
        assert f"max_abs={rows[check]['max_abs']!r} " in recorded[check]


@pytest.mark.slow
def test_a_repro_of_a_module_of_the_capture_script_runs_elsewhere_with_torch_alone(
        tmp_path, script_dump):
    """The module's class lives in the training script's __main__. Its repro folder, moved to
    another folder and run where neither the script nor dynaprobe can be imported, reproduces
    the recorded metrics to the bit, forward and backward."""
    out = tmp_path / "repro"
    made = subprocess.run([sys.executable, "-m", "dynaprobe.repro", str(script_dump),
                           "--module", "1", "-o", str(out)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    moved = tmp_path / "attached"
    os.rename(out, moved)
    _reproduces(run_elsewhere(tmp_path, moved))


def _unpacked(archive, folder):
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return folder / "dynaprobe_bundle"


@pytest.mark.slow
def test_a_bundle_unpacked_elsewhere_holds_the_reports_and_a_repro_that_runs(
        tmp_path, script_dump, dynaprobe_cli):
    env = {**os.environ, "DYNAPROBE_PYTHON": sys.executable}
    archive = tmp_path / "report.tar.gz"
    made = subprocess.run([dynaprobe_cli, "bundle", str(script_dump), "-o", str(archive)],
                          capture_output=True, text=True, env=env)
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(f"Bundle written to: {archive} (")
    assert "repros of 1)" in made.stdout and "left out" not in made.stdout
    assert archive.stat().st_size < 25e6
    bundle = _unpacked(archive, tmp_path / "issue")
    assert "RESULT: FAILED" in (bundle / "reports" / "step_0.txt").read_text()
    rows = json.loads((bundle / "reports" / "step_0.json").read_text())
    assert rows  # the JSON report parses
    assert "<html" in (bundle / "reports" / "step_0.html").read_text()
    environment = json.loads((bundle / "environment.json").read_text())
    assert environment["captured"]["torch_version"] == torch.__version__
    assert environment["captured"]["python_version"] == platform.python_version()
    assert environment["captured"]["backend"] == "inductor"
    graphs = os.listdir(bundle / "graphs" / "step_0")
    assert any(".Captured_Graph." in g for g in graphs)
    assert any(".Backward_Graph." in g for g in graphs)
    readme = (bundle / "README.md").read_text()
    assert "python repros/1.step0/repro.py" in readme
    _reproduces(run_elsewhere(tmp_path, bundle / "repros" / "1.step0"))


def test_a_bundle_over_its_size_limit_leaves_out_the_repro_and_says_so(tmp_path, script_dump):
    archive = tmp_path / "small.tar.gz"
    run = subprocess.run([sys.executable, "-m", "dynaprobe.bundle", str(script_dump), "-o",
                          str(archive), "--max-mb", "0.03"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "left out: repro of 1 (step 0): the bundle would pass 0.03 MB" in run.stdout
    assert archive.stat().st_size <= 30_000
    bundle = _unpacked(archive, tmp_path / "issue")
    assert not (bundle / "repros").exists()
    assert (bundle / "reports" / "step_0.txt").exists()
    assert "- repro of 1 (step 0): the bundle would pass 0.03 MB" in \
        (bundle / "README.md").read_text()


def test_the_python_tools_read_the_newest_run_of_a_folder_of_runs_and_its_rank_0(
        tmp_path, script_dump):
    """python -m dynaprobe.bundle (as repro and bisect) given dynaprobe_runs/ reads its newest
    run, and of that run folder its rank 0, saying both as the dynaprobe CLI says them."""
    runs = tmp_path / "dynaprobe_runs"
    older, newer = runs / "20261201-090000-11-0", runs / "20261201-100000-12-0"
    for run in (older, newer):
        shutil.copytree(script_dump, run / "rank0")
    for path in [older, *older.rglob("*")]:
        os.utime(path, (1_000_000, 1_000_000))
    archive = tmp_path / "report.tar.gz"
    made = subprocess.run([sys.executable, "-m", "dynaprobe.bundle", str(runs), "-o",
                           str(archive), "--repros", "0"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert made.stderr.splitlines()[:2] == [
        f"dynaprobe: {runs} holds 2 run(s); bundle reads the newest, {newer}; the others: "
        f"{older.name} (name one to read it: dynaprobe bundle {older})",
        f"dynaprobe: {newer} is a run folder: reading its rank 0 ({newer / 'rank0'})"]
    bundle = _unpacked(archive, tmp_path / "issue")
    assert "RESULT: FAILED" in (bundle / "reports" / "step_0.txt").read_text()


def _llama_dump(tmp_path):
    from hf_models import families
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    family = families()["Llama"]
    torch.manual_seed(0)
    model = family.build()
    batch = family.train_batch(model)
    checker = PrecisionChecker(backend=rsqrt_fault_backend, dump_dir=str(tmp_path / "dump"))
    for module in model.modules():
        if isinstance(module, LlamaDecoderLayer):
            checker.wrap(module)

    def step(m):
        out = m(**batch, use_cache=True)  # a DynamicCache reaches every layer
        out.loss.backward()
        return out.loss

    result = checker.compare(step, model)
    return checker, result


def test_a_llama_layer_given_a_cache_in_training_replays_and_bisects(tmp_path):
    checker, result = _llama_dump(tmp_path)
    layer = "model.layers.0"
    failing = {(r.check_type, r.tensor_index): r for r in result.rows
               if r.module == layer and r.status == "FAIL"}
    assert ("fwd_output", 0) in failing and ("grad_input", 0) in failing
    call = load_call(checker.dump_dir, layer)
    with pytest.raises(ReplayError, match="DynamicCache"):  # the class route cannot
        call.arguments()
    replay = replay_of(call)
    assert isinstance(replay, GraphReplay)
    eager, compiled = replay.run(), replay.run(rsqrt_fault_backend)
    rows = {(r.check_type, r.tensor_index): r for r in judge(call, [(eager, compiled)])[0].rows}
    # The layer's output is its graph's first output; the cache's keys and values follow it.
    for key in (("fwd_output", 0), ("grad_input", 0)):
        assert rows[key].status == "FAIL" and rows[key].max_abs == failing[key].max_abs
    for row in result.rows:
        if row.module == layer and row.check_type == "param_grad":
            assert next(r for r in rows.values() if r.label == row.label).max_abs == row.max_abs

    bisected = bisect_call(call, [s for s in STAGES if s.name in ("eager", "aot_eager")] +
                           [recorded_stage(call)])
    assert bisected.route == "the captured graph"
    assert bisected.first_failing(True) == "recorded"
    assert bisected.first_failing(False) == "recorded"
    assert "the difference comes from the backend's own changes" in bisected.text()

    out = tmp_path / "repro"
    write_repro(checker.dump_dir, layer, str(out))
    run = run_elsewhere(tmp_path, out, HERE)  # the recorded backend is models:rsqrt_fault_backend
    assert run.returncode == 1, run.stdout + run.stderr
    replayed = replayed_rows(run.stdout)
    assert replayed["fwd_output[0]"]["max_abs"] == failing[("fwd_output", 0)].max_abs
    assert replayed["grad_input[0]"]["max_abs"] == failing[("grad_input", 0)].max_abs


class _Broken(nn.Module):
    """A graph break between two parts that both read ``up``: two graphs per call, and a
    parameter whose gradient is the sum over both."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.act = nn.GELU()

    def forward(self, x):
        h = self.act(self.up(x))
        torch._dynamo.graph_break()
        return self.act(self.up(h)) * 0.5


def test_a_call_split_by_a_graph_break_replays_each_graph_and_sums_parameter_gradients(tmp_path):
    from models import perturbed_gelu_backend

    torch.manual_seed(0)
    model, x = nn.Sequential(_Broken()), torch.randn(4, 8, requires_grad=True)
    checker = PrecisionChecker(backend=perturbed_gelu_backend, dump_dir=str(tmp_path))
    checker.wrap(model[0])

    def step(m):
        loss = m(x).square().sum()
        loss.backward()
        return loss

    result = checker.compare(step, model)
    recorded = {(r.check_type, r.tensor_index): r for r in result.rows if r.module == "0"}
    assert recorded[("fwd_output", 0)].status == "FAIL"
    call = load_call(checker.dump_dir, "0")
    replay = GraphReplay(call)
    assert len(replay.calls) == 2 and len(replay.graphs) == 2
    compiled = replay.run(perturbed_gelu_backend)
    rows = judge(call, [(replay.run(), compiled)])[0].rows
    # Each graph is judged on the inputs it took in training: the difference of each GELU alone,
    # where the module's rows add the first graph's difference to the second's.
    outputs = [r for r in rows if r.check_type == "fwd_output"]
    assert [r.status for r in outputs] == ["FAIL", "FAIL"]
    assert outputs[-1].max_abs < recorded[("fwd_output", 0)].max_abs
    # The compiled side is the training's, to the bit: the module's output, and each parameter's
    # gradient summed over the two graphs that read it.
    stored = {(r["side"], r["kind"], r["tensor_index"]): r
              for r in _C.read_step(result.dump_file)["records"] if r["module"] == "0"}

    def value(kind, index):
        return tensor_from_bytes(*_C.read_record(result.dump_file, "0", 0, kind, index,
                                                 "compiled"))

    assert torch.equal(compiled.outputs[-1], value("fwd_output", 0))
    for index, (name, grad) in enumerate(compiled.param_grad):
        assert name == ("up.weight", "up.bias")[index]
        assert torch.equal(grad, value("param_grad", index)), name
    assert ("compiled", "param_grad", 1) in stored


def test_a_call_under_the_users_autocast_replays_under_it(tmp_path):
    """The user's own torch.autocast around the step: the graph's matmuls ran in bfloat16 there,
    and the replay runs them so again (the metrics to the bit, not float32's)."""
    from models import perturbed_gelu_backend

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)))
    x = torch.randn(4, 8, requires_grad=True)
    checker = PrecisionChecker(backend=perturbed_gelu_backend, dump_dir=str(tmp_path))
    checker.wrap(model[0])

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        loss = out.float().square().sum()
        loss.backward()
        return loss

    result = checker.compare(step, model)
    recorded = next(r for r in result.rows if r.check_type == "fwd_output" and r.module == "0")
    call = load_call(checker.dump_dir, "0")
    assert call.autocast_dtype is torch.bfloat16
    replay = GraphReplay(call)
    eager = replay.run()
    assert eager.outputs[0].dtype is torch.bfloat16
    row = next(r for r in judge(call, [(eager, replay.run(perturbed_gelu_backend))])[0].rows
               if r.check_type == "fwd_output")
    assert row.max_abs == recorded.max_abs


def test_outputs_kept_after_the_step_keep_none_of_the_calls_tensors_alive(tmp_path):
    """The gradient hooks on a graph's outputs live as long as the outputs: once the call's
    replay data is decided, what they point to holds no tensor of the call."""
    import gc

    from dynaprobe._mechanics.graphs import LiveGraphCall

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    checker = PrecisionChecker(backend="aot_eager", dump_dir=str(tmp_path))
    checker.wrap(model[0])
    checker.install(model)
    kept = []
    for _ in range(2):
        out = model(torch.randn(4, 8))
        kept.append(out)  # the user keeps the outputs, and with them their autograd graph
        loss = out.square().sum()
        loss.backward()
        checker.collect(loss)
    checker.uninstall()
    live = [o for o in gc.get_objects() if type(o) is LiveGraphCall]
    assert live  # the hooks still reach them
    assert all(o.released and not o.args and not o.grads for o in live)
