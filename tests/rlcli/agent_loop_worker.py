"""One process (a world of one): 3-turn trajectories from the real vLLM engine and the HF engine,
then the Megatron trainer's log-probs (the actor) and values (PPO's critic) on them. Used by
test_agent_loop.py: ``python agent_loop_worker.py MODEL_DIR TOOL_CONFIG OUT_JSON``.

Writes, per engine: the largest |trainer - engine| log-prob over the generated tokens, the
trajectories' turns and tool-call statuses, and whether every non-generated token has log-prob 0;
for the critic: whether its values are 0 exactly off the generated tokens, and the largest
difference between GAE over the masked batch and a textbook GAE over the generated tokens alone.
"""

from __future__ import annotations

import json
import sys

import torch

from rlcli.process_lifetime import exit_skipping_teardown

GAMMA, LAM = 0.9, 0.8


def textbook_gae(rewards: list[float], values: list[float]) -> list[float]:
    """GAE of one response's generated tokens only, as if the tool tokens were not there."""
    advantages, running, next_value = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + GAMMA * next_value - values[t] + GAMMA * LAM * running
        advantages[t], next_value = running, values[t]
    return advantages


def main(model_dir: str, tool_config: str, out: str) -> None:
    from transformers import AutoTokenizer

    import algorithms
    from parallel.mesh import init_parallel
    from rlcli.config.agentic import MultiTurnConfig
    from rlcli.config.schema import RolloutConfig
    from rlcli.data import PromptItem
    from rlcli.model.heads import ValueHead
    from rlcli.model.trained_model import MicroBatching, TrainedModel
    from rlcli.rollout.agent_loop import AgentLoop
    from rlcli.rollout.base import SamplingConfig
    from rlcli.rollout.batch import collate
    from rlcli.rollout.factory import make_engine
    from rlcli.tools.multi_turn import build_multi_turn
    from tests.rlcli.multi_turn_model import QUESTION

    mesh = init_parallel(1, 1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loop = AgentLoop(
        build_multi_turn(MultiTurnConfig(enable=True, tool_config=tool_config), tokenizer),
        tokenizer,
    )
    messages = [{"role": "user", "content": QUESTION}]
    prompt = loop.components.renderer.prompt_ids(messages)
    item = PromptItem(0, prompt, "tool_multiply", "201954", {}, prompt_messages=messages)
    actor = TrainedModel(mesh, model_dir, micro_batching=MicroBatching(8))
    results: dict = {}
    # vLLM last, never closed: its shutdown destroys the process group megatron-core uses.
    for engine_name in ("hf", "vllm"):
        rollout = RolloutConfig(engine=engine_name, load_format="auto", kv_cache_gb=0.05)
        engine = make_engine(rollout, model_dir, max_model_len=512)
        sampling = SamplingConfig(temperature=0.5, max_tokens=48, seed=11)
        samples = loop.run(engine, [(0, item), (1, item)], 2, sampling, replica_index=0)
        batch = collate(samples, tokenizer.pad_token_id)
        trainer = actor.forward(batch, temperature=0.5)
        generated = batch.loss_mask.bool()
        off = batch.response_mask.bool() & ~generated
        results[engine_name] = {
            "max_diff": (trainer - batch.engine_log_probs)[generated].abs().max().item(),
            "turns": [s.trajectory.assistant_turns for s in samples],
            "statuses": [[c.status for c in s.trajectory.tool_calls] for s in samples],
            "masked_log_probs_zero": bool((batch.engine_log_probs[off] == 0).all()),
            "masked_tokens": int(off.sum()),
        }
    del actor
    critic = TrainedModel(mesh, model_dir, micro_batching=MicroBatching(8), head=ValueHead())
    values = critic.forward(batch)
    generated = batch.loss_mask.bool()
    # An outcome reward on each trajectory's last generated token (the trainer's placement).
    rewards = torch.zeros_like(values)
    last = (batch.loss_mask * torch.arange(1, values.shape[1] + 1)).argmax(-1)
    rewards[torch.arange(batch.size), last] = torch.tensor([1.0, -0.5, 0.25, 2.0])
    advantages, _ = algorithms.get_advantage_estimator("gae")(
        token_level_rewards=rewards,
        response_mask=batch.loss_mask,
        values=values,
        gamma=GAMMA,
        lam=LAM,
    )
    expected = torch.tensor(
        [
            a
            for row in range(batch.size)
            for a in textbook_gae(
                rewards[row][generated[row]].tolist(), values[row][generated[row]].tolist()
            )
        ]
    )
    whitened = (expected - expected.mean()) / torch.sqrt(expected.var() + 1e-8)
    results["critic"] = {
        "values_zero_off_generated": bool((values[~generated] == 0).all()),
        "values_nonzero_on_generated": bool((values[generated] != 0).all()),
        "advantages_zero_off_generated": bool((advantages[~generated] == 0).all()),
        "gae_max_diff": (advantages[generated] - whitened).abs().max().item(),
    }
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
