"""Runs RLHF steps of a real trainer (single process, HF engines, tiny quickstart model) with a
reward model trained by the ``rm.before_rl`` stage, a generative judge and a rule reward, and
records what the step did next to independent recomputations. Used by test_model_rewards.py.

    model_rewards_worker.py RECIPE OUT_JSON OVERRIDES...

Records:
  * "steps": two rl_step calls: metrics, the phases entered with what the reward model holds
    on the device after each, and the judge engine's sleep / wake calls around them;
  * "direct": one more round of real rollouts scored by ModelRewards.score, per sample: the rule
    score, the final reward, the judge prompt the step built and the reply its engine sampled,
    the reward model's score by HF transformers (AutoModelForSequenceClassification on the
    reward model's inputs); the judge engine's greedy replies to the same prompts next to HF
    transformers' greedy generate on the judge's prompt ids (both independent of rlcli's
    forward and engine); the running normaliser's statistics;
  * "gate": the same samples combined again with reward.combine.mode=gate (and the judge's
    replies that round: the same seed, so the same replies);
  * "checkpoint": the model-reward state written into a checkpoint's trainer state.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch

from rlcli.model.residency import StepPhases
from rlcli.process_lifetime import exit_skipping_teardown
from rlcli.rollout.dynamic_sampling import keep_informative_groups
from rlcli.run.state import TRAINER_STATE_FILE
from rlcli.train.build import build_trainer
from rlcli.train.trainer import rl_step
from rlcli.validation.loader import load_config
from tests.rlcli.residency_worker import Recorder


class EngineCalls:
    """Records the judge engine's sleep / wake_up calls, with the phase they happened in."""

    def __init__(self, engine, recorder: Recorder) -> None:
        self.calls: list[list[str]] = []
        for name in ("sleep", "wake_up"):
            original = getattr(engine, name)

            def call(original=original, name=name):
                self.calls.append([recorder.phase, name])
                return original()

            setattr(engine, name, call)


def hf_reward_scores(model_dir: str, ids: list[list[int]]) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    from parallel.preference_pairs import pad_sequences

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    input_ids, attention_mask = pad_sequences(ids, model.config.pad_token_id)
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].tolist()


def hf_judge_replies(model_dir: str, judge, prompts: list[str]) -> list[str]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    replies = []
    for prompt in prompts:
        ids = torch.tensor([judge.encode(prompt)])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=judge.sampling.max_tokens,
                eos_token_id=judge.sampling.stop_token_ids or None,
                pad_token_id=judge.tokenizer.eos_token_id,
            )
        replies.append(judge.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return replies


def main(recipe: str, out_json: str, *overrides: str) -> None:
    cfg = load_config(recipe, list(overrides))
    trainer = build_trainer(cfg, logger=False)
    rewards = trainer.model_rewards
    recorder = Recorder()
    recorder.watch(trainer)
    judge_calls = EngineCalls(rewards.judge.engine, recorder)
    out: dict = {"steps": {}}
    for step in (1, 2):
        trainer.step = step
        metrics = rl_step(trainer)
        phases, _ = recorder.take()
        out["steps"][str(step)] = {
            "metrics": metrics,
            "phases": [{"phase": p["phase"], "reward_model": p["reward_model"]} for p in phases],
        }
    out["judge_calls"] = list(judge_calls.calls)  # the two steps only, not the rounds below

    phases = StepPhases(trainer.residency)
    colocated = trainer.rollouts  # ColocatedRollouts: this rank's sampler (engine, rule rewards)
    samples, _ = colocated.sampler.collect(trainer.loader, 3, phases.timer)
    untouched = copy.deepcopy(samples)
    rule = [s.score for s in samples]
    prompts = rewards.judge.prompts(samples, trainer.tokenizer)
    inputs = rewards.inputs
    rm_ids = [
        inputs(s.prompt_ids, s.response_ids, s.item.prompt_messages, s.finish_reason == "stop")
        for s in samples
    ]
    sampled: list[list[str]] = []  # the judge's replies, one list per scoring round
    replies = rewards.judge.replies

    def recorded(prompts, seed):
        sampled.append(replies(prompts, seed))
        return sampled[-1]

    rewards.judge.replies = recorded
    metrics = rewards.score(samples, phases, 3)
    dyn = cfg.algorithm.dynamic_sampling
    scored, _ = keep_informative_groups(samples, dyn, cfg.data.train_batch_size)  # the step's
    greedy = dataclasses.replace(
        rewards.judge, sampling=dataclasses.replace(rewards.judge.sampling, temperature=0.0)
    )
    out["direct"] = {
        "rule": rule,
        "reward": [s.score for s in scored],
        "kept_groups": sorted({s.group for s in scored}),
        "groups": [s.group for s in untouched],
        "prompts": prompts,
        "judge_replies": sampled[0],
        "engine_greedy_replies": greedy.replies(prompts, 0),
        "questions": [s.item.prompt_messages[0]["content"] for s in untouched],
        "responses": trainer.tokenizer.batch_decode(
            [s.response_ids for s in untouched], skip_special_tokens=True
        ),
        "ground_truths": [s.item.ground_truth for s in untouched],
        "hf_reward_scores": hf_reward_scores(cfg.reward.model.path, rm_ids),
        "hf_judge_replies": hf_judge_replies(cfg.reward.judge.path, rewards.judge, prompts),
        "metrics": metrics,
        "normalizer": rewards.normalizer.state_dict(),
    }

    gate_cfg = copy.deepcopy(cfg)
    gate_cfg.reward.combine = dataclasses.replace(
        cfg.reward.combine, mode="gate", gate_threshold=0.5, gate_fail_reward=-3.0
    )
    gate_cfg.algorithm.dynamic_sampling.enabled = False
    gated = dataclasses.replace(rewards, cfg=gate_cfg, normalizer=None)
    regated = copy.deepcopy(untouched)
    gated.score(regated, StepPhases(trainer.residency), 3)
    out["gate"] = [s.score for s in regated]
    out["gate_judge_replies"] = sampled[1]

    trainer.step = 3
    trainer.save()
    state_file = trainer.checkpoints.manager.latest_dir() / TRAINER_STATE_FILE
    out["checkpoint"] = json.loads(state_file.read_text())["model_rewards"]
    rewards.close()
    colocated.close()
    Path(out_json).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[3:])
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
