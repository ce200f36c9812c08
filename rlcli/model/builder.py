"""Build a small random HuggingFace model and its tokenizer locally (``model.build: true``).

Nothing can be downloaded on the machines rlcli is developed and tested on, so the quickstart
makes its own model: a byte-level BPE tokenizer trained on the task's text (numbers split into
single digits, so arithmetic is learnable) and a randomly initialised Qwen2 or Llama saved as
safetensors. The result is an ordinary HF model directory: every later stage (conversion,
Megatron, vLLM) reads it exactly as it would read a downloaded checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rlcli.config.model import ModelBuildConfig

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def train_tokenizer(corpus: list[str], vocab_size: int, chat_template: str = "none"):
    """A byte-level BPE ``PreTrainedTokenizerFast`` whose digits are always single tokens;
    ``chat_template="chatml"`` adds ChatML's tokens and template (``rlcli.model.chat_template``), with
    ``<|im_end|>`` as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if chat_template == "none":
        tok.train_from_iterator(corpus, trainer=trainer)
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
        )
    from rlcli.model import chat_template as chatml

    tok.train_from_iterator([*corpus, chatml.TEMPLATE_WORDS], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN)
    tokenizer.add_special_tokens(
        {"eos_token": chatml.IM_END, "additional_special_tokens": [chatml.IM_START, chatml.IM_END]}
    )
    tokenizer.add_tokens(chatml.TOOL_TAGS)
    tokenizer.chat_template = chatml.CHATML
    return tokenizer


def hybrid_layers(spec: ModelBuildConfig) -> dict:
    """Qwen3.5's layout at the spec's size: three Gated DeltaNet layers, then one gated
    full-attention layer (Qwen3.5's own 3:1), the DeltaNet's key heads as many as the KV heads
    and its value heads as the query heads, every head of the attention's head size."""
    if spec.architecture != "qwen3_5":
        return {}
    head_dim = spec.hidden_size // spec.num_heads
    return {
        "head_dim": head_dim,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
            for i in range(spec.num_layers)
        ],
        "linear_num_key_heads": spec.num_kv_heads,
        "linear_num_value_heads": spec.num_heads,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,  # Qwen3.5's
    }


def build_random_model(
    spec: ModelBuildConfig, vocab_size: int, eos_id: int, pad_id: int, seed: int
):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
    )

    # One entry per choice of model.spec.architecture (its Literal type in rlcli.config.schema).
    families = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
    }
    config_cls, model_cls = families[spec.architecture]
    config = config_cls(
        **hybrid_layers(spec),
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return model_cls(config)


def build_model_dir(
    spec: ModelBuildConfig, out_dir: str | os.PathLike, corpus: list[str], seed: int
) -> Path:
    """Write tokenizer + random model into ``out_dir`` (atomically: a half-built dir never stays)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".building")
    tokenizer = train_tokenizer(corpus, spec.vocab_size, spec.chat_template)
    model = build_random_model(
        spec, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed
    )
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    tmp.rename(out)
    return out
