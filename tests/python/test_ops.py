"""Inside a module: the first op, and the generated kernel, where the numbers change
(``bisect --ops``, dynaprobe._offline.ops). Faults that change exactly one op, forward or backward, under
an aot_autograd backend and as an inductor post-grad pass (inside a fused kernel), are found at
that op and its source line; a clean bf16 run names no op."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from models import BACKWARD_FAULT, RMSNormMLP, rsqrt_fault_backend
from test_replay import replayed_rows, run_elsewhere
from torch._dynamo.backends.common import aot_autograd

from dynaprobe import PrecisionChecker
from dynaprobe._offline.ops import localise
from dynaprobe._offline.replay import load_call

HERE = os.path.dirname(os.path.abspath(__file__))


def _scale(graph: torch.fx.Graph, targets, where: str) -> None:
    """Every node calling one of ``targets`` comes out 5% larger (its exp, to the power 1.05:
    scaling would cancel out in softmax), in the ``where`` graphs only ("forward",
    "backward": the one that takes tangents)."""
    backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
    if backward != (where == "backward"):
        return
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in targets:
            change = torch.ops.aten.pow.Tensor_Scalar if node.target == torch.ops.aten.exp.default \
                else torch.ops.aten.mul.Tensor
            with graph.inserting_after(node):
                scaled = graph.call_function(change, (node, 1.05))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)


def aot_fault(*targets, where="forward"):
    """An aot_autograd backend whose compilers scale ``targets`` in the ``where`` graph."""

    def compiler(gm, example_inputs):
        _scale(gm.graph, targets, where)
        gm.recompile()
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def inductor_fault(*targets, where="forward"):
    """Inductor with a post-grad pass scaling ``targets`` in the ``where`` graph: the fault
    inside a fused kernel."""
    return ("inductor", {"post_grad_custom_post_pass":
                         lambda graph: _scale(graph, targets, where)})


class Attention(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        return weights @ v


class GeluMLP(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


def _dump(tmp_path, module: nn.Module, backend, shape=(2, 8, 16), dtype=torch.float32,
          input_grad=True):
    """A training step of ``module`` checked with ``backend`` (a name and inductor config, or a
    backend): its stored call. ``input_grad=False``: only its parameters get gradients."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model = nn.Sequential(module).to(dtype)
    x = torch.randn(*shape, dtype=dtype, requires_grad=input_grad)
    name, config = backend if isinstance(backend, tuple) else (backend, {})
    checker = PrecisionChecker(backend=name, dump_dir=str(tmp_path / "dump"))
    checker.wrap(model[0])

    def step(m):
        loss = m(x).square().sum()
        loss.backward()
        return loss

    with inductor_config.patch(config):
        result = checker.compare(step, model)
    assert not result.all_pass
    return load_call(checker.dump_dir, "0")


def _localised(tmp_path, module, backend, **step):
    call = _dump(tmp_path, module, backend, **step)
    name, config = backend if isinstance(backend, tuple) else (backend, {})
    return localise(call, name, config)


CASES = {  # fault -> (module, the ops a backend scales, the op found, its source line's words)
    "rsqrt of RMSNorm": (RMSNormMLP, (torch.ops.aten.rsqrt.default,), "rsqrt",
                         ("models.py:", "torch.rsqrt")),
    "a matmul": (Attention, (torch.ops.aten.bmm.default,), "bmm", ("test_ops.py:", "q @ k")),
    # Inductor decomposes softmax before its post-grad passes: there the fault is in its exp.
    "attention's softmax": (Attention, (torch.ops.aten._softmax.default,
                                        torch.ops.aten.exp.default), None,
                            ("test_ops.py:", "torch.softmax")),
}


@pytest.mark.parametrize("kind", ["aot", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("fault", list(CASES))
def test_a_fault_in_one_forward_op_is_found_at_that_op_and_its_source_line(tmp_path, fault,
                                                                           kind):
    module, targets, op, source = CASES[fault]
    backend = aot_fault(*targets) if kind == "aot" else inductor_fault(*targets)
    result = _localised(tmp_path, module(), backend)
    forward = next(g for g in result.graphs if g.kind == "forward")
    finding = forward.finding
    assert finding is not None, result.text()
    scaled = {str(t) for t in targets}
    assert finding.op in scaled, result.text()
    if op is not None:
        assert finding.node.startswith(op)
    assert all(word in finding.source for word in source), finding.source
    assert finding.inputs_matched
    assert finding.row.status == "FAIL" and finding.row.max_abs > 0
    assert "confirmed" in finding.fidelity
    # The backward graph takes the forward's saved values as they were: given the same ones,
    # it computes the same gradients, so no op of it is named.
    assert all(g.finding is None for g in result.graphs if g.kind == "backward"), result.text()
    if kind == "inductor":  # inside a fused kernel, named with the nodes it fuses
        assert finding.kernel is not None, result.text()
        assert finding.node in finding.kernel.fuses
        assert finding.kernel.path.endswith(".py")
        assert "kernel   " + finding.kernel.name in result.text()


def test_the_op_alone_on_its_real_inputs_reproduces_with_torch_alone(tmp_path):
    """The finding's repro: the op alone, on the values it took; the recorded backend is
    models:rsqrt_fault_backend, importable where the repro runs."""
    call = _dump(tmp_path, RMSNormMLP(), rsqrt_fault_backend)
    finding = localise(call, rsqrt_fault_backend).findings[0]
    folder = os.path.dirname(finding.repro)
    graph = open(os.path.join(folder, "graphs.py")).read()
    assert "torch.ops.aten.rsqrt.default" in graph
    assert graph.count("torch.ops.aten.") == 1  # one op, small enough to paste in an issue
    run = run_elsewhere(tmp_path, type(tmp_path)(folder), HERE)
    assert run.returncode == 1, run.stdout + run.stderr
    assert replayed_rows(run.stdout)["fwd_output[0]"]["max_abs"] == finding.row.max_abs


@pytest.mark.parametrize("kind", ["aot", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_fault_in_the_backward_graph_only_is_found_there(tmp_path, kind):
    targets = (torch.ops.aten.gelu_backward.default, torch.ops.aten.erf.default)
    backend = BACKWARD_FAULT if kind == "aot" else inductor_fault(*targets, where="backward")
    result = _localised(tmp_path, GeluMLP(), backend)
    assert [g.kind for g in result.graphs if g.finding] == ["backward"], result.text()
    finding = result.findings[0]
    assert finding.op in {str(t) for t in targets}
    assert "nn.functional.gelu" in finding.source


class BreakingMLP(nn.Module):
    """An MLP normalised by its hidden layer's largest magnitude, read with ``.item()``: a graph
    break, so each call runs two forward graphs and two backward ones."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        hidden = self.up(x)
        scale = hidden.abs().amax().item()
        return self.down(torch.tanh(hidden / scale))


@pytest.mark.parametrize("kind", ["aot", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_module_with_a_graph_break_has_each_graph_named_and_the_fault_found_in_its_own(
        tmp_path, kind):
    tanh = torch.ops.aten.tanh.default
    backend = aot_fault(tanh) if kind == "aot" else inductor_fault(tanh)
    result = _localised(tmp_path, BreakingMLP(), backend)
    names = [g.name for g in result.graphs]
    assert sorted(names) == ["backward_1", "backward_2", "forward_1", "forward_2"], names
    assert [(f.graph, f.op) for f in result.findings] == [
        ("forward_2", "aten.tanh.default")], result.text()
    assert "forward_2 graph:" in result.text() and "forward_1 graph:" in result.text()


class ReluMLP(nn.Module):
    """up, relu, down, with one hidden unit at -2^-12 for every token: its relu is zero, a
    rounding away from the kink."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        with torch.no_grad():
            self.up.weight[0] = 0
            self.up.bias[0] = -2.0 ** -12

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def nudged_near_zero(graph: torch.fx.Graph) -> None:
    """A post-grad pass adding 2^-11 to the forward's linear outputs within 2^-10 of zero: a
    change below fp16's rounding of the values around them, that moves the hidden unit at
    -2^-12 across relu's kink."""
    if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return
    aten = torch.ops.aten
    for node in [n for n in graph.nodes if n.target == aten.addmm.default]:
        with graph.inserting_after(node):
            magnitude = graph.call_function(aten.abs.default, (node,))
        with graph.inserting_after(magnitude):
            small = graph.call_function(aten.lt.Scalar, (magnitude, 2.0 ** -10))
        with graph.inserting_after(small):
            moved = graph.call_function(aten.add.Tensor, (node, 2.0 ** -11))
        with graph.inserting_after(moved):
            nudged = graph.call_function(aten.where.self, (small, moved, node))
        ours = {magnitude, moved, nudged}
        node.replace_all_uses_with(nudged, delete_user_cb=lambda user: user not in ours)


@pytest.mark.slow
def test_a_gradient_that_fails_through_a_kink_is_explained_where_no_op_fails(tmp_path):
    """fp16: the compiled forward puts a hidden unit on the other side of relu's kink by less
    than the rounding of its op; its gradient then flows on one side only, so the module's
    gradients fail while no op does, and the localisation says which mask differs and that it is
    within rounding noise (the OPT fp16 case of docs/guide/diagnosis.md)."""
    backend = ("inductor", {"post_grad_custom_post_pass": nudged_near_zero})
    result = _localised(tmp_path, ReluMLP(), backend, dtype=torch.float16, input_grad=False)
    assert not result.findings, result.text()
    # Inductor's partitioner saves relu's mask (aten.le) for the backward; it decided on relu's
    # output, zero in eager and 2^-12 compiled for each of the 16 tokens.
    (split,) = result.split_decisions
    assert split.op in ("aten.le.Scalar", "aten.relu.default"), result.text()
    assert split.elements == 16 and split.eager == 0 and split.compiled == 2.0 ** -12
    assert split.within_noise, result.text()
    text = result.text()
    assert "no op fails" in text and "decided differently" in text
    assert "not a\n    compiler divergence" in text, text


def scaled_where_fused(graph: torch.fx.Graph) -> None:
    """A post-grad pass scaling, 5%, the forward's erf where the graph keeps it inside a kernel
    (not one of the graph's outputs): a fault of the fusion alone, gone when every op is
    exposed as an output, as a kernel that fuses a reduction wrongly is."""
    if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return
    outputs = set(next(n for n in graph.nodes if n.op == "output").all_input_nodes)
    for node in [n for n in graph.nodes if n.target == torch.ops.aten.erf.default]:
        if node in outputs:
            continue
        with graph.inserting_after(node):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.05))
        node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)


@pytest.mark.slow
def test_a_fault_of_a_fusion_alone_is_found_at_the_graph_output_it_changes(tmp_path):
    """Every op passes with each exposed (the fault is gone with the fusion), yet the graph as
    inductor compiled it computes its outputs otherwise: the first such output is named, with
    the kernel that computes it (T5's relative-position bias gradient under autocast, in
    docs/guide/diagnosis.md)."""
    backend = ("inductor", {"post_grad_custom_post_pass": scaled_where_fused})
    result = _localised(tmp_path, GeluMLP(), backend, input_grad=False)
    forward = next(g for g in result.graphs if g.kind == "forward")
    assert not result.findings, result.text()
    fused = forward.fused_output
    assert fused is not None, result.text()
    assert fused.row.status == "FAIL" and fused.kernel is not None
    assert any(node.startswith("erf") for node in fused.kernel.fuses), result.text()
    assert "fails as the backend compiled the graph" in result.text()


def test_bisect_ops_from_the_cli_names_the_op(tmp_path, dynaprobe_cli):
    import subprocess
    import sys

    call = _dump(tmp_path, RMSNormMLP(), rsqrt_fault_backend)  # importable: models
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "DYNAPROBE_PYTHON": sys.executable, "PYTHONPATH": here}
    run = subprocess.run([dynaprobe_cli, "bisect", os.path.dirname(call.path), "--module", "0",
                          "--stages", "eager", "--ops", "--import", "models"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert "first op that fails in the forward graph: rsqrt (aten.rsqrt.default)" in run.stdout
    assert "inputs   matched" in run.stdout or "inputs   within noise" in run.stdout


@pytest.mark.slow
def test_bisect_ops_sees_the_graphs_the_compile_caches_hold(tmp_path, dynaprobe_cli):
    """The stage bisection before the localisation compiles the call's graph with inductor,
    filling AOTAutograd's and inductor's caches; the localisation compiles the same graph, which
    a cache would return without calling the compilers it watches. It compiles afresh, so it
    compares every op (and never says "no op fails" of a replay it did not see)."""
    import subprocess
    import sys

    torch.manual_seed(0)
    model = nn.Sequential(GeluMLP())
    x = torch.randn(2, 8, 16, requires_grad=True)
    checker = PrecisionChecker(backend="inductor", dump_dir=str(tmp_path / "dump"), replay="all")
    checker.wrap(model[0])

    def step(m):
        loss = m(x).square().sum()
        loss.backward()
        return loss

    checker.compare(step, model)
    env = {**os.environ, "DYNAPROBE_PYTHON": sys.executable}
    run = subprocess.run([dynaprobe_cli, "bisect", checker.dump_dir, "--module", "0", "--ops"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    counts = re.findall(r"(forward|backward) graph: (\d+) ops", run.stdout)
    assert [kind for kind, _ in counts] == ["forward", "backward"], run.stdout
    assert all(int(ops) > 0 for _, ops in counts), run.stdout


def _layer_call(tmp_path, family_name, backend, cast=None):
    from hf_models import families

    family = families()[family_name]
    torch.manual_seed(0)
    model = family.build()
    batch = family.train_batch(model)
    name, config = backend if isinstance(backend, tuple) else (backend, {})
    checker = PrecisionChecker(backend=name, dump_dir=str(tmp_path / "dump"), replay="all",
                               cast_dtype=cast)
    layer = model.model.layers[0]
    checker.wrap(layer)

    def step(m):
        out = m(**batch)
        out.loss.backward()
        return out.loss

    import torch._inductor.config as inductor_config

    with inductor_config.patch(config):
        checker.compare(step, model)
    return load_call(checker.dump_dir, "model.layers.0")


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_a_transformers_layer_s_rmsnorm_fault_is_found_at_its_rsqrt(tmp_path, family):
    call = _layer_call(tmp_path, family, rsqrt_fault_backend)
    result = localise(call, rsqrt_fault_backend)
    finding = next(g.finding for g in result.graphs if g.kind == "forward")
    assert finding is not None and finding.op == "aten.rsqrt.default", result.text()
    assert f"modeling_{family.lower()}.py" in finding.source and "rsqrt" in finding.source


@pytest.mark.slow
def test_a_clean_bf16_layer_under_inductor_names_no_op(tmp_path):
    """bf16 rounding differs between eager and inductor's fused kernels everywhere; none of it
    is beyond what eager's own rounding is, against fp64."""
    call = _layer_call(tmp_path, "Llama", "inductor", cast=torch.bfloat16)
    result = localise(call, "inductor")
    assert result.graphs and not result.findings, result.text()
    assert "no op fails" in result.text()


def test_a_decomposition_bug_is_named_as_such(tmp_path, monkeypatch):
    """A wrong decomposition in inductor's own table (GELU 1% too large): the compiled aten
    graph carries the error, so every op of it matches its own eager evaluation and --ops finds
    none; the stage bisection's first failing stage is the one that adds inductor's
    decompositions, and the answer names the decomposition, not "no op fails" alone."""
    from test_replay import _faulty_gelu_decomposition
    from torch._inductor import decomposition

    from dynaprobe.bisect import bisect_call

    monkeypatch.setitem(decomposition.decompositions, torch.ops.aten.gelu.default,
                        _faulty_gelu_decomposition)
    decomposition.fast_random_decomps.cache_clear()  # its copy of the table, made once
    try:
        torch._dynamo.reset()
        # The caches' keys miss the table: every compile here is made afresh.
        with torch._functorch.config.patch(enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False):
            call = _dump(tmp_path, GeluMLP(), "inductor")
            bisected = bisect_call(call, ops=True)
    finally:
        monkeypatch.undo()
        decomposition.fast_random_decomps.cache_clear()
    assert bisected.first_failing(True) == "aot_eager_decomp_partition", bisected.text()
    assert bisected.stages[1].name == "aot_eager" and not bisected.stages[1].failed(True)
    assert bisected.ops.findings == [], bisected.text()
    assert bisected.made_before_codegen() == "aot_eager_decomp_partition"
    assert ("the difference is in the aten graph itself: aot_eager_decomp_partition already "
            "fails and no op differs from its own eager evaluation, so one of inductor's "
            "decompositions (or the min-cut partitioner) made it, not a kernel") in \
        " ".join(bisected.text().split()), bisected.text()


def test_ops_sees_a_backend_that_wraps_compile_fx(tmp_path):
    """A backend of the user's own that calls inductor's compile_fx with its own post-grad pass
    (a config patch for its graphs alone): --ops watches the aten graphs inductor compiles under
    it, forward and the lazily compiled backward, and names the op and its kernel."""
    from models import rsqrt_via_compile_fx

    torch._dynamo.reset()
    result = _localised(tmp_path, RMSNormMLP(), rsqrt_via_compile_fx)
    assert [g.kind for g in result.graphs] == ["forward", "backward"], result.text()
    finding = result.findings[0]
    assert (finding.graph, finding.op) == ("forward", "aten.rsqrt.default"), result.text()
    assert finding.kernel is not None and finding.kernel.name.startswith("cpp_fused"), \
        result.text()
    assert result.backend == "rsqrt_via_compile_fx"
