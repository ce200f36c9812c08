"""The generative judge in the RL step: each sample's grading prompt (``rlcli.rewards.judge``)
tokenised with the judge's tokenizer, answered by the judge's engine (an ``EngineConfig``
engine built by ``rlcli.rollout.factory.make_engine`` from ``reward.judge.*``, the same
machinery as the policy's), and the replies parsed into scores.

    judge = Judge(engine, tokenizer, template, parser, sampling, use_chat_template)
    prompts = judge.prompts(samples, policy_tokenizer)        # list[str]
    result = judge.score(samples, policy_tokenizer, seed)     # JudgeScores, on every rank

The engine sleeps between steps and is woken only for the judge phase (``awake``). Every rank
holds every sample; each engine replica answers a contiguous share of the prompts and the replies
are exchanged once, so every rank scores every sample alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rlcli.errors import UserError
from rlcli.rewards.judge import JudgeScoreParser, JudgeScores, render_judge_prompt
from rlcli.rollout.base import RolloutEngine, SamplingConfig
from rlcli.rollout.factory import across_replicas, make_engine

if TYPE_CHECKING:
    from rlcli.config.schema import RLConfig
    from rlcli.rollout.batch import Sample


def question_of(sample: Sample) -> str:
    """The prompt's text as the judge reads it: the row's message contents, one per paragraph
    (not the policy's chat template)."""
    item = sample.item
    if item is None:
        return ""
    if item.prompt_messages:
        return "\n\n".join(message["content"] for message in item.prompt_messages)
    return item.prompt_text


@dataclass
class Judge:
    """A judge model behind an engine (see the module docstring). ``use_chat_template``: wrap
    each prompt as a user message in the judge tokenizer's chat template (with the generation
    prompt), else encode the text with the tokenizer's own special tokens."""

    engine: RolloutEngine
    tokenizer: Any
    template: str
    parser: JudgeScoreParser
    sampling: SamplingConfig
    use_chat_template: bool

    def prompts(self, samples: list[Sample], policy_tokenizer: Any) -> list[str]:
        """The grading prompt of each sample: its question, its response (decoded by the
        policy's tokenizer, special tokens dropped) and the row's ground truth."""
        responses = policy_tokenizer.batch_decode(
            [s.response_ids for s in samples], skip_special_tokens=True
        )
        return [
            render_judge_prompt(
                self.template,
                question=question_of(s),
                response=response,
                reference="" if s.item is None else s.item.ground_truth,
            )
            for s, response in zip(samples, responses, strict=True)
        ]

    def encode(self, prompt: str) -> list[int]:
        """The token ids the judge's engine continues for one prompt."""
        if self.use_chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(prompt)["input_ids"])

    def replies(self, prompts: list[str], seed: int) -> list[str]:
        """The judge's reply to each prompt, on every rank (collective: every rank calls it
        with the same prompts)."""
        ids = [self.encode(prompt) for prompt in prompts]
        sampling = replace(self.sampling, seed=seed)

        def generate(mine: list[int]) -> list[str]:
            outputs = self.engine.generate([ids[i] for i in mine], 1, sampling)
            return self.tokenizer.batch_decode(
                [completions[0].token_ids for completions in outputs], skip_special_tokens=True
            )

        # its engines are replicas of reward.judge.tp ranks
        return across_replicas(self.engine, len(ids), generate)

    def score(self, samples: list[Sample], policy_tokenizer: Any, seed: int) -> JudgeScores:
        """Every sample's judge score (the parser's default where a reply has none: counted in
        ``failures``), equal on every rank."""
        return self.parser.score_all(self.replies(self.prompts(samples, policy_tokenizer), seed))


def build_judge(cfg: RLConfig) -> Judge:
    """The judge of ``reward.judge.*``: its engine (replicas of ``reward.judge.tp`` ranks, built
    like the rollout's by ``make_engine``, asleep until its phase), its tokenizer, template and
    parser (settings checked: UserError naming the key)."""
    from transformers import AutoTokenizer

    from rlcli.data.chat import uses_chat_template
    from rlcli.rewards.judge import judge_template

    j = cfg.reward.judge
    template, parser = judge_template(j), JudgeScoreParser.of(j)
    tokenizer = AutoTokenizer.from_pretrained(j.path)
    try:
        use_chat_template = uses_chat_template(tokenizer, j.apply_chat_template)
    except UserError as error:
        raise UserError(f"reward.judge.{error}") from None
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    sampling = SamplingConfig(
        temperature=j.temperature, max_tokens=j.max_tokens, stop_token_ids=eos, logprobs=False
    )
    engine = make_engine(
        j,
        j.path,
        dtype=cfg.model.dtype,
        seed=cfg.trainer.seed,
        max_model_len=j.max_model_len,
        key="reward.judge",
    )
    engine.sleep()  # woken for the judge phase only
    return Judge(engine, tokenizer, template, parser, sampling, use_chat_template)
