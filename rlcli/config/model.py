"""The model section: which HF model (or a small random one built locally), its dtype, layers and
attention, and the mixture-of-experts knobs that are not in its config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class ModelBuildConfig:
    """A small random model built locally when ``model.build`` is true (quickstart, tests)."""

    # the HF model family built; qwen3_5: Qwen3.5's hybrid of Gated DeltaNet and attention;
    # qwen2_5_vl: Qwen2.5-VL, this language model behind a small vision tower, with its
    # processor (rlcli/model/vision_builder.py; the tokenizer always gets ChatML)
    architecture: Literal["qwen2", "llama", "qwen3_5", "qwen2_5_vl"] = "qwen2"
    hidden_size: int = 256  # width of the residual stream
    num_layers: int = 4  # transformer layers
    num_heads: int = 4  # attention heads (head size: hidden_size / num_heads)
    num_kv_heads: int = 2  # key/value heads (grouped-query attention when < num_heads)
    intermediate_size: int = 704  # width of the MLP
    vocab_size: int = 512  # of the byte-level BPE tokenizer trained on the task's text
    tie_word_embeddings: bool = True  # the output layer shares the input embedding's weights
    max_position_embeddings: int = 512  # longest sequence the rotary embedding covers
    # chatml: the tokenizer gets ChatML tokens and a chat template with tool messages (for
    # rollout.multi_turn; rlcli/model/chat_template.py), EOS <|im_end|>; none: no chat template
    chat_template: Literal["none", "chatml"] = "none"


@dataclass
class ModelConfig:
    # HuggingFace model directory (safetensors + config.json + tokenizer), or a Hub id such as
    # Qwen/Qwen2.5-7B-Instruct (downloaded when online, from the local cache when offline)
    path: str = ""
    tokenizer_path: Optional[str] = None  # defaults to model.path
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights and compute
    build: bool = False  # build model.spec locally into model.path when it does not exist yet
    # The layers: auto | transformer_engine | local (megatron-core's own torch layers). auto: TE's
    # where TE imports, else the local ones (also when model.attention_backend is sdpa or local).
    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"
    # The core attention: auto (te with TE's layers, else sdpa) | te (TE's fused attention; needs
    # TE's layers) | sdpa (torch scaled_dot_product_attention in the local layers: flash /
    # memory-efficient kernels on GPUs) | local (megatron's unfused attention: it holds the
    # [b, heads, s, s] score matrix; kept for comparison).
    attention_backend: Literal["auto", "te", "sdpa", "local"] = "auto"
    spec: ModelBuildConfig = field(default_factory=ModelBuildConfig)
    # A vision-language model's vision tower and merger: frozen (the default, as peers train
    # these models), or trained with the language model when false (the policy only; its
    # weights then reach the engine at every sync)
    freeze_vision_tower: bool = True
    # MoE models only (the experts, top-k and routing come from config.json). The router's
    # load-balancing loss: aux_loss (Switch-style, per micro-batch), seq_aux_loss (per
    # sequence) or none; null: aux_loss.
    moe_load_balancing: Optional[Literal["aux_loss", "seq_aux_loss", "none"]] = None
    # MoE: the load-balancing loss's weight; null: config.json's router_aux_loss_coef
    moe_aux_loss_coef: Optional[float] = None
    # MoE: how tokens reach the ranks of their experts; null: alltoall
    moe_token_dispatcher: Optional[Literal["alltoall", "allgather"]] = None
    # MoE: routing replay (gate weights still come from the current router). r2: the update's
    # forwards send every token to the experts the old-log-prob pass chose, so the PPO ratio
    # measures the policy change, not experts flipping; needs that pass (ppo_epochs > 1 or
    # several mini-batches). r3: the trainer's passes send every token to the experts the
    # rollout engine chose (rollout.engine=hf). null: off.
    moe_routing_replay: Optional[Literal["r2", "r3"]] = None
