"""How a model is built on Megatron, beyond its HF config and the mesh: one frozen value that
``parallel.model.build_model`` (and ``load_hf_model`` / ``load_reward_model`` above it) reads.

    options = ModelBuildOptions(
        sequence_parallel=False, transformer_impl="auto", attention_backend="auto",
        recompute=Recompute("selective"), moe=MoeOptions(load_balancing="none"),
        pack_sequences=False,
    )
    build_model(hf_config, mesh, options=options)

The caller fills it (rlcli from its config, ``rlcli.train.build.model_options``); a new build option is
one field here and the line of ``build_model`` that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RECOMPUTE_MODES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation (megatron-core's recompute_granularity, recompute_method,
    recompute_num_layers): ``none``, ``selective`` (core attention) or ``full`` (whole layers,
    ``method`` ``uniform`` / ``block`` over ``num_layers`` layers)."""

    mode: str = "none"
    method: str = "uniform"
    num_layers: int = 1

    def config_fields(self) -> dict[str, Any]:
        """The TransformerConfig fields; ValueError for a mode or method outside the choices."""
        if self.mode not in RECOMPUTE_MODES:
            raise ValueError(
                f"recompute mode {self.mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}"
            )
        if self.mode == "none":
            return {}
        if self.mode == "selective":
            return {"recompute_granularity": "selective"}
        if self.method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute method {self.method!r}: choose one of {RECOMPUTE_METHODS}")
        return {
            "recompute_granularity": "full",
            "recompute_method": self.method,
            "recompute_num_layers": self.num_layers,
        }


@dataclass(frozen=True)
class MoeOptions:
    """MoE training knobs (``parallel.moe.moe_config_fields``); None: the model's / megatron's
    default. Any of them set on a dense model is a ModelConfigError."""

    aux_loss_coef: float | None = None
    load_balancing: str | None = None
    token_dispatcher: str | None = None
    # the routers can record and replay their experts (parallel.routing_replay)
    routing_replay: bool = False

    @property
    def any_set(self) -> bool:
        knobs = (self.aux_loss_coef, self.load_balancing, self.token_dispatcher)
        return self.routing_replay or any(v is not None for v in knobs)


@dataclass(frozen=True)
class ModelBuildOptions:
    """``build_model``'s layout options. ``sequence_parallel`` (TP > 1) needs Transformer
    Engine; ``transformer_impl`` / ``attention_backend``: ``auto`` or a backend
    (``parallel.model_backends``); ``pack_sequences``: the model must serve packed micro-batches
    (``parallel.schedule.forward_backward(pack_sequences=True)``)."""

    sequence_parallel: bool = False
    transformer_impl: str = "auto"
    attention_backend: str = "auto"
    recompute: Recompute = field(default_factory=Recompute)
    moe: MoeOptions = field(default_factory=MoeOptions)
    pack_sequences: bool = False
    # a vision-language model's tower takes gradients (frozen otherwise)
    train_vision_tower: bool = False
