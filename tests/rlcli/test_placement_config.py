"""Bad placement / staleness settings fail before any work with a UserError (exit code 2) naming the
key; the generation schedule of the separate placement; its residency plan."""

from __future__ import annotations

import pytest

from rlcli.errors import UserError
from rlcli.model.residency import residency_plan
from rlcli.rollout.streamed import generating_version
from rlcli.validation.loader import load_config
from rlcli.validation.placement import trainer_ranks
from rlcli.validation.validate import validate
from tests.rlcli.test_cli_errors import QUICKSTART, assert_exit_2, rlcli

SEPARATE = ["rollout.placement=separate", "rollout.num_ranks=1"]
ASYNC = [*SEPARATE, "trainer.max_staleness=1"]


@pytest.mark.parametrize(
    ("overrides", "world_size", "needles"),
    [
        (["rollout.placement=separate"], 2, ["rollout.num_ranks", "needs rollout ranks"]),
        ([*SEPARATE[:1], "rollout.num_ranks=2"], 2, ["rollout.num_ranks=2", "every one of the 2"]),
        (
            [*SEPARATE[:1], "rollout.num_ranks=3", "rollout.tp=2"],
            4,
            ["rollout.num_ranks=3", "not divisible by rollout.tp=2"],
        ),
        (
            [*SEPARATE[:1], "rollout.num_ranks=1", "parallel.tp=2"],
            4,
            ["3 trainer ranks", "rollout.num_ranks=1", "parallel.tp x parallel.pp = 2"],
        ),
        (["rollout.num_ranks=1"], 2, ["rollout.num_ranks=1 applies only to", "placement=separate"]),
        (["trainer.max_staleness=1"], 1, ["trainer.max_staleness=1", "rollout.placement=separate"]),
        (ASYNC, 2, ["algorithm.off_policy_correction=none", "decoupled_ppo", "tis"]),
        (
            [*ASYNC, "algorithm.off_policy_correction=tis", "rollout.temperature=0"],
            2,
            ["trainer.max_staleness=1", "rollout.temperature=0", "behaviour distribution"],
        ),
        (
            ["algorithm.off_policy_correction=decoupled_ppo", "actor.old_log_prob_source=engine"],
            1,
            ["decoupled_ppo", "actor.old_log_prob_source=engine", "proximal"],
        ),
        (["algorithm.off_policy_correction=ipo"], 1, ["algorithm.off_policy_correction", "tis"]),
        (["algorithm.tis_cap=0.5"], 1, ["algorithm.tis_cap must be >= 1"]),
        (
            ["algorithm.off_policy_correction=seq_mis", "actor.old_log_prob_source=engine"],
            1,
            ["off_policy_correction=seq_mis", "actor.old_log_prob_source=engine", "proximal"],
        ),
        (
            ["algorithm.is_mask_low=2", "algorithm.is_mask_high=0.5"],
            1,
            ["algorithm.is_mask_low=2.0", "algorithm.is_mask_high=0.5", "<= 1 <="],
        ),
        (["algorithm.is_mask_low=1.1"], 1, ["algorithm.is_mask_low=1.1", "agree"]),
        ([*SEPARATE, "actor.offload_params=true"], 2, ["actor.offload_params=true", "no effect"]),
        (["trainer.max_staleness=-1"], 1, ["trainer.max_staleness must be >= 0"]),
        (
            [*SEPARATE, "actor.lora.enable=true"],
            2,
            [
                "actor.lora.enable=true",
                "rollout.placement=separate",
                "rollout.lora_sync, here merged",
            ],
        ),
        (
            [*SEPARATE, "actor.lora.enable=true", "rollout.lora_sync=adapter"],
            2,
            ["actor.lora.enable=true", "rollout.placement=colocated", "here adapter"],
        ),
        (
            [*SEPARATE, "reward.model.path=/nonexistent/rm"],
            2,
            ["reward.model.path / reward.judge.path", "rollout.placement=separate"],
        ),
    ],
)
def test_bad_placement_and_staleness_settings_name_the_key(overrides, world_size, needles):
    with pytest.raises(UserError) as error:  # loading checks what needs no world size
        validate(load_config(QUICKSTART, overrides), world_size=world_size)
    for needle in needles:
        assert needle in str(error.value), (needle, str(error.value))


@pytest.mark.parametrize(
    "overrides",
    [
        [*ASYNC, "algorithm.off_policy_correction=decoupled_ppo"],
        [*ASYNC, "algorithm.off_policy_correction=tis"],
        [*ASYNC, "algorithm.off_policy_correction=seq_is_geo"],
        ["algorithm.off_policy_correction=token_mis", "algorithm.is_mask_high=5"],  # synchronous
        [*ASYNC, "actor.old_log_prob_source=engine"],  # plain PPO against the behaviour policy
        [*SEPARATE, "rollout.num_ranks=2", "rollout.tp=2"],
    ],
)
def test_correctable_settings_pass(overrides):
    validate(load_config(QUICKSTART, overrides), world_size=4)


def test_the_command_line_exits_2_before_starting_processes(tmp_path):
    out = f"trainer.output_dir={tmp_path / 'run'}"
    assert_exit_2(
        rlcli("train", QUICKSTART, out, "--nproc", "2", *SEPARATE[:1]), "rollout.num_ranks"
    )
    assert_exit_2(
        rlcli("train", QUICKSTART, out, *SEPARATE),
        "rollout.num_ranks=1",
        "--nproc 2",
    )
    assert_exit_2(
        rlcli("train", QUICKSTART, out, "--nproc", "2", *ASYNC),
        "algorithm.off_policy_correction=none",
    )
    assert_exit_2(
        rlcli("train", QUICKSTART, out, "--nproc", "2", *SEPARATE, "actor.lora.enable=true"),
        "actor.lora.enable=true",
        "rollout.placement=separate",
    )
    assert not (tmp_path / "run").exists()


def test_trainer_ranks_leave_the_rollout_ranks_out():
    cfg = load_config(QUICKSTART, [*SEPARATE[:1], "rollout.num_ranks=2"])
    assert trainer_ranks(cfg, 8) == 6
    assert trainer_ranks(load_config(QUICKSTART, []), 8) == 8


def test_generation_is_throttled_to_max_staleness_versions_behind():
    # k = 0: each step's samples come from the trainer's own weights (synchronous)
    assert [generating_version(t, 0, 0) for t in (1, 2, 3)] == [0, 1, 2]
    # k = 2: the engines run two versions behind once the run is past its start
    assert [generating_version(t, 0, 2) for t in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]
    # a resume after step 10 starts again from the checkpoint's weights
    assert [generating_version(t, 10, 1) for t in (11, 12, 13)] == [10, 10, 11]
    for k in range(4):
        for t in range(1, 12):
            assert 0 <= (t - 1) - generating_version(t, 0, k) <= k


def test_trainer_ranks_keep_their_state_while_separate_engines_generate():
    colocated = residency_plan(load_config(QUICKSTART, ["actor.offload_params=true"]))
    assert "params" in colocated["rollout"]["actor"].off
    separate = residency_plan(load_config(QUICKSTART, SEPARATE))
    assert separate["rollout"].get("actor") is None
