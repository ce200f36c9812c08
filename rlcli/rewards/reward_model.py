"""The reward model from the trainer's side: its folder checked (errors name
``reward.model.path``), its Megatron chunks loaded in the trainer's layout, and the token ids it
scores for each policy sample.

    check_reward_model_path(path)                          UserError unless an HF reward model
    load_reward_model_chunks(path, mesh, dtype, model_options) -> list[torch.nn.Module]
    inputs = RewardModelInputs(policy_tokenizer, reward_tokenizer)
    ids = inputs(prompt_ids, response_ids, prompt_messages, finished)   # list[int]

Scoring itself is ``parallel.reward_model.score_sequences`` on the right-padded ids.
"""

from __future__ import annotations

from typing import Any

from rlcli.data.chat import encode_prompt_and_response, uses_chat_template
from rlcli.errors import UserError

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


def load_reward_model_chunks(
    path: str,
    mesh: Any,
    dtype: str = "float32",
    model_options: dict[str, Any] | None = None,
    key: str = REWARD_MODEL_PATH_KEY,
) -> list[Any]:
    """This rank's reward-model chunks (frozen, eval mode) at the trainer's TP / PP layout;
    `model_options` are ``parallel.model.build_model``'s (as the actor's). Every mistake a user
    can fix is a UserError naming `key` or the model setting."""
    from parallel.dtypes import DTYPES
    from parallel.mesh import ParallelLayoutError
    from parallel.model import ModelConfigError
    from parallel.reward_model import load_reward_model

    check_reward_model_path(path, key)
    try:
        models = load_reward_model(path, mesh, dtype=DTYPES[dtype], **(model_options or {}))
    except ModelConfigError as error:
        raise UserError(str(error)) from None
    except (ParallelLayoutError, ValueError) as error:  # layout or family the model cannot take
        raise UserError(f"{key}={path}: {error}") from None
    for model in models:
        model.eval()
        model.requires_grad_(False)
    return models


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
