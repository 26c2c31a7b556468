"""Gradients at the module boundary and an invisible eager re-run.

grad_output / grad_input mean what ``register_full_backward_hook`` means, on both sides and in
both modes: the recorded values are checked against that hook on a plain eager copy of the model.
The single-pass eager re-run gets copies of every argument (tensors, caches, objects holding
tensors) and leaves the module's Python attributes as the training call left them.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from dynaprobe import _C, PrecisionChecker


class FusedAddNorm(nn.Module):
    """Outputs computed from each other: (norm(x + r), x + r)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(6)

    def forward(self, x, r):
        s = x + r
        return self.norm(s), s


class ReturnsInput(nn.Module):
    """An output that is an input, one that is a view of an input, the same tensor twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x, r):
        y = self.lin(x)
        return x, r[:, :3], y, y


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor


class DictAndDataclassOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x, r):
        y = self.lin(x + r)
        return {"out": y, "nested": Pair(y.tanh(), y * 2)}


class Model(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.pre = nn.Linear(6, 6)
        self.inner = inner

    def forward(self, x, r):
        return _loss(list(_flat(self.inner(self.pre(x), r))))


def _loss(outputs: list) -> torch.Tensor:
    return sum((t * (i + 1.5)).sin().sum() for i, t in enumerate(outputs))


def _flat(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat(v)
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _flat(getattr(value, f.name))
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)


def _boundary_gradients(model: Model, x, r):
    """grad_output and grad_input of model.inner by their definition (what
    register_full_backward_hook gives for tuple outputs): the loss's gradient w.r.t. each output
    position cut off from the module, and that gradient carried back to the module's inputs."""
    h = model.pre(x).detach().requires_grad_(True)
    r = r.clone().requires_grad_(True)
    outputs = list(_flat(model.inner(h, r)))
    cut = [t.detach().requires_grad_(True) for t in outputs]
    grad_output = torch.autograd.grad(_loss(cut), cut)
    grad_input = torch.autograd.grad(outputs, (h, r), grad_output)
    return {"grad_output": grad_output, "grad_input": grad_input}


def _recorded(result, kind: str, index: int, side: str):
    dtype, shape, data = _C.read_record(result.dump_file, "inner", 0, kind, index, side)
    return torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(shape).copy())


@pytest.mark.parametrize("inner", [FusedAddNorm, ReturnsInput, DictAndDataclassOutputs])
@pytest.mark.parametrize("single_pass", [True, False])
def test_gradients_are_the_ones_at_the_module_boundary(inner, single_pass, tmp_path):
    torch.manual_seed(0)
    model = Model(inner())
    x, r = torch.randn(4, 6), torch.randn(4, 6)
    expected = _boundary_gradients(copy.deepcopy(model), x, r)

    checker = PrecisionChecker(single_pass=single_pass, dump_dir=str(tmp_path / "dump"))
    checker.wrap(model.inner)

    def step(m):
        m.zero_grad()
        loss = m(x, r.clone().requires_grad_(True))
        loss.backward()
        return loss

    result = checker.compare(step, model)
    assert result.all_pass, result.text()
    sides = ["compiled"] if single_pass else ["eager", "compiled"]
    # Single-pass records grad_output once, for both sides (it seeds both backwards).
    for side in sides:
        for index, grad in enumerate(expected["grad_output"]):
            torch.testing.assert_close(_recorded(result, "grad_output", index, side), grad)
    for side in ["eager", "compiled"]:
        for index, grad in enumerate(expected["grad_input"]):
            torch.testing.assert_close(_recorded(result, "grad_input", index, side), grad)


class Cache:
    """A KV-cache-like object: the module appends to it in place."""

    def __init__(self):
        self.keys = []
        self.length = 0

    def update(self, key):
        self.keys.append(key)
        self.length += key.shape[0]
        return torch.cat(self.keys)


class Stateful(nn.Module):
    """Appends to the cache it is given, counts its calls on itself, keeps its latest input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.history = []

    def forward(self, x, cache: Cache, extra: dict):
        self.calls += 1
        self.history.append(self.calls)
        self.latest = x.detach()
        keys = cache.update(self.lin(x))
        extra["seen"] = extra.get("seen", 0) + 1
        return keys.sum(0, keepdim=True) + x


def test_the_eager_rerun_changes_no_argument_and_no_module_attribute(tmp_path):
    torch.manual_seed(0)
    model = Stateful()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4, requires_grad=True)

    reference_cache, reference_extra = Cache(), {}
    reference(x, reference_cache, reference_extra).sum().backward()

    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    checker.wrap(model)
    checker.install(_Holder(model))
    cache, extra = Cache(), {}
    model(x, cache, extra).sum().backward()
    result = checker.collect()

    assert result.all_pass, result.text()
    assert cache.length == reference_cache.length == 2 and len(cache.keys) == 1
    assert extra == reference_extra == {"seen": 1}
    assert model.calls == 1 and model.history == [1]
    assert torch.equal(model.latest, reference.latest)
    assert {r.check_type for r in result.rows} >= {"fwd_output", "grad_input", "param_grad"}


class _Holder(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner


class Uncopyable:
    def __deepcopy__(self, memo):
        raise TypeError("holds an OS handle")


class TakesUncopyable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, handle):
        return self.lin(x)


def test_an_argument_that_cannot_be_copied_is_shared_with_a_warning(tmp_path):
    model = _Holder(TakesUncopyable())
    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    checker.wrap(model.inner)
    checker.install(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.inner(torch.randn(2, 4), Uncopyable())
    result = checker.collect()
    messages = [str(w.message) for w in caught if "dynaprobe" in str(w.message)]
    assert any("Uncopyable" in m and "cannot be deep-copied" in m for m in messages), messages
    assert "Uncopyable" in result.modules["inner"]["shared_arguments"]
    assert result.all_pass


def test_batch_norm_statistics_are_updated_once(tmp_path):
    torch.manual_seed(0)
    model = _Holder(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4)
    reference.inner(x).sum().backward()
    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    checker.wrap(model.inner)
    checker.install(model)
    model.inner(x).sum().backward()
    assert checker.collect().all_pass
    for (name, buffer), (_, expected) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(buffer, expected, rtol=0, atol=1e-6, msg=name)


CALLS = 0


class CountsGlobally(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        global CALLS
        CALLS += 1
        return self.lin(x)


def test_a_module_level_name_the_rerun_rebinds_is_put_back_with_a_warning(tmp_path):
    global CALLS
    CALLS = 0
    model = _Holder(CountsGlobally())
    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    checker.wrap(model.inner)
    checker.install(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.inner(torch.randn(2, 4)).sum().backward()
    assert checker.collect().all_pass
    assert CALLS == 1  # the training call's increment only
    messages = [str(w.message) for w in caught if "module-level names" in str(w.message)]
    assert messages and f"{__name__}.CALLS" in messages[0], messages


class AddsParameter(nn.Module):
    """``x * 2 + p``: the gradient of ``p`` is the module's grad_output itself, the very tensor
    training's backward holds (autograd passes it through the add on both sides)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, 6))

    def forward(self, x):
        return x * 2 + self.p


class ClipsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(6, 6)
        self.inner = AddsParameter()

    def forward(self, x):
        return self.inner(self.pre(x)).sin().sum()


@pytest.mark.parametrize("dump", ["full", "stats"])
def test_parameter_gradients_are_the_ones_before_training_changes_grad_in_place(dump, tmp_path):
    """Gradient clipping (an in-place change of every ``.grad``) between backward and collect()
    changes neither side's recorded parameter gradients: what training's backward produced is
    compared, on both sides, whatever tensors the eager re-run's gradients share with training."""
    torch.manual_seed(0)
    model = ClipsModel()
    x = torch.randn(4, 6)
    reference = copy.deepcopy(model)
    reference(x).backward()
    expected = reference.inner.p.grad.clone()

    checker = PrecisionChecker(dump=dump, dump_dir=str(tmp_path / "dump"))
    checker.wrap(model.inner)
    checker.install(model)
    loss = model(x)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)  # scales every .grad
    assert not torch.allclose(model.inner.p.grad, expected)
    result = checker.collect(loss)
    checker.uninstall()

    rows = [r for r in result if r.check_type == "param_grad"]
    assert rows and all(r.status == "PASS" for r in rows), result.text()
    if dump == "full":
        for side in ("eager", "compiled"):
            dtype, shape, data = _C.read_record(result.dump_file, "inner", 0, "param_grad", 0,
                                                side)
            recorded = torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(shape).copy())
            torch.testing.assert_close(recorded, expected)


class KeyCache:
    """A KV cache a layer appends to: a later call reads what an earlier one left."""

    def __init__(self):
        self.keys = {}

    def update(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        if layer in self.keys:
            keys = torch.cat([self.keys[layer], keys], dim=1)
        self.keys[layer] = keys
        return keys


class CachedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(6, 6)
        self.k = nn.Linear(6, 6)

    def forward(self, x, cache: KeyCache):
        keys = cache.update(0, self.k(x))
        scores = self.q(x) @ keys.transpose(1, 2)
        return x + scores.softmax(-1) @ keys


def test_gradient_through_what_a_call_leaves_in_its_arguments_reaches_its_eager_backward(
        tmp_path):
    """A layer run twice in a step with one cache (Dory, looped transformers): the second call
    reads the keys the first left in the cache, so the first call's gradient includes a path
    through the second. Its eager re-run must be seeded with it too, or its grad_input and its
    k's gradient differ from the compiled side's when nothing was miscompiled."""
    torch.manual_seed(0)
    model = CachedAttention()
    x = torch.randn(2, 4, 6, requires_grad=True)

    reference = copy.deepcopy(model)
    cache = KeyCache()
    out = reference(reference(x, cache), cache)
    out.square().sum().backward()

    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    checker.wrap(model)
    checker.install(model)
    cache = KeyCache()
    x_checked = x.detach().clone().requires_grad_(True)
    out = model(model(x_checked, cache), cache)
    out.square().sum().backward()
    result = checker.collect()
    checker.uninstall()

    assert result.all_pass, result.text()
    grad_inputs = {row.call: row for row in result.rows if row.check_type == "grad_input"}
    assert set(grad_inputs) == {0, 1} and all(r.status == "PASS" for r in grad_inputs.values())
    assert torch.equal(x_checked.grad, x.grad)  # training untouched
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    assert cache.keys[0].shape == (2, 8, 6)  # appended once per call, not by the re-run


class CachedGelu(nn.Module):
    """Leaves its keys in the cache it is given, through a GELU (what FORWARD_FAULT breaks)."""

    def __init__(self):
        super().__init__()
        self.k = nn.Linear(6, 6)

    def forward(self, x, cache: KeyCache):
        keys = cache.update(0, nn.functional.gelu(self.k(x)))
        return x * keys.mean(1, keepdim=True)


def test_a_failing_float32_call_that_leaves_tensors_gets_its_reference_with_their_twins(
        tmp_path):
    """A float32 call's reference is decided once its backward has run, except for a call that
    leaves tensors in its arguments: its reference needs the twins of what it left, found at
    the end of its forward, so it is decided there, from its outputs' verdicts. Called twice
    with one cache, the first call's gradient flows back through what it left; the reference's
    backward, seeded with it too, stands for eager's: eager's gradient is within rounding of it,
    and the outputs (the GELU made 1% larger) are a divergence."""
    from models import FORWARD_FAULT

    torch.manual_seed(0)
    model = CachedGelu()
    checker = PrecisionChecker(backend=FORWARD_FAULT, dump_dir=str(tmp_path / "dump"))
    checker.wrap(model)
    checker.install(model)
    cache = KeyCache()
    x = torch.randn(2, 4, 6, requires_grad=True)
    loss = model(model(x, cache), cache).square().sum()
    loss.backward()
    result = checker.collect(loss)
    checker.uninstall()
    referenced = {(r.call, r.check_type): r.reference for r in result.rows if r.reference}
    assert referenced[(0, "fwd_output")]["verdict"] == "divergence", result.text()
    assert referenced[(0, "fwd_output")]["dtype"] == "fp64"
    # eager's own error against the reference's gradient is float32 rounding: the reference's
    # backward was seeded through what it left too (without, it misses the second call's path)
    assert referenced[(0, "grad_input")]["eager_rmse"] < 1e-6, result.text()


class _ScaleIgnoringWeight(torch.autograd.Function):
    """Returns no gradient for ``weight``: autograd calls its hooks with None (AXK2's case)."""

    @staticmethod
    def forward(ctx, x, weight):
        return x * 2 + weight.detach() * 0

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


class UndefinedWeightGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(6))
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(_ScaleIgnoringWeight.apply(x, self.weight))


@pytest.mark.parametrize("single_pass", [True, False])
def test_a_parameter_autograd_gives_no_gradient_breaks_nothing(single_pass, tmp_path):
    torch.manual_seed(0)
    model = UndefinedWeightGradient()
    x = torch.randn(2, 6, requires_grad=True)
    checker = PrecisionChecker(single_pass=single_pass, dump_dir=str(tmp_path / "dump"))
    checker.wrap(model)
    if single_pass:
        checker.install(model)
        model(x).sum().backward()
        result = checker.collect()
        assert model.weight.grad is None and model.lin.weight.grad is not None
    else:
        def step(m):
            loss = m(x).sum()
            loss.backward()
            return loss

        result = checker.compare(step, model)
    assert result.all_pass, result.text()
    params = {row.label for row in result.rows if row.check_type == "param_grad"}
    assert "lin.weight" in params and "weight" not in params


class MaskedNorms(nn.Module):
    """Its caller multiplies each norm's output by a mask in place, as XLM does after every
    layer norm: autograd then routes the gradient around a view of the output."""

    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(6) for _ in range(2))
        self.proj = nn.Linear(6, 6)

    def forward(self, x, mask):
        for norm in self.norms:
            x = norm(self.proj(x))
            x *= mask
        return x


def test_an_output_its_caller_changes_in_place_still_gets_its_backward_compared(tmp_path):
    torch.manual_seed(0)
    model = MaskedNorms()
    x, mask = torch.randn(2, 4, 6), (torch.rand(2, 4, 1) > 0.3).float()
    reference = copy.deepcopy(model)
    reference(x, mask).square().sum().backward()
    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, nn.LayerNorm)
    checker.install(model)
    model(x, mask).square().sum().backward()
    result = checker.collect()
    checker.uninstall()
    assert result.all_pass, result.text()
    for name in ("norms.0", "norms.1"):
        kinds = {(r.check_type, r.status) for r in result.rows if r.module == name}
        assert {("grad_output", "PASS"), ("grad_input", "PASS"), ("param_grad", "PASS")} <= kinds
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name  # training untouched


class Mixes(nn.Module):
    """Takes its input twice, as NeoMME's first layer does (hidden and initial hidden states)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.mix = nn.Parameter(torch.tensor([0.9, 0.1]))

    def forward(self, hidden, initial):
        return self.lin(self.mix[0] * hidden + self.mix[1] * initial.tanh())


@pytest.mark.parametrize("single_pass", [True, False])
def test_a_tensor_passed_twice_is_one_input_with_one_gradient(single_pass, tmp_path):
    """Probed once, at its first position, on both sides: its grad_input is the gradient through
    both arguments, and Dynamo sees one input, as without the checker, so training is bit for bit
    the unchecked compiled step's (Funnel passes one tensor as query, key and value)."""
    torch.manual_seed(0)
    model = nn.Sequential(Mixes(), nn.Linear(6, 6))
    x = torch.randn(2, 6)

    def step(m):
        h = m[1](x)
        loss = m[1](m[0](h, h)).square().sum()
        loss.backward()
        return loss

    reference = copy.deepcopy(model)
    reference[0].forward = torch.compile(reference[0].forward, backend="aot_eager")
    step(reference)
    torch._dynamo.reset()
    checker = PrecisionChecker(single_pass=single_pass, dump_dir=str(tmp_path / "dump"))
    checker.wrap(model[0])
    result = checker.compare(step, model)
    assert result.all_pass, result.text()
    grads = [r for r in result.rows if r.check_type == "grad_input"]
    assert [(r.tensor_index, r.status) for r in grads] == [(0, "PASS")]
    if single_pass:  # the model itself trained: bit for bit the unchecked compiled step
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            assert torch.equal(p.grad, q.grad), name
