"""The fp64 reference: is a difference a compiler problem or reduced-precision noise?

Each wrapped call is re-run in float64 (reference="fp64", or only the calls whose forward output
already fails: reference="failing"); the analyzer measures eager's and compiled's errors against
it. Checked against an independent computation of the same RMSEs, on a fault-injection backend
(a divergence) and, under bf16 autocast with inductor, on real reduced-precision noise that the
fixed tolerances FAIL.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import FORWARD_FAULT, Chain

from dynaprobe import PrecisionChecker, _C


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
    assert "fp64: divergence (rmse compiled=" in result.text()
    assert "fp64: divergence" in result.csv()
    assert "beyond fp64-reference noise" in result.root_cause["next"]


def test_failing_runs_the_reference_only_for_calls_that_fail(tmp_path):
    torch.manual_seed(0)
    model = Chain()
    checker = PrecisionChecker(backend=FORWARD_FAULT, reference="failing",
                               dump_dir=str(tmp_path / "dump"))
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(_step(torch.randn(4, 8)), model)
    assert {r.module for r in result.rows if r.reference} == {"stage1"}
    assert result.modules["stage0"].get("reference_error") is None


def test_reference_needs_single_pass_and_a_known_mode():
    with pytest.raises(ValueError, match="needs single_pass=True"):
        PrecisionChecker(single_pass=False, reference="fp64")
    with pytest.raises(ValueError, match="reference must be None, 'fp64' or 'failing'"):
        PrecisionChecker(reference="float64")


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
    assert clean.status == "FAIL", "inductor's bf16 rounding should exceed atol=1e-4"
    assert clean.reference["verdict"] == "noise", clean.reference
    assert faulty.status == "FAIL" and faulty.reference["verdict"] == "divergence"

    # The same dump judged with the dtype-aware floor (bf16: atol 1e-2, rtol 1.6e-2): the noise
    # passes; the fault, at most 0.3 bf16 steps here, passes too: fixed tolerances cannot tell
    # them apart, the reference verdict can.
    judged = _C.compare(result.dump_dir, result.dump_dir, step=0, dtype_aware=True).steps[0]
    rows = {(r["module"], r["check_type"]): r for r in judged.rows}
    assert rows[("clean", "fwd_output")]["status"] == "PASS"
    assert rows[("clean", "fwd_output")]["tolerances"] == {"atol": 1e-2, "rtol": 1.6e-2}
    assert rows[("faulty", "fwd_output")]["reference"]["verdict"] == "divergence"
