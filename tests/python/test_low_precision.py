"""Verdicts in bf16 on real models: tiny transformers families (hf_models.py) trained one step in
bfloat16 under inductor with default settings. The float32 reference is on by default and
decides: a clean step passes although bf16 rounding exceeds the fixed tolerances here and there,
and a backend that makes one op 5% too large (an inductor post-grad pass scaling every
``aten.rsqrt``: RMSNorm, and LayerNorm as inductor decomposes it) FAILs, with the root cause at the
first block. The same with fp32 weights under the user's own ``torch.autocast``, in two-pass and
in whole-model mode. The clean single-pass step is the unchecked compiled step bit for bit.
bench/low_precision_sweep.py runs every family in bf16 and fp16.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
from hf_models import families
from models import compiled_copy

from dynaprobe import PrecisionChecker

FAMILIES = families()
# A first block name per family, as the report names it.
FIRST_BLOCK = {"Llama": "model.layers.0", "Qwen2": "model.layers.0",
               "Mistral": "model.layers.0", "Mixtral": "model.layers.0",
               "GPT2": "transformer.h.0"}

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_inductor")]


def _rsqrt_too_large(graph):
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.aten.rsqrt.default:
            with graph.inserting_after(node):
                scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.05))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)


def _check(family_name, tmp_path, mode="single_pass", dtype=torch.bfloat16, autocast=False,
           faults=(False, True)):
    """The clean step's result, then the faulted one's. In single-pass the clean checked step is
    also the step the user trains without the checker, bit for bit (loss and every gradient)."""
    family = FAMILIES[family_name]
    results = []
    for fault in faults:
        torch._dynamo.reset()
        inductor_config.post_grad_custom_post_pass = _rsqrt_too_large if fault else None
        torch.manual_seed(0)
        model = family.build()
        if not autocast:
            model = model.to(dtype)
        batch = family.train_batch(model)
        losses = []

        def step(m):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype, enabled=autocast):
                loss = m(**batch).loss
            loss.backward()
            losses.append(loss.detach())
            return loss

        unchecked = None
        if mode == "single_pass" and not fault:
            unchecked = compiled_copy(model, family.blocks, "inductor")
            step(unchecked)
            torch._dynamo.reset()
        checker = PrecisionChecker(backend="inductor", single_pass=mode != "two_pass",
                                   dump_dir=str(tmp_path / f"{mode}-{fault}"))
        checker.wrap_by_policy(model, family.blocks)
        if mode == "whole_model":
            compiled = checker.install(torch.compile(model, backend="inductor"))
            result = checker.collect(step(compiled))
            checker.uninstall()
        else:
            result = checker.compare(step, model)
        if unchecked is not None:
            assert torch.equal(losses[-1], losses[0]), "the checked loss differs"
            for (name, param), twin in zip(model.named_parameters(), unchecked.parameters()):
                assert torch.equal(param.grad, twin.grad), f"{name}: the checked gradient differs"
        results.append(result)
    return results


def _assert_verdicts(family_name, clean, faulty):
    assert clean.all_pass, clean.text()
    referenced = [r for r in clean.rows if r.check_type in ("fwd_output", "grad_input")]
    assert referenced and all(r.reference and r.reference["dtype"] == "fp32" for r in referenced)
    assert not faulty.all_pass, faulty.text()
    assert faulty.root_cause["forward"]["module"] == FIRST_BLOCK[family_name], faulty.text()
    assert "beyond fp32-reference noise" in faulty.root_cause["next"]


@pytest.mark.parametrize("family_name", ["Llama", "Mixtral", "GPT2"])
def test_bf16_clean_passes_and_a_five_percent_fault_fails(family_name, tmp_path):
    _assert_verdicts(family_name, *_check(family_name, tmp_path))


@pytest.mark.parametrize("family_name", ["Qwen2", "Mistral", "Bert", "Bart", "ViT"])
def test_a_clean_bf16_step_passes_and_is_the_unchecked_step_bit_for_bit(family_name, tmp_path):
    """The families the verdicts above leave out: checking a bf16 inductor step changes nothing
    inductor computes (issue 47), and the float32 reference passes it."""
    (clean,) = _check(family_name, tmp_path, faults=(False,))
    assert clean.all_pass, clean.text()


def test_fp32_weights_under_the_users_autocast(tmp_path):
    clean, faulty = _check("Llama", tmp_path, autocast=True)
    assert clean.provenance["autocast"] == "torch.bfloat16"
    _assert_verdicts("Llama", clean, faulty)


def test_two_pass_in_bf16(tmp_path):
    _assert_verdicts("Qwen2", *_check("Qwen2", tmp_path, mode="two_pass"))


def test_whole_model_in_bf16(tmp_path):
    _assert_verdicts("Mistral", *_check("Mistral", tmp_path, mode="whole_model"))


def test_a_reference_without_a_kernel_is_said_not_silently_absent(tmp_path):
    """Mixtral's experts use grouped matrix products, which have no float64 kernel: with
    reference="fp64" each layer says so in a NO_REFERENCE row (the default float32 reference
    runs)."""
    family = FAMILIES["Mixtral"]
    torch.manual_seed(0)
    model = family.build().to(torch.bfloat16)
    batch = family.train_batch(model)
    checker = PrecisionChecker(reference="fp64", dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, family.blocks)
    with pytest.warns(UserWarning, match="reference could not run"):
        result = checker.compare(lambda m: m(**batch).loss, model)
    notes = {r.module: r.reason for r in result.rows if r.note == "NO_REFERENCE"}
    assert set(notes) == {"model.layers.0", "model.layers.1"}
    assert all("Double" in reason for reason in notes.values()), notes
    assert result.counts["no_reference_calls"] == 2 and not result.all_pass
