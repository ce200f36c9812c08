"""Run under torchrun with 2 CPU processes (gloo, DP2). Used by test_dp_step.py.

``advantages``: every estimator (and the adaptive KL-in-reward controller) computed by each DP
rank on its own whole groups, with the batch-wide statistics all-reduced, must equal the same
computation on the whole batch in one process.

``step RECIPE OUT_DIR OVERRIDES...``: one real training step built by ``build_trainer`` at DP2
while every tensor handed to a torch.distributed collective is checked to be on the model's
device (NCCL reduces only GPU tensors; on CPU the model's device is the CPU).
"""

from __future__ import annotations

import json
import random
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from rlcli.process_lifetime import exit_skipping_teardown

ESTIMATORS = (
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
)


def random_samples(seed: int):
    from rlcli.rollout.batch import Sample

    rng = random.Random(seed)
    samples = []
    for group in range(7):  # odd: the DP shares differ in size
        for _ in range(4):
            response = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 9))]
            samples.append(
                Sample(
                    group=group,
                    prompt_ids=[1] * rng.randrange(2, 6),
                    response_ids=response,
                    engine_log_probs=[-rng.random() for _ in response],
                    finish_reason="stop",
                    item=None,
                    score=float(rng.choice([0.0, 0.0, 1.0, 0.5])),
                    reward_baseline=rng.random(),
                )
            )
    return samples


def with_log_probs(batch, samples):
    """Old / reference log-probs that depend only on the sample (its tokens), not its row."""
    mask = batch.response_mask
    old = torch.zeros_like(mask)
    ref = torch.zeros_like(mask)
    for row, s in enumerate(samples):
        gen = torch.Generator().manual_seed(hash((s.group, tuple(s.response_ids))) % 2**31)
        n = len(s.response_ids)
        old[row, :n] = -torch.rand(n, generator=gen)
        ref[row, :n] = -torch.rand(n, generator=gen)
    batch.old_log_probs, batch.ref_log_probs = old, ref
    return batch


def check_advantages() -> dict:
    from parallel.mesh import init_parallel
    from rlcli.model.dp_stats import DataParallelStats
    from rlcli.rollout.batch import collate, take_dp_share
    from rlcli.train.advantages import compute_advantages
    from rlcli.train.build import build_kl_controller
    from rlcli.validation.loader import load_config

    mesh = init_parallel(1, 1)
    assert mesh.dp == 2
    samples = random_samples(seed=3)
    mine, _ = take_dp_share(samples, mesh.dp, mesh.dp_rank)
    worst = {}
    for estimator in ESTIMATORS:
        for kl_in_reward in (False, True):
            cfg = load_config(
                None,
                [
                    "model.path=/m",
                    f"algorithm.adv_estimator={estimator}",
                    f"algorithm.use_kl_in_reward={str(kl_in_reward).lower()}",
                    "algorithm.kl_ctrl.type=adaptive",
                    "algorithm.overlong.enabled=true",
                    "algorithm.overlong.buffer_len=4",
                    "rollout.max_tokens=8",
                ],
            )
            local = with_log_probs(collate(mine, 0), mine)
            local_kl = build_kl_controller(cfg)
            local_metrics = compute_advantages(local, cfg, local_kl, DataParallelStats(mesh))
            whole = with_log_probs(collate(samples, 0), samples)
            whole_kl = build_kl_controller(cfg)
            one_rank = DataParallelStats(SimpleNamespace(dp=1))
            whole_metrics = compute_advantages(whole, cfg, whole_kl, one_rank)
            row_of = {id(s): row for row, s in enumerate(samples)}
            diff = 0.0
            for row, s in enumerate(mine):
                width = local.response_mask.shape[1]
                for key in ("advantages", "returns", "token_level_rewards"):
                    expected = getattr(whole, key)[row_of[id(s)], :width]
                    diff = max(diff, (getattr(local, key)[row] - expected).abs().max().item())
            for key, value in whole_metrics.items():
                diff = max(diff, abs(local_metrics[key] - value) / max(1.0, abs(value)))
            diff = max(diff, abs(local_kl.value - whole_kl.value))
            assert set(local_metrics) == set(whole_metrics)
            worst[f"{estimator}/kl_in_reward={kl_in_reward}"] = diff
    return worst


class CollectiveAudit:
    """Wraps torch.distributed's tensor collectives; records any tensor off the model's device."""

    NAMES = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "broadcast",
        "reduce",
        "send",
        "recv",
        "isend",
        "irecv",
    )

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.offenders: list[str] = []

    def install(self) -> None:
        for name in self.NAMES:
            setattr(dist, name, self._checked(name, getattr(dist, name)))

    def _checked(self, name, original):
        from parallel.cpu_compat import device

        def wrapper(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
            tensors += [
                t for a in args if isinstance(a, (list, tuple)) for t in a if torch.is_tensor(t)
            ]
            for tensor in tensors:
                if tensor.device != device():
                    self.offenders.append(f"{name}: {tensor.dtype} on {tensor.device}")
            self.calls[name] = self.calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return wrapper


def check_step(recipe: str, *overrides: str) -> dict:
    from rlcli.train.build import build_trainer
    from rlcli.train.trainer import rl_step
    from rlcli.validation.loader import load_config

    audit = CollectiveAudit()
    audit.install()
    trainer = build_trainer(load_config(recipe, list(overrides)), logger=False)
    assert trainer.mesh.dp == 2
    trainer.step = 1
    metrics = rl_step(trainer)
    trainer.rollouts.sampler.rewards.close()
    return {"metrics": metrics, "calls": audit.calls, "offenders": audit.offenders}


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    result = check_advantages() if mode == "advantages" else check_step(*sys.argv[3:])
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
