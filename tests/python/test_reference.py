"""The reference: is a difference a compiler problem or reduced-precision noise?

Each wrapped call is re-run in a wider dtype (reference="fp64"/"fp32", every call; "failing", the
calls whose forward output already fails; "auto", the default, the calls computing in bf16/fp16,
in float32); the analyzer measures eager's and compiled's errors against it, and the verdict
decides the row: noise passes, divergence fails (verdict="tolerances" keeps the spec's tolerance
check). Checked against an independent computation of the same RMSEs, on fault-injection
backends (a divergence) and, in bf16 with inductor, on real reduced-precision noise that the fixed
tolerances FAIL; in every mode (single-pass, two-pass, whole-model), under the user's own
autocast, and with a reference that cannot run.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
import torch.nn.functional as F
from conftest import zero_eager_sums_behind_torchs_back
from models import FORWARD_FAULT, RSQRT_PASS, Chain, RMSNormMLP, compiled_copy

from dynaprobe import _C, PrecisionChecker
from dynaprobe._mechanics.reference import WeightCopies
from dynaprobe._steps.step import Step


def _step(x):
    def step(m):
        m.zero_grad()
        loss = m(x)
        loss.backward()
        return loss

    return step


def _read(result, module, kind, side, index=0):
    dtype, shape, data = _C.read_record(result.dump_file, module, 0, kind, index, side)
    numpy_dtype = {"float32": np.float32, "float64": np.float64, "bfloat16": None}[dtype]
    return torch.from_numpy(np.frombuffer(data, dtype=numpy_dtype).reshape(shape).copy())


def test_every_call_gets_a_reference_and_a_fault_is_a_divergence(tmp_path):
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(4, 8)
    checker = PrecisionChecker(backend=FORWARD_FAULT, reference="fp64",
                               dump_dir=str(tmp_path / "dump"))
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(_step(x), model)

    verdicts = {(r.module, r.check_type): r.reference["verdict"]
                for r in result.rows if r.reference and r.check_type == "fwd_output"}
    assert verdicts == {("stage0", "fwd_output"): "noise", ("stage1", "fwd_output"): "divergence",
                        ("stage2", "fwd_output"): "noise", ("stage3", "fwd_output"): "noise"}
    # Backward references too: the gradients leaving each stage and of its parameters.
    assert {r.check_type for r in result.rows if r.reference} == {
        "fwd_output", "grad_input", "param_grad"}

    # The RMSEs the analyzer reports, computed here from the dump with torch in float64.
    row = next(r for r in result.rows if r.module == "stage1" and r.check_type == "fwd_output")
    reference = _read(result, "stage1", "fwd_output", "reference")
    assert reference.dtype == torch.float64
    for side in ("eager", "compiled"):
        value = _read(result, "stage1", "fwd_output", side).double()
        rmse = (value - reference.float().double()).square().mean().sqrt().item()
        assert row.reference[f"{side}_rmse"] == pytest.approx(rmse, rel=1e-5, abs=1e-12)
    assert row.reference["compiled_rmse"] > row.reference["factor"] * row.reference["eager_rmse"]

    # Shown where the spec's formats leave room: after the metrics, in the CSV note.
    assert "fp64: divergence, " in result.text()
    assert "fp64: divergence" in result.csv()
    assert "beyond fp64-reference noise" in result.root_cause["next"]


def _faulted_chain(tmp_path, **options):
    """Chain's checked step, its stage1 GELU made wrong by FORWARD_FAULT: (checker, result)."""
    torch.manual_seed(0)
    model = Chain()
    checker = PrecisionChecker(backend=FORWARD_FAULT, dump_dir=str(tmp_path / "dump"), **options)
    checker.wrap_all_children(model, depth=0)
    return checker, checker.compare(_step(torch.randn(4, 8)), model)


def test_failing_runs_the_reference_only_for_calls_that_fail(tmp_path):
    _, result = _faulted_chain(tmp_path, reference="failing")
    assert {r.module for r in result.rows if r.reference} == {"stage1"}
    assert result.modules["stage0"].get("reference_error") is None


def test_reference_modes_are_checked_up_front():
    with pytest.raises(ValueError, match="reference='failing' needs single_pass=True"):
        PrecisionChecker(single_pass=False, reference="failing")
    with pytest.raises(ValueError, match="reference must be one of None, 'auto', 'fp64', "
                                         "'fp32', 'failing'"):
        PrecisionChecker(reference="float64")
    with pytest.raises(ValueError, match="verdict must be 'reference'"):
        PrecisionChecker(verdict="allclose")
    # Every storage mode judges the reference in memory (test_storage has the verdicts).
    assert PrecisionChecker(reference="fp32", dump="stats").reference == "fp32"
    assert PrecisionChecker().reference == "auto"
    assert PrecisionChecker().verdict == "reference"


class Elementwise(nn.Module):
    """A chain of elementwise ops on bf16 under autocast: eager rounds to bf16 after every op,
    inductor fuses the chain and rounds once (docs/troubleshooting.md, "Fusion")."""

    def forward(self, h):
        return (torch.tanh(h) * h + 0.25 * h.square() - h.sigmoid()) / 1.3


class Mlp(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.act = act
        self.down = nn.Linear(256, 64)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class TwoMlps(nn.Module):
    def __init__(self):
        super().__init__()
        self.clean = Mlp(Elementwise())
        self.faulty = Mlp(nn.GELU())

    def forward(self, x):
        return self.faulty(self.clean(x)).float().square().mean()


def _faulty_inductor(gm, example_inputs):
    """inductor, with every GELU 5% too large: a compiler bug in one module."""
    from torch._inductor.compile_fx import compile_fx

    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (F.gelu, torch._C._nn.gelu):
            with gm.graph.inserting_after(node):
                scaled = gm.graph.call_function(torch.mul, (node, 1.05))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    gm.recompile()
    return compile_fx(gm, example_inputs)


@pytest.mark.slow
def test_bf16_noise_that_fixed_tolerances_fail_is_told_from_a_real_fault(tmp_path):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TwoMlps()
    checker = PrecisionChecker(backend=_faulty_inductor, cast_dtype=torch.bfloat16,
                               reference="fp64", dtype_aware_tolerances=False,
                               dump_dir=str(tmp_path / "dump"))
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(_step(torch.randn(8, 16, 64)), model)

    clean = next(r for r in result.rows if r.module == "clean" and r.check_type == "fwd_output")
    faulty = next(r for r in result.rows if r.module == "faulty" and r.check_type == "fwd_output")
    assert clean.reference["tolerance_status"] == "FAIL", "bf16 rounding should exceed 1e-4"
    assert clean.status == "PASS" and clean.reference["verdict"] == "noise", clean.reference
    assert faulty.status == "FAIL" and faulty.reference["verdict"] == "divergence"
    assert result.counts["noise_pass"] >= 1

    # The same dump judged by the tolerances alone, with the dtype-aware floor (bf16: atol 1e-2,
    # rtol 1.6e-2): the noise passes; the fault, at most 0.3 bf16 steps here, passes too: fixed
    # tolerances cannot tell them apart. With the reference deciding, the fault FAILs.
    for decides, faulty_status in ((False, "PASS"), (True, "FAIL")):
        judged = _C.compare(result.dump_dir, result.dump_dir, step=0, dtype_aware=True,
                            reference_decides=decides).steps[0]
        rows = {(r["module"], r["check_type"]): r for r in judged.rows}
        assert rows[("clean", "fwd_output")]["status"] == "PASS"
        assert rows[("clean", "fwd_output")]["tolerances"] == {"atol": 1e-2, "rtol": 1.6e-2}
        assert rows[("faulty", "fwd_output")]["reference"]["verdict"] == "divergence"
        assert rows[("faulty", "fwd_output")]["status"] == faulty_status


def _scaled_gelu_backend(factor: float):
    """aot_eager with every GELU (forward) ``factor`` times too large: a compiler bug in one
    module."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(gm, example_inputs):
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target == torch.ops.aten.gelu.default:
                with gm.graph.inserting_after(node):
                    scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, factor))
                node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        gm.recompile()
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=forward_compiler,
                        bw_compiler=lambda gm, _: make_boxed_func(gm.forward))


def _statuses(result, check_type="fwd_output"):
    return {r.module: r.status for r in result.rows if r.check_type == check_type}


def test_the_reference_decides_and_verdict_tolerances_keeps_the_spec(tmp_path, dynaprobe_cli):
    torch.manual_seed(0)
    model = Chain()
    checker = PrecisionChecker(backend=_scaled_gelu_backend(1.0005), reference="fp64",
                               dump_dir=str(tmp_path / "dump"))
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(_step(torch.randn(4, 8)), model)
    # A fault inside the tolerances (5e-4 relative) is still beyond fp64-reference noise.
    stage1 = next(r for r in result.rows if r.module == "stage1" and r.check_type == "fwd_output")
    assert stage1.reference == {**stage1.reference, "verdict": "divergence", "dtype": "fp64",
                                "tolerance_status": "PASS"}
    assert stage1.status == "FAIL" and not result.all_pass
    assert "fp64: divergence, " in result.text()
    assert "; tolerances pass)" in result.text()
    assert result.root_cause["forward"]["module"] == "stage1"

    # The spec's tolerance-only status, from the same dump: asked for at compare time ...
    spec = _C.compare(result.dump_dir, result.dump_dir, reference_decides=False).steps[0]
    assert spec.all_pass
    assert "fp64: divergence" in spec.render_text()  # still shown beside the status
    assert "; tolerances" not in spec.render_text()
    done = subprocess.run([dynaprobe_cli, "compare", result.dump_dir, "--verdict", "tolerances"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert subprocess.run([dynaprobe_cli, "compare", result.dump_dir],
                          capture_output=True, text=True).returncode == 1
    # ... or at capture, stored in the dump.
    torch._dynamo.reset()
    checker = PrecisionChecker(backend=_scaled_gelu_backend(1.0005), reference="fp64",
                               verdict="tolerances", dump_dir=str(tmp_path / "tolerances"))
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(_step(torch.randn(4, 8)), model)
    assert result.all_pass and result.provenance["verdict"] == "tolerances"


def test_fp32_runs_are_unchanged_by_the_default(tmp_path):
    """The default reference ("auto") runs nothing for a clean float32 step: its report is the
    tolerance check's, byte for byte. A float32 call whose forward output fails gets a float64
    reference (as reference="failing" gives it), whose verdict decides its rows."""
    texts = {}
    for reference in (None, "auto"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Chain()
        checker = PrecisionChecker(reference=reference, dump_dir=str(tmp_path / str(reference)))
        checker.wrap_all_children(model, depth=0)
        result = checker.compare(_step(torch.randn(4, 8)), model)
        assert result.all_pass and not any(r.reference for r in result.rows)
        texts[reference] = (result.text(), result.csv())
    assert texts[None] == texts["auto"]

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Chain()
    checker = PrecisionChecker(backend=FORWARD_FAULT, dump_dir=str(tmp_path / "fault"))
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(_step(torch.randn(4, 8)), model)
    referenced = {r.module for r in result.rows if r.reference}
    assert referenced == {"stage1"}
    row = next(r for r in result.rows if r.module == "stage1" and r.check_type == "fwd_output")
    assert row.reference["dtype"] == "fp64" and row.reference["verdict"] == "divergence"
    assert row.status == "FAIL" and not result.all_pass


def _bf16_chain(seed=0):
    torch.manual_seed(seed)
    return Chain().to(torch.bfloat16)


@pytest.mark.parametrize("mode", ["single_pass", "two_pass", "whole_model"])
def test_bf16_gets_an_fp32_reference_by_default_in_every_mode(mode, tmp_path):
    """A bf16 model, default settings: every call gets a float32 reference; a clean compile
    passes, a GELU 5% too large FAILs at stage1, the only module with a GELU."""
    x = torch.randn(16, 8).to(torch.bfloat16)
    for factor, expected in ((1.0, "PASS"), (1.05, "FAIL")):
        torch._dynamo.reset()
        model = _bf16_chain()
        backend = _scaled_gelu_backend(factor)
        checker = PrecisionChecker(backend=backend, single_pass=mode != "two_pass",
                                   dump_dir=str(tmp_path / f"{mode}{factor}"))
        checker.wrap_all_children(model, depth=0)
        if mode == "whole_model":
            compiled = checker.install(torch.compile(model, backend=backend))
            result = checker.collect(_step(x)(compiled))
            checker.uninstall()
        else:
            result = checker.compare(_step(x), model)
        outputs = [r for r in result.rows if r.check_type == "fwd_output"]
        assert outputs and all(r.reference and r.reference["dtype"] == "fp32" for r in outputs)
        assert result.provenance["reference"] == "auto"
        if expected == "PASS":
            assert result.all_pass, result.text()
        else:
            assert _statuses(result)["stage1"] == "FAIL", result.text()
            assert _statuses(result)["stage0"] == "PASS", result.text()
            assert result.root_cause["forward"]["module"] == "stage1"
            assert "beyond fp32-reference noise" in result.root_cause["next"]
    reference = _read(result, "stage1", "fwd_output", "reference")
    assert reference.dtype == torch.float32


def test_the_users_own_autocast_is_detected_and_referenced(tmp_path):
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(16, 8)

    def step(m):
        m.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            loss = m(x)
        loss.backward()
        return loss

    checker = PrecisionChecker(backend=_scaled_gelu_backend(1.05), dump_dir=str(tmp_path / "d"))
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(step, model)
    assert result.provenance["autocast"] == "torch.bfloat16"
    assert result.provenance["cast_dtype"] == "None"
    assert "autocast=torch.bfloat16" in result.text().splitlines()[1]
    assert _statuses(result)["stage1"] == "FAIL" and _statuses(result)["stage0"] == "PASS"
    assert all(r.reference for r in result.rows if r.check_type == "fwd_output")

    # Without a reference, what to do next speaks of the reduced precision, not of dropout.
    torch._dynamo.reset()
    checker = PrecisionChecker(backend=_scaled_gelu_backend(1.05), reference=None,
                               dump_dir=str(tmp_path / "none"))
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(step, model)
    assert not any(r.reference for r in result.rows)
    assert result.root_cause["next"].startswith(
        "in reduced precision (autocast torch.bfloat16)"), result.root_cause["next"]
    assert "dropout" not in result.root_cause["next"]


def test_a_reference_that_cannot_run_is_a_warn_row_that_says_why(tmp_path, dynaprobe_cli):
    class Bf16Only(nn.Module):
        """A kernel that exists in bf16 only (as some fused or quantized kernels do)."""

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            if x.dtype != torch.bfloat16:
                raise NotImplementedError(f"no kernel for {x.dtype}")
            return self.lin(x)

    torch.manual_seed(0)
    model = nn.Sequential(Bf16Only(), nn.Tanh()).to(torch.bfloat16)
    checker = PrecisionChecker(dump_dir=str(tmp_path / "d"))
    checker.wrap(model[0])
    with pytest.warns(UserWarning, match="reference could not run"):
        result = checker.compare(lambda m: m(torch.randn(4, 8).to(torch.bfloat16)).sum(), model)
    note = next(r for r in result.rows if r.note == "NO_REFERENCE")
    assert note.status == "WARN" and "NotImplementedError: no kernel for torch.float32" in \
        note.reason
    assert result.counts["no_reference_calls"] == 1 and not result.all_pass
    assert "1 call(s) without a reference" in result.text()
    cli = subprocess.run([dynaprobe_cli, "compare", result.dump_dir], capture_output=True,
                         text=True)
    assert "NO_REFERENCE" in cli.stdout and cli.returncode == 1


class OneMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Mlp(nn.GELU())

    def forward(self, x):
        return self.mlp(x).float().square().mean()


@pytest.mark.parametrize("dtype_aware", [True, False])
def test_failing_asks_the_engine_so_the_bf16_floor_applies(dtype_aware, tmp_path):
    # A bf16 call whose output differs by more than atol/rtol (1e-4, 1e-3) but within the bf16
    # floor (1e-2, 1.6e-2) passes its row, so it is not "failing" and gets no reference; without
    # the floor it fails the tolerances and gets one (whose verdict, noise, then passes it).
    # torch.allclose with atol/rtol, the judge reference="failing" had before, called it failing
    # either way. Inference: a training step's gradients would ask for the reference themselves.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = OneMlp()
    checker = PrecisionChecker(backend=_scaled_gelu_backend(1.004), cast_dtype=torch.bfloat16,
                               reference="failing", dtype_aware_tolerances=dtype_aware,
                               dump_dir=str(tmp_path / "dump"))
    checker.wrap_all_children(model, depth=0)
    x = torch.randn(8, 64)
    with torch.no_grad():
        result = checker.compare(lambda m: m(x).sum(), model)
    row = next(r for r in result.rows if r.module == "mlp" and r.check_type == "fwd_output")
    assert row.max_abs > 1e-4 + 1e-3 * row.metrics["worst"]["compiled"], row.metrics
    if dtype_aware:
        assert row.tolerances == {"atol": 1e-2, "rtol": 1.6e-2}
        assert row.status == "PASS" and row.reference is None
    else:
        assert row.reference is not None and row.reference["tolerance_status"] == "FAIL"


def test_the_failing_judge_is_the_engines_row_judging():
    def passes(rows, **options) -> bool:  # as a checker made with these options judges them
        return _C.rows_pass("mlp", rows, PrecisionChecker(**options)._judging)

    torch.manual_seed(0)
    eager = torch.randn(64).bfloat16()
    compiled = eager + eager.abs() * 2**-7  # about one bf16 step: beyond 1e-4/1e-3
    assert not torch.allclose(eager.float(), compiled.float(), atol=1e-4, rtol=1e-3)
    rows = [("fwd_output", eager, compiled)]
    assert passes(rows)  # the bf16 floor
    assert not passes(rows, dtype_aware_tolerances=False)
    # The last matching tolerance rule wins over the floor, as for the report's row.
    assert not passes(rows, tolerances={"ml*": (1e-5, 1e-5)})
    assert passes(rows, tolerances={"other": (1e-5, 1e-5)})
    assert passes(rows, dtype_aware_tolerances=False, tolerances={"fwd_output": (0.1, 0.1)})

    # float32: within the tolerances but 1% off, beyond the fp32 screen, unless the row is at the
    # rounding level of the module's other rows of the pass (a gradient that is mathematically
    # zero, such as attention's key bias, is rounding noise: 100% of itself)
    tiny = torch.randn(64) * 1e-9
    noisy = tiny * 1.01
    assert not passes([("param_grad", tiny, noisy)])
    large = torch.randn(64)
    assert passes([("param_grad", tiny, noisy), ("grad_input", large, large)])


def test_the_failing_only_view_in_python_and_the_cli(tmp_path, dynaprobe_cli, capsys):
    """report(..., only_failing=True) and `dynaprobe compare --failing` print the FAIL and WARN
    rows alone, with the whole step's RESULT line and root cause."""
    checker, result = _faulted_chain(tmp_path, reference="fp64")
    checker.report(result, only_failing=True)
    printed = capsys.readouterr().out
    full = result.text()
    rows = [line for line in printed.splitlines() if line.startswith(("  pass  ", "  FAIL  "))]
    assert rows and all(line.startswith("  FAIL  ") for line in rows), printed
    assert "  pass  stage0" in full and "  pass  stage0" not in printed
    passing = sum(r.status in ("PASS", "SKIP") for r in result.rows)
    assert f"failing rows only: {passing} passing or skipped row(s) not shown" in printed
    assert full.split("RESULT:")[1] == printed.split("RESULT:")[1]  # the whole step's
    cli = subprocess.run([dynaprobe_cli, "compare", result.dump_dir, "--failing"],
                         capture_output=True, text=True)
    assert cli.returncode == 1 and cli.stdout.startswith(result.text(only_failing=True)), cli.stdout


# ------------------------------------------------------------------ gradients that cancel (fp32)
class _InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 project, each with batch norm."""

    def __init__(self, channels: int, expand: int = 4):
        super().__init__()
        hidden = channels * expand
        self.conv = nn.Sequential(
            nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True), nn.Conv2d(hidden, channels, 1, bias=False),
            nn.BatchNorm2d(channels))

    def forward(self, x):
        return x + self.conv(x)


class _MobileNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(_InvertedResidual(8), _InvertedResidual(8))
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


_LEAVES = (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.ReLU6, nn.Linear)


def _mobilenet():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _MobileNet().to(memory_format=torch.channels_last)
    return model, torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)


def _mobilenet_state(model, x):
    """A training step of ``model`` on ``x``: its loss, gradients and buffers."""
    loss = F.cross_entropy(model(x), torch.tensor([3, 7]))
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()] + list(model.buffers())


def _mobilenet_step(dump_dir, reference="auto"):
    """One checked training step of a channels_last MobileNet-style CNN, every leaf wrapped,
    inductor, float32: the result and the step's loss, gradients and buffers."""
    model, x = _mobilenet()
    checker = PrecisionChecker(backend="inductor", reference=reference, dump_dir=str(dump_dir))
    checker.wrap_by_policy(model, _LEAVES)
    checker.install(model)
    state = _mobilenet_state(model, x)
    result = checker.collect(state[0])
    checker.uninstall()
    return result, state


def _scale_weight_gradients(graph: torch.fx.Graph) -> None:
    """An inductor post-grad pass: in a backward graph, the first gradient output that is a
    product of one dimension (a batch norm's weight gradient, sum * invstd) made 2% larger."""
    if not any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return
    output = next(n for n in graph.nodes if n.op == "output")
    for node in output.args[0]:
        if (isinstance(node, torch.fx.Node) and node.target == torch.ops.aten.mul.Tensor
                and len(node.meta["val"].shape) == 1):
            with graph.inserting_after(node):
                moved = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.02))
            node.replace_all_uses_with(moved, delete_user_cb=lambda user: user is not moved)
            return


@pytest.mark.usefixtures("fresh_inductor")
def test_float32_gradients_that_cancel_get_their_reference_when_they_fail(tmp_path):
    """A batch norm's weight gradient sums terms that cancel: inductor's reduction order moves
    it beyond the fp32 screen though both sides are as far from the exact sum. The call's forward
    passed, so it had no reference; its backward asks for one (run then, from the state before
    the call), whose verdict is noise: the step passes, and training is the step without it."""
    screened, _ = _mobilenet_step(tmp_path / "none", reference=None)
    failing = {(r.module, r.check_type) for r in screened.rows if r.status == "FAIL"}
    assert failing and all(kind == "param_grad" for _, kind in failing), screened.text()

    result, state = _mobilenet_step(tmp_path / "auto")
    assert result.all_pass, result.text()
    for module, kind in failing:
        rows = [r for r in result.rows if r.module == module and r.check_type == kind]
        assert any(r.reference and r.reference["verdict"] == "noise" for r in rows), module
    # only calls whose gradients failed got one: no forward row of a passing call has one
    assert not any(r.reference for r in result.rows if r.check_type == "fwd_output"
                   and r.module not in {m for m, _ in failing})
    model, x = _mobilenet()
    unchecked = _mobilenet_state(compiled_copy(model, _LEAVES, "inductor"), x)
    for got, want in zip(state, unchecked):
        assert torch.equal(got, want)

    inductor_config.post_grad_custom_post_pass = _scale_weight_gradients
    faulty, _ = _mobilenet_step(tmp_path / "fault")
    row = next(r for r in faulty.rows if r.module == "stem.1" and r.check_type == "param_grad")
    assert row.status == "FAIL" and row.reference["verdict"] == "divergence", faulty.text()


def _float64_calls(monkeypatch, function: str) -> list:
    """A list that gets "reference" each time ``torch.nn.functional.<function>`` runs on a
    float64 input (a float32 call's reference), patched for the test."""
    events = []
    original = getattr(F, function)

    def logged(input, *args, **kwargs):
        if input.dtype == torch.float64:
            events.append("reference")
        return original(input, *args, **kwargs)

    monkeypatch.setattr(F, function, logged)
    return events


@pytest.mark.usefixtures("fresh_inductor")
@pytest.mark.parametrize("loss_scale", [1.0, 1e-3])
def test_late_references_are_decided_once_the_training_backward_has_ended(tmp_path, monkeypatch,
                                                                          loss_scale):
    """A float32 call whose gradients may fail is decided when the backward pass ends, not call
    by call during it: meanwhile the recorder judges the parameters' gradient sums on its
    background thread, and the decision takes those verdicts. The float64 references (the
    batch norms' whose weight gradients cancel) run after the backward reached the input, with
    the loss as it is and scaled down (gradients a thousand times smaller)."""
    events = _float64_calls(monkeypatch, "batch_norm")
    model, x = _mobilenet()
    x.requires_grad_(True).register_hook(lambda grad: events.append("input"))
    checker = PrecisionChecker(backend="inductor", dump_dir=str(tmp_path))
    checker.wrap_by_policy(model, _LEAVES)
    checker.install(model)
    loss = F.cross_entropy(model(x), torch.tensor([3, 7])) * loss_scale
    assert events == []  # every call's outputs passed: no reference in the forward
    loss.backward()
    result = checker.collect(loss)
    checker.uninstall()
    assert "reference" in events and events.index("input") < events.index("reference"), events
    assert any(r.reference and r.reference["verdict"] == "noise" for r in result.rows
               if r.check_type == "param_grad"), result.text()
    assert result.all_pass, result.text()


@pytest.mark.usefixtures("fresh_inductor")
@pytest.mark.parametrize("dump", ["stats", "full"])
@pytest.mark.parametrize("backward", [True, False])
def test_float32_outputs_are_judged_off_the_training_thread_and_referenced_after(
        tmp_path, monkeypatch, dump, backward):
    """A float32 call's outputs are not judged during its forward (on a device, the training
    thread would wait for it, call after call): the recorder judges them in the background and
    holds the pairs, and the call's float64 reference runs once the backward pass has ended (at
    collect() for a call whose backward never runs), from the state before the call. Its verdict
    decides the row, with dump="stats" too, which keeps no tensor: a fault inside inductor's
    kernel (a post-grad pass making rsqrt 5% too large) is a divergence, the loss scaled by
    1e-3."""
    events = _float64_calls(monkeypatch, "linear")
    inductor_config.post_grad_custom_post_pass = RSQRT_PASS
    torch.manual_seed(0)
    model = nn.Sequential(RMSNormMLP(), nn.Tanh())
    x = torch.randn(4, 16, requires_grad=True)
    x.register_hook(lambda grad: events.append("input"))
    checker = PrecisionChecker(backend="inductor", dump=dump, dump_dir=str(tmp_path))
    checker.wrap(model[0])
    checker.install(model)
    loss = model(x).square().mean() * 1e-3
    assert events == []  # its outputs fail, yet nothing judged them or ran its reference yet
    if backward:
        loss.backward()
        assert events == ["input", "reference"]
    result = checker.collect(loss)
    checker.uninstall()
    assert events[-1] == "reference"
    row = next(r for r in result.rows if r.module == "0" and r.check_type == "fwd_output")
    assert row.status == "FAIL" and row.reference["dtype"] == "fp64", result.text()
    assert row.reference["verdict"] == "divergence", result.text()
    if backward:
        assert any(r.reference for r in result.rows if r.check_type == "param_grad")


def test_the_reference_follows_the_weights_from_step_to_step(tmp_path):
    """The reference's upcast weights keep their memory from step to step (WeightCopies): each
    step's reference runs on the weights as the optimizer left them, not on an earlier step's,
    after a step under inference_mode too."""
    model = _bf16_chain()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    checker = PrecisionChecker(dump="full", dump_dir=str(tmp_path / "dump"))
    checker.wrap_all_children(model, depth=0)
    checker.install(model)
    x = torch.randn(16, 8).to(torch.bfloat16)
    with torch.inference_mode():
        model(x)
    assert checker.collect(None).all_pass
    for _ in range(3):
        lin = model.stage0.lin  # stage0 is tanh(lin(x)), here in float32
        expected = torch.tanh(F.linear(x.float(), lin.weight.float(), lin.bias.float())).detach()
        optimizer.zero_grad()
        loss = model(x)
        loss.backward()
        result = checker.collect(loss)
        optimizer.step()
        torch.testing.assert_close(_read(result, "stage0", "fwd_output", "reference"), expected,
                                   rtol=1e-6, atol=1e-7)
    checker.uninstall()


def test_weight_copies_are_refreshed_in_memory_that_stays():
    """WeightCopies: a copy taken after reclaim() is the same memory with the new values; a
    graph that saved the old copy fails its backward instead of reading them; memory first taken
    under inference_mode serves a step in grad mode."""
    weight = torch.randn(4, 3, dtype=torch.bfloat16)
    kept = WeightCopies()
    with torch.inference_mode():
        assert not kept.take(weight, torch.float32).is_inference()
    kept.reclaim()
    first = kept.take(weight, torch.float32).requires_grad_(True)
    assert torch.equal(first, weight.float())
    output = (first * first).sum()  # saves `first` for its backward
    kept.reclaim()
    weight.add_(1)
    second = kept.take(weight, torch.float32)
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, weight.float())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        output.backward()
    assert kept.take(weight, torch.float32).data_ptr() != first.data_ptr()  # lent already
    assert kept.take(weight.t(), torch.float32).stride() == (1, 3)
    assert kept.take(weight.as_subclass(_Subclass), torch.float32) is None  # copied as before


class _Subclass(torch.Tensor):
    """A tensor subclass (as DTensor is one), whose copies WeightCopies leaves to upcast()."""


@pytest.mark.parametrize("backwards,backend", [
    (1, "gelu_fault"), (2, "gelu_fault"),
    pytest.param(1, "inductor", marks=pytest.mark.slow),
])
def test_gradients_judged_during_the_backward_report_as_judged_at_collect(backwards, backend,
                                                                          tmp_path, monkeypatch):
    """Single-pass judges a module's parameter gradient sums, and each side against the
    reference, once its backward is done, while training goes on (Step.judge_ahead); collect()
    takes those metrics. The reports are the ones of judging everything at collect(), bit for
    bit, also when the sums grow after being judged (two backwards a step: judged again, and
    that module is judged at collect() from then on); the loss scaled by 1e-3, as a real one's
    gradients are small, under a faulty backend and under inductor."""
    x = torch.randn(16, 8).to(torch.bfloat16)

    def run(name, scramble=False):
        torch._dynamo.reset()
        model = _bf16_chain()
        optimizer = torch.optim.SGD(model.parameters(), lr=100.0)
        checker = PrecisionChecker(
            backend=_scaled_gelu_backend(1.05) if backend == "gelu_fault" else backend,
            dump_dir=str(tmp_path / name))
        checker.wrap_all_children(model, depth=0)
        checker.install(model)
        reports = []
        for _ in range(2):
            optimizer.zero_grad()
            for _ in range(backwards):
                loss = model(x) * 1e-3
                loss.backward()
            if scramble:
                zero_eager_sums_behind_torchs_back(checker)
            reports.append(checker.collect(loss).csv())
            optimizer.step()
        judging_ahead = {t.judge_ahead for t in checker._installation.targets}
        checker.uninstall()
        return reports, judging_ahead

    # With one backward a step, the eager sums zeroed behind torch's back after the backward
    # change nothing: what is reported was judged during it. (With two, a step's sums grow after
    # being judged, so they are judged at collect(), as the scrambled sums would show.)
    ahead, judging_ahead = run("ahead", scramble=backwards == 1)
    # where the sums grew after being judged, judged at collect() from the second step on
    assert judging_ahead == {backwards == 1}
    monkeypatch.setattr(Step, "judge_ahead", lambda self, target: None)
    assert ahead == run("at_collect")[0]
    assert "param_grad" in ahead[0] and ("FAIL" in ahead[0]) == (backend == "gelu_fault")
