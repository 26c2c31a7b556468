"""Modules that write their inputs in place, as vision code does everywhere: ``ReLU(inplace=True)``,
an input scaled in place, a residual ``x += skip``, BatchNorm's running statistics in training
mode. Each is wrapped in a small CNN and checked in single-pass (the training call compiled, the
eager re-run and the reference on copies) under aot_eager and inductor, and in two-pass, training
and inference:

- a clean step passes with forward and backward rows for every such module, and the checked step is
  the step the user runs without the checker, bit for bit: loss, every gradient, every buffer
  (BatchNorm's running statistics updated once);
- an inductor post-grad pass that moves one op inside the module's own kernel (5%) makes that
  module the root cause.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
from models import compiled_copy
from test_replay import _routes

from dynaprobe import _C, PrecisionChecker
from dynaprobe._offline.replay import load_call

pytestmark = pytest.mark.usefixtures("fresh_inductor")


class ScaledInPlace(nn.Module):
    """Scales its input in place, then convolves it."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        x.mul_(0.5)
        return self.conv(x)


class ResidualAdd(nn.Module):
    """A residual added in place to its input (``out += identity`` of a ResNet block)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)

    def forward(self, x, skip):
        x += skip
        return self.conv(x)


class InPlaceCNN(nn.Module):
    def __init__(self, channels: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.scale = ScaledInPlace(channels)
        self.bn = nn.BatchNorm2d(channels)
        self.act = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.residual = ResidualAdd(channels)
        self.head = nn.Linear(channels, 4)

    def forward(self, x):
        h = self.act(self.bn(self.scale(self.stem(x))))
        y = self.residual(self.bn2(self.conv(h)), h)
        return self.head(y.mean((2, 3)))


class Halve(nn.Module):
    """Halves its input in place and returns nothing: its caller reads the written input."""

    def forward(self, x):
        x.mul_(0.5)


class ReadsWrittenInput(nn.Module):
    def __init__(self, channels: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.halve = Halve()
        self.head = nn.Linear(channels, 4)

    def forward(self, x):
        h = self.stem(x)
        self.halve(h)
        return self.head(h.mean((2, 3)))


class AddsInto(nn.Module):
    """Adds a convolution of ``x`` into ``out`` in place and returns nothing: its result is the
    input it writes."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)

    def forward(self, x, out):
        out.add_(self.conv(x))


class WritesItsResult(nn.Module):
    """Modules whose results reach the loss only through inputs they write: a tensor that
    requires grad (Halve), a zero buffer that does not until written (AddsInto)."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.halve = Halve()
        self.adds = AddsInto(channels)
        self.head = nn.Linear(channels, 4)

    def forward(self, x):
        h = self.stem(x)
        self.halve(h)
        out = torch.zeros_like(h)
        self.adds(h, out)
        return self.head(out.mean((2, 3)))


# The wrapped modules, by the op of theirs that the fault below moves (an op no other wrapped
# module computes in the same form).
WRAPPED = (ScaledInPlace, nn.BatchNorm2d, nn.ReLU, ResidualAdd)
INPLACE_MODULES = ("scale", "bn", "act", "residual")


def _moves(node, module: str) -> bool:
    """Whether ``node`` of a post-grad graph is the op of ``module`` the fault moves."""
    if node.op != "call_function":
        return False
    aten = torch.ops.aten
    if module in ("scale", "halve"):  # x.mul_(0.5)
        return node.target == aten.mul.Tensor and 0.5 in node.args
    if module == "bn":  # the normalisation's rsqrt (bn2 computes one too)
        return node.target == aten.rsqrt.default
    if module == "act":
        return node.target == aten.relu.default
    # residual, adds: the only sum of two 4-d tensors of one shape (batch norm adds a broadcast
    # bias)
    shapes = [getattr(a.meta.get("val"), "shape", None) if isinstance(a, torch.fx.Node) else None
              for a in node.args]
    return (node.target == aten.add.Tensor and len(shapes) == 2 and shapes[0] is not None
            and len(shapes[0]) == 4 and shapes[0] == shapes[1])


def _fault_in(module: str):
    """An inductor post-grad pass making ``module``'s op 5% too large inside its kernel."""
    def fault(graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if _moves(node, module):
                with graph.inserting_after(node):
                    moved = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.05))
                node.replace_all_uses_with(moved, delete_user_cb=lambda user: user is not moved)

    return fault


def _step(model, x, target, scale: float = 1.0):
    model.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), target) * scale
    loss.backward()
    return loss


def _state(model, loss):
    """What a training step leaves: the loss, every gradient, every buffer."""
    state = {"loss": loss.detach().clone()}
    state.update({f"grad {n}": p.grad.clone() for n, p in model.named_parameters()})
    state.update({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    return state


def _unchecked(model, backend, x, target):
    """The step without the checker."""
    model = compiled_copy(model, WRAPPED, backend)
    return _state(model, _step(model, x, target))


def _data():
    torch.manual_seed(0)
    return InPlaceCNN(), torch.randn(4, 3, 8, 8), torch.randn(4, 4)


def _recorded(result, module: str, kind: str, side: str) -> torch.Tensor:
    dtype, shape, data = _C.read_record(result.dump_file, module, 0, kind, 0, side)
    assert dtype == "float32"
    return torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(shape).copy())


def _assert_bit_identical(checked: dict, unchecked: dict) -> None:
    assert checked.keys() == unchecked.keys()
    for name, value in unchecked.items():
        assert torch.equal(checked[name], value), name


def _check(model, backend, x, target, dump_dir):
    """The checked training step's result and what it left in the model."""
    checker = PrecisionChecker(backend=backend, dump_dir=str(dump_dir))
    checker.wrap_by_policy(model, WRAPPED)
    checker.install(model)
    loss = _step(model, x, target)
    result = checker.collect(loss)
    checker.uninstall()
    return result, _state(model, loss)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_modules_writing_their_inputs_pass_and_leave_the_step_as_without_the_checker(
        backend, tmp_path):
    model, x, target = _data()
    unchecked = _unchecked(model, backend, x, target)
    torch._dynamo.reset()
    result, checked = _check(model, backend, x, target, tmp_path / "dump")

    assert result.all_pass, result.text()
    assert "HOOK_ERROR" not in result.text() and "MISSING" not in result.text(), result.text()
    for name in INPLACE_MODULES + ("bn2",):
        kinds = {r.check_type for r in result.rows if r.module == name}
        wanted = {"fwd_output", "grad_input"} | ({"param_grad"} if name != "act" else set())
        assert wanted <= kinds, (name, kinds)
    _assert_bit_identical(checked, unchecked)
    # grad_input is the gradient of the input's value on entry, on both sides, by its definition
    entry = _recorded(result, "scale", "fwd_input", "compiled").requires_grad_(True)
    grad_output = _recorded(result, "scale", "grad_output", "compiled")
    (expected,) = torch.autograd.grad(model.scale(entry.clone()), entry, grad_output)
    for side in ("eager", "compiled"):
        torch.testing.assert_close(_recorded(result, "scale", "grad_input", side), expected)


@pytest.mark.parametrize("backend", ["aot_eager",
                                     pytest.param("inductor", marks=pytest.mark.slow)])
def test_modules_whose_result_is_an_input_they_write_are_checked(backend, tmp_path):
    """Modules that return nothing and write their result into an input: single-pass compares
    what they wrote as their output, and the gradient reaching it seeds the eager backward, so
    both have grad_input (and param_grad) rows on both sides; the step is the unchecked one bit
    for bit. A fault in AddsInto's kernel makes it the root cause."""
    torch.manual_seed(0)
    model, x, target = WritesItsResult(), torch.randn(4, 3, 8, 8), torch.randn(4, 4)
    wrapped = (Halve, AddsInto)
    plain = compiled_copy(model, wrapped, backend)
    unchecked = _state(plain, _step(plain, x, target))
    torch._dynamo.reset()
    checker = PrecisionChecker(backend=backend, dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, wrapped)
    checker.install(model)
    loss = _step(model, x, target)
    result = checker.collect(loss)

    assert result.all_pass, result.text()
    assert "MISSING" not in result.text(), result.text()
    for name, wanted in (("halve", {"fwd_output", "grad_input"}),
                         ("adds", {"fwd_output", "grad_input", "param_grad"})):
        assert wanted <= {r.check_type for r in result.rows if r.module == name}, result.text()
    _assert_bit_identical(_state(model, loss), unchecked)
    if backend == "inductor":
        torch._dynamo.reset()
        inductor_config.post_grad_custom_post_pass = _fault_in("adds")
        for scale in (1.0, 1e-3):  # the loss as returned, and as a loss scaler makes it
            result = checker.collect(_step(model, x, target, scale))
            assert not result.all_pass, result.text()
            assert result.root_cause["forward"]["module"] == "adds", result.text()
    checker.uninstall()


@pytest.mark.parametrize("backend", ["aot_eager",
                                     pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("make, wrapped, faulty", [(InPlaceCNN, WRAPPED, "scale"),
                                                   (WritesItsResult, (Halve, AddsInto), "halve")])
def test_whole_model_checks_modules_writing_their_inputs(make, wrapped, faulty, backend,
                                                         tmp_path):
    """The model compiled whole: a value written in place across a module's boundary (its
    input, or its output the next module writes) is written on a copy the writer makes, so every
    module is compared with forward and backward rows, and a module returning nothing gives what
    it wrote. The step is the unchecked one bit for bit under aot_eager; under inductor within
    fp32 reduction order (whole-model.md, Fidelity). A fault in a writing module's kernel makes
    it the root cause."""
    torch.manual_seed(0)
    model, x, target = make(), torch.randn(4, 3, 8, 8), torch.randn(4, 4)
    plain = torch.compile(copy.deepcopy(model), backend=backend)
    unchecked = _state(plain._orig_mod, _step(plain, x, target))
    torch._dynamo.reset()
    checker = PrecisionChecker(backend=backend, dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, wrapped)
    compiled = checker.install(torch.compile(model, backend=backend))
    loss = _step(compiled, x, target)
    result = checker.collect(loss)

    assert result.all_pass, result.text()
    assert "NOT_COMPILED" not in result.text() and "MISSING" not in result.text(), result.text()
    for name, module in model.named_modules():
        if isinstance(module, wrapped):
            kinds = {r.check_type for r in result.rows if r.module == name}
            wanted = {"fwd_output", "grad_input"} | ({"param_grad"} if any(
                p.requires_grad for p in module.parameters()) else set())
            assert wanted <= kinds, (name, kinds)
    checked = _state(model, loss)
    if backend == "aot_eager":
        _assert_bit_identical(checked, unchecked)
    else:
        for name, value in unchecked.items():
            torch.testing.assert_close(checked[name], value, rtol=1e-5, atol=1e-5, msg=name)
        torch._dynamo.reset()
        inductor_config.post_grad_custom_post_pass = _fault_in(faulty)
        for scale in (1.0, 1e-3):  # the loss as returned, and as a loss scaler makes it
            result = checker.collect(_step(compiled, x, target, scale))
            assert result.root_cause["forward"]["module"] == faulty, result.text()
    checker.uninstall()


@pytest.mark.slow
def test_a_bf16_inductor_step_through_modules_writing_their_inputs_changes_nothing(tmp_path):
    """bf16 under inductor (the float32 reference on): passing, and the checked step is the
    unchecked one bit for bit, running statistics included (issue 47)."""
    model, x, target = (value.to(torch.bfloat16) for value in _data())
    unchecked = _unchecked(model, "inductor", x, target)
    torch._dynamo.reset()
    result, checked = _check(model, "inductor", x, target, tmp_path / "dump")

    assert result.all_pass, result.text()
    assert "HOOK_ERROR" not in result.text() and "MISSING" not in result.text(), result.text()
    _assert_bit_identical(checked, unchecked)


def _two_pass_training(model, backend, x, target, dump_dir, scale: float = 1.0):
    checker = PrecisionChecker(backend=backend, single_pass=False, dump_dir=str(dump_dir))
    checker.wrap_by_policy(model, WRAPPED)
    return checker.compare(lambda m: _step(m, x, target, scale), model)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_two_pass_training_through_modules_writing_their_inputs_passes(backend, tmp_path):
    """Each side's probes are written in place (by the module, or by the next module: ``act``
    writes ``bn``'s output) and still see the gradient at the module boundary, on both sides."""
    model, x, target = _data()
    result = _two_pass_training(model, backend, x, target, tmp_path / "dump")

    assert result.all_pass, result.text()
    assert "HOOK_ERROR" not in result.text() and "MISSING" not in result.text(), result.text()
    for name in INPLACE_MODULES + ("bn2",):
        kinds = {r.check_type for r in result.rows if r.module == name}
        assert {"fwd_output", "grad_input", "grad_output"} <= kinds, (name, kinds)
    for side in ("eager", "compiled"):
        entry = _recorded(result, "scale", "fwd_input", side).requires_grad_(True)
        grad_output = _recorded(result, "scale", "grad_output", side)
        (expected,) = torch.autograd.grad(model.scale(entry.clone()), entry, grad_output)
        torch.testing.assert_close(_recorded(result, "scale", "grad_input", side), expected)


@pytest.mark.parametrize("side, backend", [
    ("eager", "aot_eager"), ("compiled", "aot_eager"),
    pytest.param("compiled", "inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("make", [InPlaceCNN, ReadsWrittenInput])
def test_each_two_pass_side_trains_as_without_the_checker(make, side, backend, tmp_path):
    """A two-pass side runs the step the user runs without the checker, bit for bit, also when
    the caller reads an input the module wrote (ReadsWrittenInput: its gradient flows through the
    write)."""
    torch.manual_seed(0)
    model, x, target = make(), torch.randn(4, 3, 8, 8), torch.randn(4, 4)
    wrapped = WRAPPED + (Halve,)
    plain = compiled_copy(model, wrapped, backend) if side == "compiled" \
        else copy.deepcopy(model)
    expected = _state(plain, _step(plain, x, target))
    torch._dynamo.reset()

    checker = PrecisionChecker(backend=backend, single_pass=False,
                               dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, wrapped)
    losses = []

    def step(m):
        losses.append(_step(m, x, target))
        return losses[-1]

    checker.capture(step, model, side)
    _assert_bit_identical(_state(model, losses[-1]), expected)


@pytest.mark.slow
def test_two_pass_training_finds_a_fault_inside_a_module_writing_its_input(tmp_path):
    model, x, target = _data()
    inductor_config.post_grad_custom_post_pass = _fault_in("act")
    for scale in (1.0, 1e-3):
        result = _two_pass_training(model, "inductor", x, target, tmp_path / f"dump{scale}",
                                    scale)
        assert not result.all_pass, result.text()
        assert "HOOK_ERROR" not in result.text() and "MISSING" not in result.text()
        assert result.root_cause["forward"]["module"] == "act", result.text()
        assert result.root_cause["forward"]["origin"] == "local", result.text()


@pytest.mark.parametrize("backend", ["aot_eager",
                                     pytest.param("inductor", marks=pytest.mark.slow)])
def test_calls_writing_their_inputs_replay_bit_for_bit_by_both_routes(backend, tmp_path):
    """A replay (replay="all") of each call, through the module and from the captured graph,
    eagerly and compiled, gives back the outputs and gradients the check recorded: the replay
    gives the call its inputs and buffers as they were before it wrote them, and lets it write
    them (not leaves that autograd protects)."""
    model, x, target = _data()
    checker = PrecisionChecker(backend=backend, dump_dir=str(tmp_path / "dump"), replay="all")
    checker.wrap_by_policy(model, WRAPPED)
    checker.install(model)
    result = checker.collect(_step(model, x, target))
    checker.uninstall()
    assert result.all_pass, result.text()
    for name in INPLACE_MODULES + ("bn2",):
        call = load_call(checker.dump_dir, name)
        for route, replay in _routes(call).items():
            for side, compiler in (("eager", None), ("compiled", call.backend())):
                run = replay.run(compiler)
                for kind, got in (("fwd_output", run.outputs[0]),
                                  ("grad_input", run.grad_input[0])):
                    assert torch.equal(got, _recorded(result, name, kind, side)), \
                        (name, route, side, kind)


def test_two_pass_inference_through_modules_writing_their_inputs_passes(tmp_path):
    model, x, _ = _data()
    checker = PrecisionChecker(single_pass=False, dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, WRAPPED)

    def infer(m):
        with torch.no_grad():
            return m(x).pow(2).mean()

    result = checker.compare(infer, model)
    assert result.all_pass, result.text()
    assert {r.module for r in result.rows if r.check_type == "fwd_output"} >= set(INPLACE_MODULES)


@pytest.mark.slow
@pytest.mark.parametrize("module", INPLACE_MODULES)
def test_a_fault_inside_a_module_writing_its_input_is_found_at_that_module(module, tmp_path):
    model, x, target = _data()
    inductor_config.post_grad_custom_post_pass = _fault_in(module)
    checker = PrecisionChecker(backend="inductor", dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, WRAPPED)
    checker.install(model)
    for scale in (1.0, 1e-3):  # the loss as returned, and as a loss scaler makes it
        result = checker.collect(_step(model, x, target, scale))
        assert not result.all_pass, result.text()
        assert "HOOK_ERROR" not in result.text(), result.text()
        assert result.root_cause["forward"]["module"] == module, result.text()
    checker.uninstall()
