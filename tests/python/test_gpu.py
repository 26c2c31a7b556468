"""The GPU path (issue 56): dynaprobe on CUDA with inductor generating Triton kernels.

Every test is marked ``gpu`` and skips where torch.cuda.is_available() is False; scripts/gpu_check.sh
runs them on a GPU machine (``pytest -m gpu tests/python/test_gpu.py``). With
DYNAPROBE_TEST_DEVICE=cpu they run on the CPU instead (``gpu_check.sh --dry-run`` does, for the
cheapest ones), so that the tests themselves are checked where no GPU is.

Cheap on purpose: tiny models (tests/python/models.py), one compile per configuration. In order of
priority: the main job on the device, a fault inside a generated (Triton) kernel found at its
module, clean steps in bf16, fp32 with and without TF32, under autocast and for a convolution,
and the training state untouched by the checker. The capture cost on GPT-2 is
bench/gpu_capture_cost.py, figures rather than assertions.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
from conftest import zero_eager_sums_behind_torchs_back
from models import Block, ConvBN, TinyTransformer, rsqrt_too_large
from test_examples import run_example

from dynaprobe import PrecisionChecker
from dynaprobe._steps.step import Step

DEVICE = os.environ.get("DYNAPROBE_TEST_DEVICE", "cuda")
DEVICE_TYPE = torch.device(DEVICE).type

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("fresh_inductor"),
    pytest.mark.skipif(DEVICE_TYPE == "cuda" and not torch.cuda.is_available(),
                       reason="needs CUDA (DYNAPROBE_TEST_DEVICE=cpu runs these on the CPU)"),
]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def seed(value: int = 0) -> None:
    torch.manual_seed(value)  # seeds the CUDA generators too


def lm_batch(vocab: int = 50):
    seed(1)
    ids = torch.randint(0, vocab, (2, 16)).to(DEVICE)
    targets = torch.randint(0, vocab, (2, 16)).to(DEVICE)
    return ids, targets


def lm_loss(model, ids, targets, scale: float = 1.0):
    logits = model(ids).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()) * scale


# --------------------------------------------------------------------------- a. the main job
def test_the_main_job_on_the_device_names_and_explains_the_dropout_block(tmp_path):
    proc = run_example("main_job.py", tmp_path / "run", "--device", DEVICE, cwd=tmp_path)
    out_dir = os.environ.get("DYNAPROBE_GPU_OUT")
    if out_dir:  # the report as the GPU printed it, for the record
        with open(os.path.join(out_dir, "main_job.txt"), "w") as file:
            file.write(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Modules whose compiled numbers differ: blocks.1\n" in proc.stdout, proc.stdout
    assert "inductor draws its own dropout mask" in proc.stdout
    assert "RESULT: FAILED" in proc.stdout, proc.stdout


# --------------------------------------------------------------------------- b. a kernel's fault
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fault_inside_a_generated_kernel_is_found_at_its_module(dtype, tmp_path):
    """rsqrt 5% too large inside the fused LayerNorm kernel inductor generates (Triton on CUDA):
    FAIL, with the forward root cause at the first block, for the loss as it is and scaled by
    1e-3 (one compile: the loss is scaled outside the wrapped blocks)."""
    inductor_config.post_grad_custom_post_pass = rsqrt_too_large
    seed()
    model = TinyTransformer().to(DEVICE, DTYPES[dtype])
    ids, targets = lm_batch()
    checker = PrecisionChecker(backend="inductor", dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, (Block,))
    checker.install(model)
    for scale in (1.0, 1e-3):
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model, ids, targets, scale)
        loss.backward()
        result = checker.collect(loss)
        assert not result.all_pass, result.text()
        assert result.root_cause["forward"]["module"] == "blocks.0", result.text()
        if dtype == "bf16":
            assert "beyond fp32-reference noise" in result.root_cause["next"], result.text()
        assert result.modules["blocks.0"]["compiled_functions"]
    checker.uninstall()


def test_parameter_gradients_judged_during_the_backward_report_as_judged_at_collect(
        tmp_path, monkeypatch):
    """Single-pass judges each block's parameter gradient sums during the backward, from copies
    to the host taken then (Recorder.judge_later: on the device, asynchronously, on a side
    stream), and records them at collect() from those copies: the report is the one of judging
    everything at collect(), bit for bit, with the fault inside the generated kernel, in bf16,
    the loss scaled by 1e-3."""
    inductor_config.post_grad_custom_post_pass = rsqrt_too_large
    ids, targets = lm_batch()

    def run(name, scramble=False):
        torch._dynamo.reset()
        seed()
        model = TinyTransformer().to(DEVICE, torch.bfloat16)
        checker = PrecisionChecker(backend="inductor", dump_dir=str(tmp_path / name))
        checker.wrap_by_policy(model, (Block,))
        checker.install(model)
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model, ids, targets, 1e-3)
        loss.backward()
        if scramble:
            zero_eager_sums_behind_torchs_back(checker)
        report = checker.collect(loss).csv()
        judging_ahead = {target.judge_ahead for target in checker._installation.targets}
        checker.uninstall()
        return report, judging_ahead

    # The eager sums zeroed behind torch's back after the backward change nothing: what is
    # reported was judged from the copies taken during it.
    ahead, judging_ahead = run("ahead", scramble=True)
    assert judging_ahead == {True}
    monkeypatch.setattr(Step, "judge_ahead", lambda self, target: None)
    assert ahead == run("at_collect")[0]
    assert "param_grad" in ahead and "FAIL" in ahead


# --------------------------------------------------------------------------- c. clean steps pass
CLEAN = {  # name: (weights' dtype, TF32 on, under torch.autocast(bf16))
    "bf16": (torch.bfloat16, False, False),
    "fp32": (torch.float32, False, False),
    "fp32-tf32": (torch.float32, True, False),
    "fp32-autocast-bf16": (torch.float32, False, True),
}


@pytest.mark.parametrize("case", CLEAN)
def test_a_clean_step_passes(case, tmp_path):
    dtype, tf32, autocast = CLEAN[case]
    with tf32_flags(tf32):
        result = clean_step(dtype, autocast, tmp_path)
    assert result.all_pass, result.text()
    if autocast:
        assert result.provenance["autocast"] == "torch.bfloat16"
    if dtype == torch.bfloat16 or autocast:
        referenced = [r for r in result.rows if r.check_type in ("fwd_output", "grad_input")]
        assert referenced and all(r.reference and r.reference["dtype"] == "fp32" for r in referenced)


@contextlib.contextmanager
def tf32_flags(on: bool):
    """torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32, put back after."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (matmul.allow_tf32, cudnn.allow_tf32)
    matmul.allow_tf32 = cudnn.allow_tf32 = on
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = before


def clean_step(dtype, autocast, tmp_path):
    seed()
    model = TinyTransformer().to(DEVICE, dtype)
    ids, targets = lm_batch()

    def step(m):
        m.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE_TYPE, torch.bfloat16, enabled=autocast):
            loss = lm_loss(m, ids, targets)
        loss.backward()
        return loss

    checker = PrecisionChecker(backend="inductor", dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, (Block,))
    return checker.compare(step, model)


def conv_model() -> nn.Module:
    model = ConvBN()
    model.drop = nn.Identity()  # inductor's own dropout RNG is the main job's subject, not this one's
    return model


def test_a_clean_convolution_step_passes(tmp_path):
    seed()
    model = conv_model().to(DEVICE)
    x = torch.randn(4, 3, 16, 16, device=DEVICE)

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(x).square().mean()
        loss.backward()
        return loss

    checker = PrecisionChecker(backend="inductor", dump_dir=str(tmp_path / "dump"))
    checker.wrap(model)
    result = checker.compare(step, model)
    assert result.all_pass, result.text()
    assert {"fwd_output", "param_grad"} <= {r.check_type for r in result.rows}, result.text()


# --------------------------------------------------------------------------- d. state untouched
def rng_state():
    state = [torch.get_rng_state()]
    if DEVICE_TYPE == "cuda":
        state.append(torch.cuda.get_rng_state())
    return state


@contextlib.contextmanager
def deterministic_cudnn():
    cudnn = torch.backends.cudnn
    before = (cudnn.deterministic, cudnn.benchmark)
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = before


def test_the_checked_step_trains_bit_for_bit_like_the_unchecked_one(tmp_path):
    """Dropout (inductor's own RNG) and batch norm (buffers): the checked inductor step gives the
    loss, gradients, buffers and RNG state of the same step compiled without the checker."""
    seed()
    model = ConvBN().to(DEVICE)
    unchecked = copy.deepcopy(model)
    x = torch.randn(8, 3, 8, 8, device=DEVICE)

    def step(m):
        loss = m(x).square().mean()
        loss.backward()
        return loss

    # cuDNN's convolution backward may add in any order unless told not to: both runs alike.
    with deterministic_cudnn():
        seed(2)
        expected_loss = step(torch.compile(unchecked, backend="inductor"))
        expected_rng = rng_state()
        torch._dynamo.reset()

        seed(2)
        checker = PrecisionChecker(backend="inductor", dump_dir=str(tmp_path / "dump"))
        checker.wrap(model)
        checker.install(model)
        loss = step(model)
        rng = rng_state()
        result = checker.collect(loss)
        checker.uninstall()
    assert result.rows, result.text()
    assert torch.equal(loss, expected_loss), (loss, expected_loss)
    for (name, p), (_, q) in zip(model.named_parameters(), unchecked.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), (_, c) in zip(model.named_buffers(), unchecked.named_buffers()):
        assert torch.equal(b, c), name
    for mine, theirs in zip(rng, expected_rng):
        assert torch.equal(mine, theirs)
