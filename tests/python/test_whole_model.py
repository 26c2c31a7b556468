"""Whole-model mode: install() of a model the user compiled whole (``torch.compile(model)``)
checks the wrapped modules at their boundaries inside the graphs Dynamo captures."""

import copy
import subprocess
import warnings

import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from models import plain_compiler
from torch._dynamo.backends.common import aot_autograd

from dynaprobe import PrecisionChecker

WIDTH = 8


def rows_of(result, check_type=None, module=None):
    return [r for r in result if (check_type is None or r.check_type == check_type)
            and (module is None or r.module == module)]


class Layer(nn.Module):
    """Starts with a tanh of its input and ends with an add: two layers in one graph make the
    pattern add -> tanh, which no graph of one layer holds."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.lin(torch.tanh(x))


class Stack(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(layers)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.alias.default,
          torch.ops.aten._unsafe_view.default)


def _fused_add_tanh_fault(gm: torch.fx.GraphModule, example_inputs):
    """A fake fusion bug: a tanh whose input comes (through views) from an add is 1% too large,
    as a compiler fusing add and tanh into one kernel might get it wrong. Forward only."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.tanh.default:
            continue
        source = node.args[0]
        while source.op == "call_function" and source.target in _VIEWS:
            source = source.args[0]
        if source.op == "call_function" and source.target is torch.ops.aten.add.Tensor:
            with gm.graph.inserting_after(node):
                scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.01))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    gm.recompile()
    return make_boxed_func(gm.forward)


CROSS_BOUNDARY_FAULT = aot_autograd(fw_compiler=_fused_add_tanh_fault, bw_compiler=plain_compiler)


def _train_step(model, x):
    loss = model(x)
    loss.backward()
    return loss


def _check_whole(model, backend, step=_train_step, x=None, **options):
    """One checked training step of ``model`` compiled whole with ``backend``."""
    checker = PrecisionChecker(**options)
    checker.wrap_by_policy(model, (Layer,))
    compiled = torch.compile(model, backend=backend)
    checker.install(compiled)
    try:
        step(compiled, torch.randn(4, WIDTH) if x is None else x)
        return checker, checker.collect()
    finally:
        checker.uninstall()


def test_a_fault_across_a_module_boundary_is_found_whole_and_not_per_module(tmp_path):
    torch.manual_seed(0)
    model = Stack(layers=3)
    x = torch.randn(4, WIDTH)

    _, whole = _check_whole(copy.deepcopy(model), CROSS_BOUNDARY_FAULT, x=x,
                            dump_dir=str(tmp_path / "whole"))
    status = {r.module: r.status for r in rows_of(whole, "fwd_output")}
    # layers.0's tanh reads the model's input; layers.1 and layers.2 read the previous add.
    assert status == {"layers.0": "PASS", "layers.1": "FAIL", "layers.2": "FAIL"}
    assert all(r.status == "PASS" for r in rows_of(whole, "fwd_input"))
    assert rows_of(whole, "fwd_output", "layers.1")[0].max_rel > 5e-3

    per_module = PrecisionChecker(backend=CROSS_BOUNDARY_FAULT, dump_dir=str(tmp_path / "per"))
    per_module.wrap_by_policy(model, (Layer,))
    result = per_module.compare(lambda m: _train_step(m, x), model)
    assert {r.module for r in rows_of(result, "fwd_output")} == {"layers.0", "layers.1",
                                                                 "layers.2"}
    assert result.all_pass, result.text()


def test_aot_eager_outputs_and_gradients_are_bit_identical_with_the_checker(tmp_path):
    torch.manual_seed(0)
    model = Stack(layers=3)
    x = torch.randn(4, WIDTH)
    plain = copy.deepcopy(model)
    expected_loss = _train_step(torch.compile(plain, backend="aot_eager"), x)

    def step(compiled, x):
        step.loss = _train_step(compiled, x)

    _, result = _check_whole(model, "aot_eager", step=step, x=x, dump_dir=str(tmp_path))
    assert torch.equal(step.loss, expected_loss)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    # Every boundary tensor of every layer, forward and backward, compared and equal.
    assert result.all_pass, result.text()
    for layer in ("layers.0", "layers.1", "layers.2"):
        kinds = {r.check_type for r in rows_of(result, module=layer) if r.status == "PASS"}
        # The model's input needs no gradient: layers.0 has no grad_input.
        assert kinds == {"fwd_input", "fwd_output", "grad_output", "param_grad"} | (
            set() if layer == "layers.0" else {"grad_input"})
        for row in rows_of(result, module=layer):
            assert row.max_abs == 0.0, row


def test_same_report_and_dump_as_single_pass_named_by_user_paths(tmp_path, dynaprobe_cli):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, result = _check_whole(Stack(), "aot_eager", dump_dir=str(tmp_path))
    assert {r.module for r in result} == {"layers.0", "layers.1"}  # never _orig_mod.layers.0
    assert not [w for w in caught if "gethostname" in str(w.message)]
    provenance = result._step_comparison().compiled_provenance
    assert provenance["compile_scope"] == "whole_model"
    assert provenance["mode"] == "single_pass"  # single-pass semantics: inputs recorded once
    cli = subprocess.run([dynaprobe_cli, "compare", str(tmp_path)], capture_output=True,
                         text=True)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == result.text()


def test_uninstall_gives_the_model_its_backend_back_and_unchecked_steps_run(tmp_path):
    torch.manual_seed(0)
    model = Stack()
    compiled = torch.compile(model, backend="aot_eager")
    context = compiled.dynamo_ctx
    x = torch.randn(4, WIDTH)
    _train_step(compiled, x)  # compiled and run before install(): recompiled for the checker
    checker = PrecisionChecker(dump_dir=str(tmp_path), check_every=2)
    checker.wrap_by_policy(model, (Layer,))
    checker.install(compiled)
    results = []
    for _ in range(3):
        loss = _train_step(compiled, x)
        results.append(checker.collect(loss))
    assert [r is None for r in results] == [False, True, False]
    assert results[2].all_pass and results[2].step == 2
    checker.uninstall()
    assert compiled.dynamo_ctx is context
    model.zero_grad()
    loss = _train_step(compiled, x)
    torch.testing.assert_close(loss, model(x), rtol=0, atol=0)


class Repeat(nn.Module):
    """Calls layers[0] twice and layers[1] once."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        return self.layers[0](self.layers[1](self.layers[0](x))).sum()


def test_a_module_called_twice_in_one_graph_is_compared_per_call(tmp_path):
    torch.manual_seed(0)
    _, result = _check_whole(Repeat(), "aot_eager", dump_dir=str(tmp_path))
    calls = sorted((r.module, r.call) for r in rows_of(result, "fwd_output"))
    assert calls == [("layers.0", 0), ("layers.0", 1), ("layers.1", 0)]
    assert result.all_pass, result.text()
    assert result.modules["layers.0"]["calls"] == "2"


class Broken(nn.Module):
    """A graph break in the middle of its forward."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        y = torch.tanh(self.first(x))
        torch._dynamo.graph_break()
        return x + self.second(y)


class Holder(nn.Module):
    """The graph break is inside its child."""

    def __init__(self):
        super().__init__()
        self.inner = Broken()
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.out(torch.relu(self.inner(x)))


class WithBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Broken()
        self.holder = Holder()
        self.skip = nn.Identity()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.head(self.skip(self.holder(self.block(x)))).sum()


def test_a_module_split_by_a_graph_break_or_without_operations_is_reported(tmp_path):
    torch.manual_seed(0)
    model = WithBreak()
    checker = PrecisionChecker(dump_dir=str(tmp_path))
    checker.wrap(model.block)
    checker.wrap(model.holder)
    checker.wrap(model.skip)
    compiled = torch.compile(model, backend="aot_eager")
    checker.install(compiled)
    _train_step(compiled, torch.randn(4, WIDTH))
    result = checker.collect()
    checker.uninstall()
    # The block's two pieces, one per graph, each compared as a call, and said to be pieces;
    # the holder's pieces too (its own code and its child's, around the child's break).
    assert sorted(r.call for r in rows_of(result, "fwd_output", "block")) == [0, 1]
    assert len(rows_of(result, "fwd_output", "holder")) >= 2
    for module in ("block", "holder"):
        assert all(r.status == "PASS" for r in rows_of(result, module=module)), result.text()
        assert "graph break" in result.modules[module]["graph_break_reasons"]
    # nn.Identity leaves no operation in any graph: a warning, never a silent pass.
    notes = rows_of(result, "note", "skip")
    assert [r.status for r in notes] == ["WARN"] and notes[0].note == "NOT_COMPILED"


def test_inductor_moves_outputs_and_gradients_by_at_most_rounding(tmp_path):
    """With inductor, the boundary values kept as graph outputs may change fusion; on this
    model (and the transformers models of test_whole_model_checks_every_block_of_a_transformers
    _model) the outputs and gradients come out bit-identical (docs/guide/whole-model.md,
    Fidelity)."""
    torch.manual_seed(0)
    model = Stack(layers=3)
    x = torch.randn(4, WIDTH)
    plain = copy.deepcopy(model)
    expected = _train_step(torch.compile(plain, backend="inductor"), x)

    def step(compiled, x):
        step.loss = _train_step(compiled, x)

    _, result = _check_whole(model, "inductor", step=step, x=x, dump_dir=str(tmp_path))
    torch.testing.assert_close(step.loss, expected, rtol=0, atol=1e-6)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)
    assert result.all_pass, result.text()
    assert {r.module for r in rows_of(result, "fwd_output")} == {"layers.0", "layers.1",
                                                                 "layers.2"}


@pytest.mark.slow
def test_whole_model_checks_every_block_of_a_transformers_model(tmp_path):
    from hf_models import families

    family = families()["Llama"]
    torch.manual_seed(0)
    model = family.build()
    plain = copy.deepcopy(model)
    batch = family.train_batch(model)
    expected = torch.compile(plain, backend="inductor")(**batch)
    expected.loss.backward()

    checker = PrecisionChecker(dump_dir=str(tmp_path))
    checker.wrap_by_policy(model, family.blocks)
    compiled = torch.compile(model, backend="inductor")
    checker.install(compiled)
    out = compiled(**batch)
    out.loss.backward()
    result = checker.collect(out.loss)
    checker.uninstall()

    blocks = [name for name, m in model.named_modules() if isinstance(m, family.blocks)]
    assert len(blocks) == 2
    for block in blocks:
        kinds = {r.check_type for r in rows_of(result, module=block) if r.status == "PASS"}
        assert {"fwd_input", "fwd_output", "grad_output", "grad_input", "param_grad"} <= kinds
        assert all(r.status == "PASS" for r in rows_of(result, module=block)), result.text()
    torch.testing.assert_close(out.logits, expected.logits, rtol=0, atol=1e-6)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- FSDP2
def _fsdp_worker(rank: int, summary: dict) -> None:
    import torch.nn.functional as F
    from models import Block, TinyTransformer
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyTransformer(vocab=32, width=16, heads=2, layers=2)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    checker = PrecisionChecker(dump_dir="run")
    checker.wrap_by_policy(model, (Block,))
    compiled = torch.compile(model, backend="aot_eager")
    checker.install(compiled)
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 32, (2, 8), generator=generator)
    targets = torch.randint(0, 32, (2, 8), generator=generator)
    loss = F.cross_entropy(compiled(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    result = checker.collect(loss)
    checker.uninstall()
    summary["rows"] = [[r.module, r.call, r.check_type, r.tensor_index, r.status]
                       for r in result]
    summary["modules"] = result.modules


@pytest.mark.slow
def test_whole_model_mode_runs_under_fsdp2_on_two_ranks(tmp_path):
    from test_fsdp import _spawn, _summaries

    assert _spawn(_fsdp_worker, tmp_path, timeout=240) == [0, 0]
    for summary in _summaries(tmp_path):
        rows = summary["rows"]
        assert rows and all(status == "PASS" for *_, status in rows), rows
        for block in ("blocks.0", "blocks.1"):
            kinds = {kind for module, _, kind, _, _ in rows if module == block}
            # Parameter gradients are FSDP2's reduce-scattered shards: not compared.
            assert kinds == {"fwd_input", "fwd_output", "grad_input", "grad_output"}
            # Dynamo breaks the graph at each fully_shard unit's hooks: each block is a frame.
            assert "graph break" in summary["modules"][block]["graph_break_reasons"]


class Scaler(nn.Module):
    """Changes its input in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = Scaler()
        self.layer = Layer()

    def forward(self, x):
        return self.layer(self.scale(x)).sum()


class ViewScaler(Scaler):
    """Changes half of its input in place, through a view."""

    def forward(self, x):
        x[:, :WIDTH // 2].mul_(2)
        return self.lin(x)


class InPlaceThroughAView(InPlace):
    """A layer's output, written through a view by the next module: not the graph's input."""

    def __init__(self):
        super().__init__()
        self.first = Layer()
        self.scale = ViewScaler()

    def forward(self, x):
        return self.layer(self.scale(self.first(x))).sum()


@pytest.mark.parametrize("make", [InPlace, InPlaceThroughAView])
def test_a_module_whose_boundary_is_changed_in_place_is_reported_not_compared(make, tmp_path):
    """Writes no copy can take (the graph's input, which the caller sees written; a write
    through a view, which others alias): the module is reported, not compared, and training is
    untouched. Writes across a boundary that a copy takes are checked (test_inplace.py)."""
    torch.manual_seed(0)
    model = make()
    checker = PrecisionChecker(dump_dir=str(tmp_path))
    checker.wrap(model.scale)
    checker.wrap(model.layer)
    compiled = torch.compile(model, backend="aot_eager")
    checker.install(compiled)
    x = torch.randn(4, WIDTH)
    expected = model(x.clone())
    loss = _train_step(compiled, x)
    result = checker.collect(loss)
    checker.uninstall()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    note = rows_of(result, "note", "scale")
    assert [r.status for r in note] == ["WARN"] and "in place" in note[0].reason
    assert not rows_of(result, "fwd_output", "scale")
    assert [r.status for r in rows_of(result, "fwd_output", "layer")] == ["PASS"]


def test_options_whole_model_mode_cannot_honour_are_refused(tmp_path):
    model = Stack()
    checker = PrecisionChecker(dump_dir=str(tmp_path), cast_dtype=torch.bfloat16)
    checker.wrap_by_policy(model, (Layer,))
    with pytest.raises(ValueError, match="whole-model mode.*cast_dtype is not available"):
        checker.install(torch.compile(model, backend="aot_eager"))


class _Returns(nn.Module):
    """Returns its values in another order than it computes them, one of them in a dict beside
    its own input: graph order is h, g; tensor_leaves order g, h, x."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.a(x)
        g = self.b(x)[:, :4]
        return g, {"h": h, "x": x}


class _UsesReturns(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Returns()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        g, rest = self.block(x)
        return (self.head(rest["h"]) + g.sum()).square().mean()


def test_an_output_has_the_same_index_and_label_in_every_mode():
    """fwd_output[n] and grad_output[n] are the n-th tensor the module returns, labelled by its
    key path, whether the module is compiled alone (single-pass, two-pass) or inside the whole
    model, where Dynamo's graph computes its outputs in another order."""
    torch.manual_seed(0)
    model = _UsesReturns()
    x = torch.randn(2, WIDTH)

    def tensors(result, check_type):
        return {(r.tensor_index, r.label if check_type == "fwd_output" else "", r.shape)
                for r in rows_of(result, check_type, "block")}

    def step(m):
        return _train_step(m, x)

    found = {}
    for single_pass in (True, False):
        torch._dynamo.reset()
        checker = PrecisionChecker(single_pass=single_pass)
        own = copy.deepcopy(model)
        checker.wrap(own.block)
        found[single_pass] = checker.compare(step, own)
    torch._dynamo.reset()
    checker = PrecisionChecker()
    whole_model = copy.deepcopy(model)
    checker.wrap(whole_model.block)
    compiled = torch.compile(whole_model, backend="aot_eager")
    checker.install(compiled)
    try:
        step(compiled)
        found["whole"] = checker.collect()
    finally:
        checker.uninstall()

    outputs = {(0, "[0]", (2, 4)), (1, "[1]['h']", (2, WIDTH)), (2, "[1]['x']", (2, WIDTH))}
    assert tensors(found[True], "fwd_output") == outputs
    assert tensors(found[False], "fwd_output") == outputs
    # The whole model's graph has no value for x (the module's own input): no row, no index.
    assert tensors(found["whole"], "fwd_output") == outputs - {(2, "[1]['x']", (2, WIDTH))}
    gradients = {(0, "", (2, 4)), (1, "", (2, WIDTH))}
    assert tensors(found[True], "grad_output") == gradients
    assert tensors(found["whole"], "grad_output") == gradients
    for result in found.values():
        assert result.all_pass, result.text()
