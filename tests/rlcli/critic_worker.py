"""Run under torchrun with 2 CPU processes (gloo, DP2). Used by test_ppo.py.

``loop MODEL_DIR OUT``: a Megatron critic built as the trainer builds it, on each DP rank's own
whole groups of random samples, then

* its values are checked against the critic run on each sequence alone (no padding, no
  micro-batching): the value of response token ``j`` is the output at ``prompt_len - 1 + j``;
* the loop's advantage phase (PPO: GAE, KL in the reward with the adaptive controller) is
  compared with a plain-python recomputation from the scores, log-probs and values;
* ``update_critic`` runs a few critic-only steps on that fixed batch; the value losses are
  written out (the first one is also recomputed by hand).

``values CKPT_STEP_DIR HF_DIR OUT`` (one process): the critic of a training checkpoint, loaded
with megatron at TP1, and the HF model ``rlcli export --critic`` wrote, on the same tokens.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

GAMMA, LAM = 0.9, 0.8


def plain_gae(rewards: list[float], values: list[float]) -> tuple[list[float], list[float]]:
    """Advantages and returns of one response by the textbook recursion (no padding inside)."""
    advantages = [0.0] * len(rewards)
    running, next_value = 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + GAMMA * next_value - values[t]
        running = delta + GAMMA * LAM * running
        advantages[t] = running
        next_value = values[t]
    return advantages, [a + v for a, v in zip(advantages, values, strict=True)]


def check_loop(model_dir: str, out: str) -> None:
    from parallel.mesh import init_parallel
    from parallel.schedule import forward_backward
    from parallel.step_types import MicroBatch
    from rlcli.model.dp_stats import DataParallelStats
    from rlcli.model.heads import ValueHead
    from rlcli.model.trained_model import MicroBatching, TrainedModel, optimizer_settings
    from rlcli.rollout.batch import collate, take_dp_share
    from rlcli.train.advantages import compute_advantages
    from rlcli.train.build import build_kl_controller
    from rlcli.train.critic import update_critic
    from rlcli.validation.loader import load_config
    from tests.rlcli.dp_step_worker import random_samples, with_log_probs

    mesh = init_parallel(1, 1)
    assert mesh.dp == 2
    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "algorithm.adv_estimator=gae",
            f"algorithm.gamma={GAMMA}",
            f"algorithm.lam={LAM}",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.kl_coef=0.2",
            "data.train_batch_size=7",
            "critic.micro_batch_size=3",
            "critic.cliprange_value=100.0",  # the test checks the plain regression loss
        ],
    )
    critic = (
        TrainedModel(  # as rlcli.train.build.build_critic builds it, with the lr this test wants
            mesh,
            model_dir,
            head=ValueHead(),
            optim=optimizer_settings(
                cfg.critic, total_steps=10, use_distributed_optimizer=False, lr=2e-5
            ),
            micro_batching=MicroBatching.of(cfg.critic),
        )
    )
    samples = random_samples(seed=5)
    mine, fewest = take_dp_share(samples, mesh.dp, mesh.dp_rank)
    batch = with_log_probs(collate(mine, pad_id=0), mine)
    batch.values = critic.forward(batch)

    worst = {"values_alone": 0.0, "advantages": 0.0, "returns": 0.0, "rewards": 0.0}
    for row, s in enumerate(mine):  # each sequence alone, whole-sequence output
        tokens = torch.tensor([s.prompt_ids + s.response_ids])
        alone = (
            forward_backward(
                critic.models,
                mesh,
                [MicroBatch(input_ids=tokens, attention_mask=torch.ones_like(tokens))],
                None,
                forward_only=True,
            )[0]
            .outputs.values[0]
            .cpu()
        )
        n, p = len(s.response_ids), len(s.prompt_ids)
        diff = (batch.values[row, :n] - alone[p - 1 : p - 1 + n]).abs().max().item()
        worst["values_alone"] = max(worst["values_alone"], diff)

    kl_ctrl = build_kl_controller(cfg)
    beta = kl_ctrl.value
    compute_advantages(batch, cfg, kl_ctrl, DataParallelStats(mesh))

    # Independently: reward = score on the last token - beta * (old - ref) ("kl" penalty), GAE
    # per response, whitening over every response token of BOTH ranks (unbiased variance).
    raw_advantages, expected = [], []
    for row, s in enumerate(mine):
        n = len(s.response_ids)
        old = batch.old_log_probs[row, :n].tolist()
        ref = batch.ref_log_probs[row, :n].tolist()
        rewards = [-beta * (o - r) for o, r in zip(old, ref, strict=True)]
        rewards[-1] += s.score
        values = batch.values[row, :n].tolist()
        advantages, returns = plain_gae(rewards, values)
        raw_advantages += advantages
        expected.append((row, n, rewards, advantages, returns))
    everything: list[list[float]] = [None, None]  # type: ignore[list-item]
    dist.all_gather_object(everything, raw_advantages)
    pooled = [a for part in everything for a in part]
    mean = sum(pooled) / len(pooled)
    var = sum((a - mean) ** 2 for a in pooled) / (len(pooled) - 1)
    for row, n, rewards, advantages, returns in expected:
        whitened = [(a - mean) / (var + 1e-8) ** 0.5 for a in advantages]
        for key, want in (("rewards", rewards), ("advantages", whitened), ("returns", returns)):
            got = getattr(batch, "token_level_rewards" if key == "rewards" else key)[row, :n]
            diff = (got.double() - torch.tensor(want, dtype=torch.float64)).abs().max().item()
            worst[key] = max(worst[key], diff)

    # The first step's loss before any update: 0.5 * token-mean of (values - returns)^2 over the
    # whole batch (the rank's metric is its share times dp; the ranks' mean is the whole).
    mask = batch.loss_mask.bool()
    sums = torch.tensor(
        [((batch.values - batch.returns)[mask] ** 2).sum().item(), mask.sum().item()],
        dtype=torch.float64,
    )
    dist.all_reduce(sums)
    losses, grad_norms = [], []
    for _ in range(6):
        metrics = update_critic(critic, batch, cfg, fewest)
        loss = torch.tensor([metrics["critic/vf_loss"]], dtype=torch.float64)
        dist.all_reduce(loss)
        losses.append(loss.item() / mesh.dp)
        grad_norms.append(metrics["critic/grad_norm"])
    if mesh.rank == 0:
        result = {
            "worst": worst,
            "losses": losses,
            "expected_first_loss": 0.5 * (sums[0] / sums[1]).item(),
            "grad_norms": grad_norms,
        }
        with open(out, "w") as handle:
            json.dump(result, handle)


def compare_export(step_dir: str, hf_dir: str, out: str) -> None:
    from transformers import AutoConfig, AutoModelForTokenClassification

    from parallel.checkpoint import load_checkpoint
    from parallel.mesh import init_parallel
    from parallel.model import build_model
    from parallel.schedule import forward_backward
    from parallel.step_types import MicroBatch

    mesh = init_parallel(1, 1)
    config = AutoConfig.from_pretrained(f"{step_dir}/critic/hf")
    models = build_model(config, mesh, critic=True)
    load_checkpoint(f"{step_dir}/critic/model", models, mesh)
    tokens = torch.randint(
        3, config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0)
    )
    megatron = forward_backward(
        models,
        mesh,
        [MicroBatch(input_ids=tokens, attention_mask=torch.ones_like(tokens))],
        None,
        forward_only=True,
    )[0].outputs.values.cpu()
    hf = AutoModelForTokenClassification.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        values = hf(tokens).logits[..., 0]
    with open(out, "w") as handle:
        json.dump(
            {
                "class": type(hf).__name__,
                "max_abs_diff": (values - megatron).abs().max().item(),
                "value_scale": values.abs().max().item(),
            },
            handle,
        )


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {"loop": check_loop, "values": compare_export}[mode](*args)
