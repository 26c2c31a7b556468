"""Graph dumps (dump_graphs, graph_dir) with real torch.compile: the graphs Dynamo and AOTAutograd
produce for every compiled function, named as the spec names them, in graph_dir and in the dump,
for every backend and both entry points, without changing what is compiled.

If a PyTorch upgrade stops delivering graphs to dynaprobe's hooks (capture/python/dynaprobe/
graphs.py), test_aot_eager_training_step_delivers_every_graph fails: it is the guard that keeps
graph dumps from silently going empty.
"""

import collections
import copy
import hashlib
import json
import os
import pathlib
import re
import subprocess

import h5py
import hdf5plugin  # noqa: F401  (zstd filter for h5py)
import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from dynaprobe import PrecisionChecker

GRAPH_FILE = re.compile(r"^__compiled_fn_(\d+)\.(Captured|Forward|Backward)_Graph\.([0-9a-f]{8})\.py$")
ALL_THREE = {"Captured", "Forward", "Backward"}


@pytest.fixture(autouse=True)
def _fresh_dynamo(tmp_path, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)


class Small(nn.Module):
    """Defined here so that Dynamo installs its compiled functions into this module's globals."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def model_of_two():
    return nn.Sequential(Small(), Small())


def train_step(model, x=None):
    x = torch.randn(4, 8) if x is None else x
    model.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


class DynamoFunctions:
    """The ``__compiled_fn_<n>`` names Dynamo itself gave the functions it compiled while this is
    active, read independently of dynaprobe: Dynamo installs each compiled function into the
    globals of the frame it compiled (here, this test module) as ``__compiled_fn_<n>[_<uuid>]``."""

    def __enter__(self):
        self.before = {k for k in globals() if k.startswith("__compiled_fn_")}
        return self

    def __exit__(self, *exc):
        self.names = {re.match(r"(__compiled_fn_\d+)", k).group(1)
                      for k in globals() if k.startswith("__compiled_fn_") and k not in self.before}


def graph_files(folder):
    """{function number: {kind: [file names]}} of a graph folder; every file must be named as the
    spec names graph dumps."""
    found = collections.defaultdict(lambda: collections.defaultdict(list))
    names = sorted(os.listdir(folder))
    for name in names:
        match = GRAPH_FILE.match(name)
        assert match, f"{name} is not named __compiled_fn_<n>.<Kind>_Graph.<hash8>.py"
        found[int(match.group(1))][match.group(2)].append(name)
    return found


def body(path):
    """A graph file from graph_dir without its one-line header comment."""
    text = pathlib.Path(path).read_text()
    header, rest = text.split("\n", 1)
    assert header.startswith("# __compiled_fn_"), header
    return rest


def functions_of(result, module):
    value = result.modules[module].get("compiled_functions", "")
    return [f for f in value.split(",") if f]


# --------------------------------------------------------------------------- the guard
def test_aot_eager_training_step_delivers_every_graph():
    """A training step under aot_eager must yield, for every compiled function, its captured
    graph and its AOTAutograd forward and backward graphs, numbered with Dynamo's own number."""
    model = model_of_two()
    checker = PrecisionChecker(dump_graphs=True, graph_dir="graphs")  # aot_eager by default
    checker.wrap_all_children(model, depth=0)
    checker.install(model)
    with DynamoFunctions() as dynamo:
        loss = train_step(model)
    result = checker.collect(loss)
    checker.uninstall()
    assert result.all_pass, result.text()

    assert os.path.isdir("graphs"), "dump_graphs=True wrote no graph folder at all"
    files = graph_files("graphs")
    torch_version = torch.__version__
    assert files, (f"PyTorch {torch_version} delivered no graph to dynaprobe's backend wrapper: "
                   "update capture/python/dynaprobe/_mechanics/graphs.py")
    for n, kinds in files.items():
        assert kinds.get("Captured"), (f"__compiled_fn_{n}: no Dynamo captured graph (PyTorch "
                                       f"{torch_version}); gm.meta['backend_id'] may have changed")
        assert kinds.get("Forward"), (f"__compiled_fn_{n}: no AOTAutograd forward graph (PyTorch "
                                      f"{torch_version}): the structured-trace artifact "
                                      "'aot_forward_graph' no longer reaches graphs.py")
        assert kinds.get("Backward"), (f"__compiled_fn_{n}: no AOTAutograd backward graph (PyTorch "
                                       f"{torch_version}): the structured-trace artifact "
                                       "'aot_backward_graph' no longer reaches graphs.py")
        assert {k: len(v) for k, v in kinds.items()} == {"Captured": 1, "Forward": 1, "Backward": 1}

    # <n> is Dynamo's own number, the same for the three graphs of one function.
    assert {f"__compiled_fn_{n}" for n in files} == dynamo.names
    # Each wrapped module became exactly one function, and the report says which.
    assert sorted(functions_of(result, "0") + functions_of(result, "1")) == sorted(dynamo.names)
    assert functions_of(result, "0") != functions_of(result, "1")


def test_graph_file_contents():
    model = nn.Sequential(Small())
    checker = PrecisionChecker(dump_graphs=True, graph_dir="graphs")
    checker.wrap(model[0])
    result = checker.compare(train_step, model)
    (function,) = functions_of(result, "0")
    files = graph_files("graphs")[int(function.rsplit("_", 1)[1])]
    captured = pathlib.Path("graphs", files["Captured"][0]).read_text()
    forward = pathlib.Path("graphs", files["Forward"][0]).read_text()
    backward = pathlib.Path("graphs", files["Backward"][0]).read_text()
    for kind, name, text in (("captured", files["Captured"][0], captured),
                             ("forward", files["Forward"][0], forward),
                             ("backward", files["Backward"][0], backward)):
        assert text.startswith(f"# {name[:-3]}: {kind} graph of 0\n"), text[:120]
        assert "class GraphModule(torch.nn.Module):" in text and "def forward(" in text
        # The hash names the content: 8 hex digits of the graph text's MD5.
        digest = hashlib.md5(body(pathlib.Path("graphs", name)).encode()).hexdigest()[:8]
        assert name[:-3].rsplit(".", 1)[1] == digest
    # Dynamo's graph holds torch-level calls with shapes; AOTAutograd's hold aten ops.
    assert "torch.tanh" in captured and "f32[4, 8]" in captured
    assert "torch.ops.aten.tanh.default" in forward and "torch.ops.aten.addmm.default" in forward
    assert "tangents_1" in backward and "torch.ops.aten.tanh_backward.default" in backward


def test_graphs_inside_the_dump_extracted_by_the_cli(dynaprobe_cli):
    model = model_of_two()
    checker = PrecisionChecker(dump_graphs=True, graph_dir="graphs", dump_dir="dump")
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(train_step, model)
    written = sorted(os.listdir("graphs"))
    assert len(written) == 6

    proc = subprocess.run([dynaprobe_cli, "graphs", "dump", "-o", "extracted"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir("extracted")) == written
    for name in written:
        assert pathlib.Path("extracted", name).read_text() == body(pathlib.Path("graphs", name))
    assert sorted(pathlib.Path(line).name for line in proc.stdout.split()) == written

    listing = subprocess.run([dynaprobe_cli, "ls", "dump"], capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    kinds = {"Captured": "captured", "Forward": "forward", "Backward": "backward"}
    for name in written:
        kind = kinds[GRAPH_FILE.match(name).group(2)]
        size = len(body(pathlib.Path("graphs", name)).encode())
        assert f"  graph {name[:-3]} ({kind}, {size} bytes)\n" in listing.stdout
    # The dump links each wrapped module to the functions it became.
    for module in ("0", "1"):
        (function,) = functions_of(result, module)
        (line,) = [l for l in listing.stdout.splitlines() if l.startswith(f"    {module} ")]
        assert f"compiled_functions={function}," in line and "graph_breaks=0" in line, line
        assert "role=wrapped" in line and "note=" not in line, line

    # And each stored graph says which function and which wrapped module it belongs to.
    with h5py.File(result.dump_file) as f:
        for name in written:
            attrs = {k: v.decode() for k, v in f["graphs"][name[:-3]].attrs.items()}  # fixed-length
            module = attrs["module"]
            assert attrs["function"] == name.split(".")[0]
            assert attrs["function"] in functions_of(result, module)


def test_report_json_says_which_functions_each_module_became(dynaprobe_cli):
    model = model_of_two()
    checker = PrecisionChecker(dump_dir="dump")  # graphs go into the dump even without graph_dir
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(train_step, model)
    assert not os.path.exists("graph_dump")  # dump_graphs=False: no graph files

    proc = subprocess.run([dynaprobe_cli, "compare", "dump", "--json", "report.json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    step = json.loads(pathlib.Path("report.json").read_text())["ranks"][0]["steps"][0]
    assert step["modules"] == result.modules
    stored = collections.defaultdict(set)
    with h5py.File(result.dump_file) as f:
        for name, dataset in f["graphs"].items():
            stored[dataset.attrs["module"].decode()].add(dataset.attrs["function"].decode())
    for module in ("0", "1"):
        attrs = step["modules"][module]
        assert attrs["role"] == "wrapped" and attrs["graph_breaks"] == "0" and attrs["calls"] == "1"
        assert set(attrs["compiled_functions"].split(",")) == stored[module]


# --------------------------------------------------------------------------- both entry points
def test_install_path_keeps_graphs_across_steps():
    model = model_of_two()
    checker = PrecisionChecker(dump_graphs=True, graph_dir="graphs", dump_dir="dump")
    checker.wrap_all_children(model, depth=0)
    checker.install(model)
    results = []
    for _ in range(2):
        loss = train_step(model)
        results.append(checker.collect(loss))
    checker.uninstall()
    files = graph_files("graphs")
    assert len(files) == 2 and all(set(kinds) == ALL_THREE for kinds in files.values())
    # The second step reuses the compiled code: no new graphs, the same functions reported.
    assert results[0].modules == results[1].modules
    with h5py.File(results[1].dump_file) as f:
        assert "graphs" not in f or len(f["graphs"]) == 0
    assert all(r.all_pass for r in results)


def test_two_pass_compare_dumps_the_compiled_copy_graphs():
    model = model_of_two()
    checker = PrecisionChecker(single_pass=False, dump_graphs=True, graph_dir="graphs")
    checker.wrap_all_children(model, depth=0)
    with DynamoFunctions() as dynamo:
        result = checker.compare(train_step, model)
    files = graph_files("graphs")
    assert {f"__compiled_fn_{n}" for n in files} == dynamo.names and len(files) == 2
    assert all(set(kinds) == ALL_THREE for kinds in files.values())
    assert sorted(functions_of(result, "0") + functions_of(result, "1")) == sorted(dynamo.names)
    assert result.all_pass and result.loss_eager == result.loss_compiled


def test_inference_gets_a_forward_graph_and_no_backward():
    model = model_of_two()
    checker = PrecisionChecker(dump_graphs=True, graph_dir="graphs")
    checker.wrap_all_children(model, depth=0)

    def infer(m):
        with torch.no_grad():
            return m(torch.randn(4, 8)).mean()

    result = checker.compare(infer, model)
    files = graph_files("graphs")
    assert len(files) == 2
    assert all(set(kinds) == {"Captured", "Forward"} for kinds in files.values()), dict(files)
    assert result.all_pass


# --------------------------------------------------------------------------- backends
def _plain_callable_backend(gm, example_inputs):
    return gm.forward


def _nop_compiler(gm, example_inputs):
    return make_boxed_func(gm.forward)


_aot_callable_backend = aot_autograd(fw_compiler=_nop_compiler, bw_compiler=_nop_compiler)


@pytest.mark.parametrize("backend, kinds", [
    ("eager", {"Captured"}),  # no AOTAutograd: Dynamo's graph only
    ("aot_eager", ALL_THREE),
    ("inductor", ALL_THREE),
    (_plain_callable_backend, {"Captured"}),
    (_aot_callable_backend, ALL_THREE),
], ids=["eager", "aot_eager", "inductor", "callable", "callable_aot_autograd"])
@pytest.mark.parametrize("single_pass", [True, False], ids=["single_pass", "two_pass"])
def test_every_backend_dumps_its_graphs(backend, kinds, single_pass):
    model = model_of_two()
    checker = PrecisionChecker(backend=backend, single_pass=single_pass, dump_graphs=True,
                               graph_dir="graphs")
    checker.wrap_all_children(model, depth=0)
    with DynamoFunctions() as dynamo:
        result = checker.compare(train_step, model)
    assert result.all_pass, result.text()
    files = graph_files("graphs")
    assert {f"__compiled_fn_{n}" for n in files} == dynamo.names and len(dynamo.names) == 2
    for n, found in files.items():
        assert set(found) == kinds, (n, dict(found))
    assert not any(r.note == "NOT_COMPILED" for r in result)


# --------------------------------------------------------------------------- no side effects
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_recording_graphs_does_not_change_results(backend):
    """The compiled module with dynaprobe's recording backend computes bit for bit what plain
    torch.compile with the same backend computes: outputs and gradients."""
    base = nn.Sequential(Small(16), Small(16))
    x = torch.randn(8, 16)
    plain, checked = copy.deepcopy(base), copy.deepcopy(base)
    for module in plain:
        module.forward = torch.compile(module.forward, backend=backend)
    out_plain = plain(x)
    out_plain.pow(2).mean().backward()

    checker = PrecisionChecker(backend=backend, dump_graphs=True, graph_dir="graphs")
    checker.wrap_all_children(checked, depth=0)
    checker.install(checked)
    out_checked = checked(x)
    loss = out_checked.pow(2).mean()
    loss.backward()
    result = checker.collect(loss)
    checker.uninstall()

    assert torch.equal(out_plain, out_checked)
    for (name, a), (_, b) in zip(plain.named_parameters(), checked.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    assert len(graph_files("graphs")) == 2
    assert result.all_pass
