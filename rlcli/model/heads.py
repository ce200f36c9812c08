"""What sits on a trained model's last layer, as one object per kind of head: how its Megatron
chunks are loaded and what a no-grad pass of the model gives.

    LanguageModelHead()   the policy (actor, reference, teacher): forward -> response log-probs
                          [B, R]; forward_top -> those and every position's likeliest tokens
    ValueHead()           PPO's critic: forward -> values of the response positions [B, R]
    ScoreHead(...)        a reward model: score -> one score per sequence [B]

``rlcli.model.trained_model.TrainedModel`` composes one of them with the core it shares with every
role (chunks, optimizer, micro-batching, the update loop) and hands it its passes; a new head is
one class here. A head says what it cannot do (a reward model has no per-token outputs), once,
in ``ModelHead``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from parallel.model_options import ModelBuildOptions
from rlcli.rollout.batch import RolloutBatch, response_values

if TYPE_CHECKING:
    from parallel.mesh import Mesh
    from parallel.routing_replay import RoutingNotes


class Batching(Protocol):
    """How the core cuts its no-grad passes (``rlcli.model.trained_model.MicroBatching``)."""

    size: int
    pack: bool

    @property
    def forward_tokens(self) -> int: ...


class Core(Protocol):
    """What a head's passes read of the trained-model core (``rlcli.model.trained_model.TrainedModel``,
    which holds the head: the protocol keeps the import one way)."""

    models: list[torch.nn.Module]
    mesh: Mesh
    micro_batching: Batching


class ModelHead:
    """A kind of head (module docstring). ``load`` builds this rank's chunks with their weights;
    ``forward`` / ``score`` are the passes of the heads that have them."""

    def load(
        self, hf_dir: str, mesh: Mesh, dtype: torch.dtype, options: ModelBuildOptions, pack: bool
    ) -> list[torch.nn.Module]:
        """This rank's chunks of ``hf_dir`` (``pack``: the model runs packed micro-batches)."""
        raise NotImplementedError

    def forward(self, model: Core, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        """Response-aligned ``[B, R]`` outputs of ``model`` (see ``TrainedModel.forward``)."""
        raise TypeError(f"a model with a {type(self).__name__} has no per-token outputs")

    def forward_and_routing(
        self, model: Core, batch: RolloutBatch, temperature: float
    ) -> tuple[torch.Tensor, RoutingNotes]:
        """``forward`` plus the MoE routing it took (see ``TrainedModel.forward_and_routing``)."""
        raise TypeError(f"a model with a {type(self).__name__} has no routing to replay")

    def forward_top(
        self, model: Core, batch: RolloutBatch, temperature: float, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward`` plus each position's likeliest tokens (see ``TrainedModel.forward_top``)."""
        raise TypeError(f"a model with a {type(self).__name__} has no next-token distribution")

    def score(
        self, model: Core, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """One score per sequence ``[B]`` (see ``TrainedModel.score``)."""
        raise TypeError(f"score() needs a reward model (a ScoreHead), not a {type(self).__name__}")


class LanguageModelHead(ModelHead):
    """The LM head: the policy's log-probs of the response tokens, at ``temperature``."""

    def load(self, hf_dir, mesh, dtype, options, pack):
        from parallel.hf_model import load_hf_model

        return load_hf_model(
            hf_dir, mesh, dtype=dtype, options=replace(options, pack_sequences=pack)
        )

    def forward(self, model, batch, temperature):
        from parallel.forward_passes import forward_log_probs

        m = model.micro_batching
        per_position = forward_log_probs(
            model.models, model.mesh, batch.input_ids, batch.attention_mask, m.size,
            temperature, m.forward_tokens, m.pack,
        )  # fmt: skip
        return response_values(per_position.cpu(), batch.response_index)

    def forward_and_routing(self, model, batch, temperature):
        from parallel.forward_passes import forward_log_probs_and_routing

        m = model.micro_batching
        per_position, notes = forward_log_probs_and_routing(
            model.models, model.mesh, batch.input_ids, batch.attention_mask, m.size,
            temperature, m.forward_tokens, m.pack, replay=batch.routing,
        )  # fmt: skip
        return response_values(per_position.cpu(), batch.response_index), notes

    def forward_top(self, model, batch, temperature, top_k):
        from parallel.forward_passes import forward_top_log_probs

        m = model.micro_batching
        per_position, top_log_probs, top_ids = forward_top_log_probs(
            model.models, model.mesh, batch.input_ids, batch.attention_mask, m.size, top_k,
            temperature, m.forward_tokens,
        )  # fmt: skip
        # [B, S-1, k] -> [B, S, k]: a sequence field's width (the last position scores nothing)
        last = (0, 0, 0, 1)
        return (
            response_values(per_position.cpu(), batch.response_index),
            torch.nn.functional.pad(top_log_probs.cpu(), last),
            torch.nn.functional.pad(top_ids.cpu(), last),
        )


class ValueHead(ModelHead):
    """A value head (``parallel.model.ValueHead`` with a bias): the value of the positions that
    predict the response tokens (see ``rlcli.train.critic``), zero where ``loss_mask`` is 0."""

    def load(self, hf_dir, mesh, dtype, options, pack):
        from parallel.hf_model import load_hf_model

        return load_hf_model(
            hf_dir, mesh, dtype=dtype, critic=True, options=replace(options, pack_sequences=pack)
        )

    def forward(self, model, batch, temperature):
        from parallel.forward_passes import forward_values

        m = model.micro_batching
        per_position = forward_values(
            model.models, model.mesh, batch.input_ids, batch.attention_mask, m.size,
            m.forward_tokens, m.pack,
        )  # fmt: skip
        return response_values(per_position.cpu(), batch.response_index) * batch.loss_mask


@dataclass(frozen=True)
class ScoreHead(ModelHead):
    """A reward model's score head: an HF ``*ForSequenceClassification`` folder
    (``parallel.reward_model.load_reward_model``), or with ``from_language_model`` a language
    model with a fresh score head; ``pad_token_id`` overrides the config's, which decides the
    scored position."""

    from_language_model: bool = False
    pad_token_id: int | None = None

    def load(self, hf_dir, mesh, dtype, options, pack):
        from parallel.reward_model import load_reward_model

        return load_reward_model(
            hf_dir,
            mesh,
            dtype=dtype,
            from_language_model=self.from_language_model,
            pad_token_id=self.pad_token_id,
            options=options,
        )

    def score(self, model, input_ids, attention_mask):
        from parallel.reward_model import score_sequences

        m = model.micro_batching
        return score_sequences(
            model.models,
            model.mesh,
            input_ids,
            attention_mask,
            micro_batch_size=m.size,
            max_tokens=m.forward_tokens,
            pack=m.pack,
        )
