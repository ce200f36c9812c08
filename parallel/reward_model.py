"""A reward model on Megatron: an HF ``*ForSequenceClassification`` checkpoint with one label
(Qwen2 / Llama families) as megatron-core GPTModel chunks whose output layer is a score head
(``parallel.model.ValueHead`` without a bias, built by ``build_model(critic=True,
head_bias=False)``), scored the way HF transformers scores it.

    reward_model_problem(hf_dir, *, from_language_model=False) -> str | None   (why not an RM)
    load_reward_model(hf_dir, mesh, *, dtype=torch.float32, from_language_model=False,
                      pad_token_id=None, options=ModelBuildOptions()) -> list[torch.nn.Module]
    reward_model_config(hf_config, pad_token_id=None) -> hf_config  as *ForSequenceClassification
    score_positions(input_ids, attention_mask, pad_token_id) -> [B] int64
    score_sequences(models, mesh, input_ids, attention_mask, *, micro_batch_size,
                    max_tokens=0) -> [B] float32
    RewardModelError(ValueError)

Where a sequence is scored (HF's ``GenericForSequenceClassification.forward``): at the rightmost
position whose token is not the config's ``pad_token_id``. With right padding that is the last
real token, unless the sequence itself ends in pad-id tokens (e.g. an EOS that doubles as the
pad token), which HF skips too. A config without ``pad_token_id`` makes HF score the last
position and refuse batches of more than one row; here the last real token (from
``attention_mask``) is scored, which is the same position for an unpadded row.

The chunks carry ``chunk.hf_config``: the reward model's ``*ForSequenceClassification`` config
(also when started from a language model), so ``parallel.convert.save_hf_checkpoint(models, mesh,
out_dir, models[0].hf_config)`` writes a folder ``AutoModelForSequenceClassification`` loads
(transformer weights ``model.*`` and ``score.weight [1, h]``).
"""

from __future__ import annotations

import copy
import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallel.convert import load_hf_weights
from parallel.convert.hf_io import HFCheckpointReader, hf_model_dir_problem
from parallel.convert.mapping import unwrap_chunk
from parallel.cpu_compat import device
from parallel.mesh import Mesh
from parallel.micro_batches import micro_batches
from parallel.model import build_model
from parallel.model_options import ModelBuildOptions
from parallel.schedule import forward_backward
from parallel.step_types import MicroBatch, row_field

SEQUENCE_CLASSIFICATION_SUFFIX = "ForSequenceClassification"
SCORE_WEIGHT = "score.weight"


@dataclass(kw_only=True)
class ScoredRows(MicroBatch):
    """Sequences to score: the position each row is scored at travels with its tokens."""

    score_index: torch.Tensor = row_field()  # [mb] int64 (``score_positions``)


class RewardModelError(ValueError):
    """A folder that cannot be used as a reward model; the message says why and what to do."""


def reward_model_problem(hf_dir: str | Path, *, from_language_model: bool = False) -> str | None:
    """Why `hf_dir` is not a loadable reward model, in words, or None when it is one: not an HF
    folder of a supported family (``parallel.convert.hf_model_dir_problem``), config.json not a
    ``*ForSequenceClassification`` architecture, ``num_labels`` != 1, or no ``score.weight`` in
    its safetensors. ``from_language_model=True`` accepts any supported folder (a reward model
    to be trained from it gets a fresh score head)."""
    problem = hf_model_dir_problem(hf_dir)
    if problem is not None or from_language_model:
        return problem
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    architectures = config.get("architectures") or []
    if not any(name.endswith(SEQUENCE_CLASSIFICATION_SUFFIX) for name in architectures):
        return (
            f"{hf_dir} is not a sequence-classification model (config.json architectures "
            f"{architectures}); a reward model is an HF *{SEQUENCE_CLASSIFICATION_SUFFIX} folder "
            "with num_labels 1, e.g. one written by `rlcli rm`"
        )
    num_labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)
    if num_labels != 1:
        return (
            f"{hf_dir} has {num_labels} labels (config.json id2label / num_labels); a reward "
            "model gives one score per sequence (num_labels 1)"
        )
    with ExitStack() as stack:
        if SCORE_WEIGHT not in HFCheckpointReader(hf_dir, stack):
            return f"{hf_dir} has no {SCORE_WEIGHT} (the score head) in its safetensors"
    return None


def reward_model_config(hf_config: Any, pad_token_id: int | None = None) -> Any:
    """A copy of `hf_config` as a one-label ``*ForSequenceClassification`` config (the family's
    class, e.g. ``Qwen2ForSequenceClassification``), with `pad_token_id` set when given (HF needs
    one to score batches of more than one row)."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(hf_config)
    model_class = AutoModelForSequenceClassification._model_mapping[type(hf_config)]
    config.architectures = [model_class.__name__]
    config.num_labels = 1
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    return config


def load_reward_model(
    hf_dir: str | Path,
    mesh: Mesh,
    *,
    dtype: torch.dtype = torch.float32,
    from_language_model: bool = False,
    pad_token_id: int | None = None,
    options: ModelBuildOptions = ModelBuildOptions(),
) -> list[torch.nn.Module]:
    """This rank's reward-model chunks (plain, not DDP-wrapped), weights loaded from `hf_dir`.

    `hf_dir` is a reward model (``reward_model_problem`` must find nothing; RewardModelError
    otherwise), or, with `from_language_model=True`, any supported HF folder (typically the SFT
    policy) whose transformer weights start a reward model with a freshly initialised score head
    (the same on every TP rank). `pad_token_id` overrides the config's (see the module
    docstring). `options`: how ``parallel.model.build_model`` builds it."""
    from transformers import AutoConfig

    problem = reward_model_problem(hf_dir, from_language_model=from_language_model)
    if problem is not None:
        raise RewardModelError(problem)
    hf_config = reward_model_config(AutoConfig.from_pretrained(hf_dir), pad_token_id)
    models = build_model(
        hf_config, mesh, dtype=dtype, critic=True, head_bias=False, options=options
    )
    load_hf_weights(models, mesh, hf_dir)
    return models


def score_positions(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int | None
) -> torch.Tensor:
    """The position ``[B]`` (int64) each row of ``input_ids [B, S]`` is scored at: the rightmost
    real (``attention_mask``) token that is not `pad_token_id` (module docstring)."""
    real = attention_mask.bool()
    if pad_token_id is not None:
        real = real & (input_ids != pad_token_id)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    # As HF: argmax of position x mask; a row with no such token is scored at position 0.
    return (positions * real).argmax(dim=-1)


def pick_scores(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values [mb, S]`` (the score head at every position) at ``index [mb]`` -> ``[mb]``."""
    return values.gather(1, index.to(values.device).view(-1, 1)).squeeze(1)


@torch.no_grad()
def score_sequences(
    models: list[torch.nn.Module],
    mesh: Mesh,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    micro_batch_size: int,
    max_tokens: int = 0,
    pack: bool = False,
) -> torch.Tensor:
    """Reward-model scores ``[B]`` (float32, on ``device()``, on every model-parallel rank) of
    the right-padded sequences ``input_ids / attention_mask [B, S]``, through megatron's
    pipeline schedule at the chunks' TP / PP layout. ``max_tokens`` > 0 cuts micro-batches by
    that token budget (``parallel.micro_batches``), else by ``micro_batch_size`` rows; ``pack``
    runs each micro-batch as one packed row of whole sequences (no padding computed; the chunks
    built with ``pack_sequences=True``), its values unpacked back to the rows before the score
    positions are read. The pad id that decides the scored position is the chunks'
    ``hf_config.pad_token_id``."""
    batch = input_ids.shape[0]
    pad_token_id = unwrap_chunk(models[0]).hf_config.pad_token_id
    chunks = micro_batches(
        ScoredRows(
            input_ids=input_ids,
            attention_mask=attention_mask,
            row_index=torch.arange(batch),
            score_index=score_positions(input_ids, attention_mask, pad_token_id),
        ),
        micro_batch_size,
        equal_sizes=mesh.pp > 1,
        max_tokens=max_tokens,
        pack=pack,
    )
    results = forward_backward(models, mesh, chunks, None, forward_only=True, pack_sequences=pack)
    scores = torch.zeros(batch, dtype=torch.float32, device=device())
    for chunk, result in zip(chunks, results, strict=True):
        # Filler rows of an equal-size last micro-batch repeat a real row: same input, same score.
        scores[chunk.row_index.to(scores.device)] = pick_scores(
            result.outputs.values, chunk.score_index
        )
    return scores
