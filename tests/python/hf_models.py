"""Tiny random-init models of real transformers architectures, built from configs in code (nothing
is downloaded), for the real-architecture conformance suite (test_real_models.py).

Each family names its model class, the block classes a user would wrap, a training batch, an
inference batch and whether it generates with a KV cache. Dropout is off so that a correct
compile gives the eager numbers (inductor draws its own dropout masks: a real, expected
difference, covered by the main job)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Tuple

import torch
import transformers

VOCAB, SEQ, BATCH = 96, 8, 2


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], torch.nn.Module]
    blocks: Tuple[type, ...]
    train_batch: Callable[[torch.nn.Module], Dict[str, torch.Tensor]]  # with labels
    infer_batch: Callable[[torch.nn.Module], Dict[str, torch.Tensor]]
    generates: bool = False  # decoder with a KV cache: model.generate()


def _ids(*shape) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape)


def _causal_lm_batch(_) -> dict:
    ids = _ids(BATCH, SEQ)
    return {"input_ids": ids, "labels": ids}


def _causal_lm_infer(_) -> dict:
    return {"input_ids": _ids(BATCH, SEQ)}


def _seq2seq_batch(_) -> dict:
    return {"input_ids": _ids(BATCH, SEQ), "labels": _ids(BATCH, SEQ - 2)}


def _seq2seq_infer(_) -> dict:
    return {"input_ids": _ids(BATCH, SEQ), "decoder_input_ids": _ids(BATCH, SEQ - 2)}


def _bert_batch(_) -> dict:
    ids = _ids(BATCH, SEQ)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -2:] = 0  # padding: the attention mask takes part
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _bert_infer(model) -> dict:
    batch = _bert_batch(model)
    del batch["labels"]
    return batch


def _image_batch(_) -> dict:
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16), "labels": torch.tensor([0, 2])}


def _image_infer(_) -> dict:
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16)}


def _decoder(config_class, model_class, block_class, generates=True, **extra) -> Family:
    def build():
        config = config_class(**{
            "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "attention_dropout": 0.0, **extra})
        return model_class(config)

    return Family(config_class.__name__.removesuffix("Config"), build, (block_class,),
                  _causal_lm_batch, _causal_lm_infer, generates=generates)


def families() -> Dict[str, Family]:
    from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer
    from transformers.models.dory.modeling_dory import DoryDecoderLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    from transformers.models.vit.modeling_vit import ViTLayer

    t = transformers
    found = [
        _decoder(t.LlamaConfig, t.LlamaForCausalLM, LlamaDecoderLayer),
        _decoder(t.Qwen2Config, t.Qwen2ForCausalLM, Qwen2DecoderLayer),
        _decoder(t.MistralConfig, t.MistralForCausalLM, MistralDecoderLayer, sliding_window=None),
        _decoder(t.MixtralConfig, t.MixtralForCausalLM, MixtralDecoderLayer, num_local_experts=4,
                 num_experts_per_tok=2),
        # Each layer runs twice a step with one cache: the second call reads the keys and values
        # the first left there, so gradient flows back into the first call through them. Dory and
        # DeepseekV4 bring their mechanism within one layer: one layer each, their slowest to trace.
        _decoder(t.DoryConfig, t.DoryForCausalLM, DoryDecoderLayer, generates=False,
                 num_hidden_layers=1),
        # Its compressor's projections get no gradient in eager on short sequences, zeros compiled.
        _decoder(t.DeepseekV4Config, t.DeepseekV4ForCausalLM, DeepseekV4DecoderLayer,
                 generates=False, head_dim=16, qk_rope_head_dim=8, q_lora_rank=32,
                 o_lora_rank=32, n_routed_experts=4, moe_intermediate_size=32, index_n_heads=4,
                 index_head_dim=16, index_topk=4, num_hidden_layers=1),
        Family("GPT2", lambda: t.GPT2LMHeadModel(t.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0)), (GPT2Block,), _causal_lm_batch, _causal_lm_infer,
            generates=True),
        Family("Bert", lambda: t.BertForMaskedLM(t.BertConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)), (BertLayer,), _bert_batch, _bert_infer),
        Family("Bart", lambda: t.BartForConditionalGeneration(t.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            decoder_start_token_id=2, forced_eos_token_id=None)),
            (BartEncoderLayer, BartDecoderLayer), _seq2seq_batch, _seq2seq_infer,
            generates=True),
        Family("ViT", lambda: t.ViTForImageClassification(t.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_labels=3, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)), (ViTLayer,), _image_batch, _image_infer),
    ]
    return {family.name: family for family in found}
