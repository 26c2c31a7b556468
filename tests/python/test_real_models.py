"""Real-architecture conformance: tiny random-init models of ten transformers families
(decoder-only with RoPE and GQA, GPT-2, mixtures of experts, a looped decoder sharing one cache, an
encoder, an encoder-decoder, a vision transformer; hf_models.py), their blocks wrapped as a user
would.

For each family: a single-pass training step (aot_eager and inductor) passes with forward and
backward rows for every block and leaves parameters, gradients, buffers and RNG exactly as the same
compiled step without the checker; two-pass inference passes; a decoder generates the same tokens
and leaves its KV cache as long as without the checker. docs/real-models.md lists what is verified.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import families

from dynaprobe import PrecisionChecker

FAMILIES = families()
GENERATING = [name for name, family in FAMILIES.items() if family.generates]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: shapes seen by an earlier test would make Dynamo compile
    the shared block code with dynamic shapes on one side of a comparison and not the other."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _blocks(model, family):
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, family.blocks)]


def _compile_blocks(model, family, backend):
    """The user's own compiled training setup, without the checker: each block's forward
    compiled in place, as install() does."""
    for _, block in _blocks(model, family):
        block.forward = torch.compile(block.forward, backend=backend)


def _train_step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss


def _state(model):
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone()
                  for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
    }


def _assert_same_state(checked, reference):
    for part in ("params", "grads", "buffers"):
        assert checked[part].keys() == reference[part].keys(), part
        for name, value in checked[part].items():
            other = reference[part][name]
            assert (value is None) == (other is None), f"{part} {name}"
            if value is not None:
                assert torch.equal(value, other), f"{part} {name} differs from the unchecked run"
    assert torch.equal(checked["rng"], reference["rng"]), "the RNG state differs"


def _assert_every_block_checked(result, block_names, backward: bool):
    rows = {}
    for row in result.rows:
        rows.setdefault(row.module, set()).add((row.check_type, row.status))
    for name in block_names:
        kinds = rows.get(name, set())
        assert ("fwd_output", "PASS") in kinds, f"{name}: no passing forward row: {kinds}"
        if backward:
            assert ("grad_input", "PASS") in kinds, f"{name}: no passing grad_input row: {kinds}"
            assert ("grad_output", "PASS") in kinds, f"{name}: no passing grad_output: {kinds}"
            assert ("param_grad", "PASS") in kinds, f"{name}: no passing param_grad row: {kinds}"
        assert all(status == "PASS" for _, status in kinds), f"{name}: {kinds}"


# Dory and DeepseekV4 bring capture mechanisms of training (a layer run twice with one cache; a
# gradient only the compiled side materializes), which an aot_eager training step exercises;
# inductor and two-pass inference add compile time and nothing more (the zoo sweep runs them).
MECHANISMS = {"Dory", "DeepseekV4"}


@pytest.mark.parametrize("family_name, backend", [
    *[(name, "aot_eager") for name in FAMILIES],
    *[pytest.param(name, "inductor", marks=pytest.mark.slow) for name in FAMILIES
      if name not in MECHANISMS]])
def test_single_pass_training_step_passes_and_changes_nothing(family_name, backend, tmp_path):
    family = FAMILIES[family_name]
    torch.manual_seed(0)
    model = family.build().train()
    reference = copy.deepcopy(model)
    batch = family.train_batch(model)

    _compile_blocks(reference, family, backend)
    torch.manual_seed(1)
    reference_loss = _train_step(reference, batch)
    reference_state = _state(reference)

    checker = PrecisionChecker(backend=backend, dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, family.blocks)
    checker.install(model)
    torch.manual_seed(1)
    loss = _train_step(model, batch)
    result = checker.collect(loss)
    checker.uninstall()

    assert result.all_pass, result.text()
    _assert_every_block_checked(result, [n for n, _ in _blocks(model, family)], backward=True)
    assert not any(row.note == "HOOK_ERROR" for row in result.rows)
    assert torch.equal(loss.detach(), reference_loss.detach())
    _assert_same_state(_state(model), reference_state)


@pytest.mark.parametrize("family_name", [name for name in FAMILIES if name not in MECHANISMS])
def test_two_pass_inference_passes(family_name, tmp_path):
    family = FAMILIES[family_name]
    torch.manual_seed(0)
    model = family.build()
    batch = family.infer_batch(model)
    before = _state(model)

    def infer_step(model):
        model.eval()
        with torch.no_grad():
            out = model(**batch)
            return out.logits.float().mean()

    checker = PrecisionChecker(single_pass=False, dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, family.blocks)
    result = checker.compare(infer_step, model)

    assert result.all_pass, result.text()
    assert result.loss_eager == result.loss_compiled
    _assert_every_block_checked(result, [n for n, _ in _blocks(model, family)], backward=False)
    after = _state(model)
    before["rng"] = after["rng"]  # two-pass draws from the RNG like the step would
    _assert_same_state(after, before)


@pytest.mark.parametrize("family_name", GENERATING)
def test_generation_through_a_checked_model_is_unchanged(family_name, tmp_path):
    family = FAMILIES[family_name]
    torch.manual_seed(0)
    model = family.build().eval()
    batch = family.infer_batch(model)
    prompt = {k: v for k, v in batch.items() if k != "decoder_input_ids"}
    settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False,
                    pad_token_id=model.config.eos_token_id)

    with torch.no_grad():
        expected = model.generate(**prompt, **settings)

    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, family.blocks)
    checker.install(model)
    with torch.no_grad():
        generated = model.generate(**prompt, **settings)
    result = checker.collect()
    checker.uninstall()

    assert torch.equal(generated, expected)
    assert result.all_pass, result.text()
    decoder_blocks = [n for n, m in _blocks(model, family) if isinstance(m, family.blocks[-1])]
    calls = [int(result.modules[name]["calls"]) for name in decoder_blocks]
    assert calls and all(count == settings["max_new_tokens"] for count in calls), calls


@pytest.mark.parametrize("family_name", [n for n in GENERATING if n != "Bart"])
def test_a_cache_passed_in_grows_as_without_the_checker(family_name, tmp_path):
    """The issue's case: the eager re-run was handed the caller's DynamicCache and appended to
    it a second time (twice the length; generation continuing from it went wrong)."""
    from transformers import DynamicCache

    family = FAMILIES[family_name]
    torch.manual_seed(0)
    model = family.build().eval()
    ids = family.infer_batch(model)["input_ids"]

    with torch.no_grad():
        reference_cache = DynamicCache(config=model.config)
        reference_logits = model(input_ids=ids, past_key_values=reference_cache,
                                 use_cache=True).logits

    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, family.blocks)
    checker.install(model)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        # ... and one more token from that cache, as generation does.
        next_ids = logits[:, -1:].argmax(-1)
        step_logits = model(input_ids=next_ids, past_key_values=cache, use_cache=True).logits
    result = checker.collect()
    checker.uninstall()
    with torch.no_grad():
        reference_step = model(input_ids=next_ids, past_key_values=reference_cache,
                               use_cache=True).logits

    assert result.all_pass, result.text()
    assert cache.get_seq_length() == reference_cache.get_seq_length() == ids.shape[1] + 1
    assert torch.equal(logits, reference_logits)
    assert torch.equal(step_logits, reference_step)
    for layer, reference_layer in zip(cache.layers, reference_cache.layers):
        assert torch.equal(layer.keys, reference_layer.keys)
        assert torch.equal(layer.values, reference_layer.values)


@pytest.mark.parametrize("family_name", ["Llama", "GPT2"])
def test_training_with_the_default_cache_compares_the_backward(family_name, tmp_path):
    """use_cache left at its default in training: every block's backward is compared (the
    re-run's cache appends used to reach into the training graph: HOOK_ERROR, then
    MISSING_bwd_in_eager for grad_input and every param_grad)."""
    family = FAMILIES[family_name]
    torch.manual_seed(0)
    model = family.build().train()
    batch = family.train_batch(model)
    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, family.blocks)
    checker.install(model)
    loss = model(**batch, use_cache=True).loss
    loss.backward()
    result = checker.collect(loss)
    assert result.all_pass, result.text()
    _assert_every_block_checked(result, [n for n, _ in _blocks(model, family)], backward=True)
