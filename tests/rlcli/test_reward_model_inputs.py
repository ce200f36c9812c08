"""The reward model from the trainer's side: folder checks that name reward.model.path, and the
token ids it scores when its tokenizer is the policy's (as sampled) or another one (decoded
once, rendered with its own chat template)."""

from __future__ import annotations

import pytest

from rlcli.errors import UserError
from rlcli.reward_models.reward_model import (
    RewardModelInputs,
    check_reward_model_path,
    same_tokenizer,
)
from tests.parallel.dist_utils import make_tiny_hf_model
from tests.rlcli.chat_tokenizers import CHAT_TEMPLATE, make_tokenizer

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]


def _sample(tokenizer) -> tuple[list[int], list[int]]:
    prompt_ids = tokenizer("What is 2 + 3?")["input_ids"]
    response_ids = tokenizer("It is 5.", add_special_tokens=False)["input_ids"]
    return prompt_ids, response_ids + [tokenizer.eos_token_id]


def test_the_policys_tokenizer_scores_the_sampled_ids(tmp_path):
    policy = make_tokenizer()
    policy.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    inputs = RewardModelInputs(policy, reloaded)
    assert inputs.shares_tokenizer
    prompt_ids, response_ids = _sample(policy)
    assert inputs(prompt_ids, response_ids, PROMPT, True) == prompt_ids + response_ids


def test_another_tokenizer_renders_its_own_template():
    policy, reward = make_tokenizer(), make_tokenizer(CHAT_TEMPLATE, vocab_size=300)
    assert not same_tokenizer(policy, reward)
    assert not same_tokenizer(make_tokenizer(), make_tokenizer(CHAT_TEMPLATE))  # template only
    inputs = RewardModelInputs(policy, reward)
    prompt_ids, response_ids = _sample(policy)
    finished = inputs(prompt_ids, response_ids, PROMPT, True)
    text = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\nIt is 5.<|im_end|>\n"
    assert finished == reward(text, add_special_tokens=False)["input_ids"]
    # cut at the length limit: no end-of-turn, so the reward model does not see it as finished
    truncated = inputs(prompt_ids, response_ids[:-1], PROMPT, False)
    text = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\nIt is 5."
    assert truncated == reward(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="messages"):
        inputs(prompt_ids, response_ids, [], True)


def test_reward_model_folder_errors_name_the_key(tmp_path):
    causal = make_tiny_hf_model(tmp_path / "causal", "qwen2")
    two = make_tiny_hf_model(
        tmp_path / "two", "qwen2", head="sequence_classification", num_labels=2
    )
    good = make_tiny_hf_model(tmp_path / "rm", "qwen2", head="sequence_classification")
    check_reward_model_path(str(good))
    for path, needle in ((causal, "not a sequence-classification model"), (two, "2 labels")):
        with pytest.raises(UserError, match=f"reward.model.path={path}: .*{needle}"):
            check_reward_model_path(str(path))
    with pytest.raises(UserError, match="reward.model.path is empty"):
        check_reward_model_path("")
