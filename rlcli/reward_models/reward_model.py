"""The reward model from the trainer's side: its folder checked (errors name
``reward.model.path``), the token ids it scores for each policy sample, and the step's scores
(the model itself is a ``TrainedModel(head=ScoreHead())``, built by ``rlcli.reward_models.model_rewards``).

    check_reward_model_path(path)                          UserError unless an HF reward model
    inputs = RewardModelInputs(policy_tokenizer, reward_tokenizer)
    ids = inputs(prompt_ids, response_ids, prompt_messages, finished)   # list[int]
    scores = reward_model_scores(model, inputs, samples)   # [N], every sample, on every rank

Scoring itself is ``parallel.reward_model.score_sequences`` on the right-padded ids
(``TrainedModel.score``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlcli.data.chat import encode_prompt_and_response, uses_chat_template
from rlcli.errors import UserError

if TYPE_CHECKING:
    from rlcli.model.trained_model import TrainedModel
    from rlcli.rollout.batch import Sample

REWARD_MODEL_PATH_KEY = "reward.model.path"


def check_reward_model_path(path: str, key: str = REWARD_MODEL_PATH_KEY) -> None:
    """UserError naming `key` when `path` is not an HF ``*ForSequenceClassification`` folder
    with one label and a score head (``parallel.reward_model.reward_model_problem``)."""
    from parallel.reward_model import reward_model_problem

    if not path:
        raise UserError(f"{key} is empty: set it to an HF *ForSequenceClassification folder")
    problem = reward_model_problem(path)
    if problem is not None:
        raise UserError(f"{key}={path}: {problem}")


def same_tokenizer(first: Any, second: Any) -> bool:
    """Whether two HF tokenizers turn every text into the same ids and render chats alike:
    same vocabulary, special tokens, chat template and (fast tokenizers) pipeline."""
    if first is second:
        return True
    if first.get_vocab() != second.get_vocab() or first.chat_template != second.chat_template:
        return False
    if first.all_special_ids != second.all_special_ids:
        return False
    backends = [getattr(t, "backend_tokenizer", None) for t in (first, second)]
    if all(backend is not None for backend in backends):
        return backends[0].to_str() == backends[1].to_str()
    return type(first) is type(second)


class RewardModelInputs:
    """The token ids a reward model scores for one policy sample.

    With the policy's own tokenizer, the sample's ids as they are (token in, token out: no
    re-tokenisation). With another tokenizer, the response is decoded once (special tokens
    dropped) and the conversation ``prompt_messages + [assistant: response]`` is encoded with
    the reward model's tokenizer and chat template (``rlcli.data.chat``); an unfinished response
    (cut at the length limit) is not closed with an end-of-turn.
    """

    def __init__(
        self, policy_tokenizer: Any, reward_tokenizer: Any, apply_chat_template: bool | None = None
    ) -> None:
        self.policy_tokenizer = policy_tokenizer
        self.reward_tokenizer = reward_tokenizer
        self.shares_tokenizer = same_tokenizer(policy_tokenizer, reward_tokenizer)
        self.use_template = uses_chat_template(reward_tokenizer, apply_chat_template)

    def __call__(
        self,
        prompt_ids: list[int],
        response_ids: list[int],
        prompt_messages: list[dict[str, str]],
        finished: bool,
    ) -> list[int]:
        if self.shares_tokenizer:
            return [*prompt_ids, *response_ids]
        if not prompt_messages:
            raise ValueError("a reward model with its own tokenizer needs the prompt's messages")
        response = self.policy_tokenizer.decode(response_ids, skip_special_tokens=True)
        return encode_prompt_and_response(
            self.reward_tokenizer,
            prompt_messages,
            response,
            use_template=self.use_template,
            finished=finished,
        )


def reward_model_scores(
    model: TrainedModel, inputs: RewardModelInputs, samples: list[Sample]
) -> torch.Tensor:
    """The reward model's score ``[N]`` (float32, CPU) of each of the step's samples (prompt +
    response as ``inputs`` renders them), on every rank. Collective over the trainer's ranks:
    every rank holds all samples; each data-parallel replica of the model scores a contiguous
    share (its model-parallel ranks together, micro-batched as the model is configured) and
    the shares are summed into place over DP (exact: the other ranks add zeros)."""
    from parallel.preference_pairs import pad_sequences
    from rlcli.model.dp_stats import DataParallelStats
    from rlcli.rollout.batch import split_evenly

    mesh = model.mesh
    mine = split_evenly(list(range(len(samples))), mesh.dp)[mesh.dp_rank]
    scores = torch.zeros(len(samples), dtype=torch.float32)
    if mine:  # (all ranks of one model replica share a DP rank, so they skip together)
        ids = [
            inputs(
                samples[i].prompt_ids,
                samples[i].response_ids,
                samples[i].item.prompt_messages if samples[i].item is not None else [],
                samples[i].finish_reason == "stop",
            )
            for i in mine
        ]
        input_ids, attention_mask = pad_sequences(ids, model.hf_config.pad_token_id)
        scores[torch.tensor(mine)] = model.score(input_ids, attention_mask).cpu()
    return DataParallelStats(mesh).sum(scores)
