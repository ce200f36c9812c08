"""The step's rollout phase (rlcli.rollout.sampling.Sampler) on the real HF engine: how it steps the
engine.

The engine's ``wake_up`` / ``sleep`` / ``generate`` are no-ops or cheap on CPU but countable: on
GPU, sleep level 2 discards the weights, so ALL of a step's sampling rounds (DAPO) and ReMax's
greedy baselines must run inside one awake block; and every rank of a replica must step the
engine even when its share of prompts is empty.
"""

from __future__ import annotations

import pytest

from rlcli.config.schema import RolloutConfig
from rlcli.data import PromptLoader, load_prompt_dataset, read_sft_pairs, write_arith_dataset
from rlcli.model.builder import build_model_dir
from rlcli.rollout.base import ReplicaInfo
from rlcli.rollout.factory import make_engine
from rlcli.rollout.sampling import Sampler
from rlcli.run.metrics import Timer
from rlcli.train.build import build_rewards
from rlcli.validation.loader import load_config
from tests.rlcli.counting_engine import CountingEngine

OVERRIDES = [
    "model.spec.hidden_size=64",
    "model.spec.num_layers=1",
    "model.spec.num_heads=2",
    "model.spec.num_kv_heads=2",
    "model.spec.intermediate_size=64",
    "data.train_batch_size=4",
    "rollout.n=2",
    "rollout.max_tokens=4",
    "reward.num_workers=1",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    paths = write_arith_dataset(str(root / "data"), num_val=8)
    cfg = load_config(None, [f"model.path={root / 'model'}", *OVERRIDES])
    corpus = [p + r for p, r in read_sft_pairs(paths["sft_train"])]
    build_model_dir(cfg.model.spec, root / "model", corpus, seed=0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    data = load_prompt_dataset(paths["train"], tokenizer, max_prompt_length=32)
    engine = CountingEngine(make_engine(RolloutConfig(engine="hf"), str(root / "model")))
    rewards = build_rewards(cfg)
    yield cfg, tokenizer, data, engine, rewards
    rewards.close()


@pytest.mark.parametrize(
    "overrides",
    [
        [  # DAPO: a random model rarely gives a group with varying reward -> all 3 rounds
            "algorithm.dynamic_sampling.enabled=true",
            "algorithm.dynamic_sampling.max_gen_batches=3",
        ],
        ["algorithm.adv_estimator=remax"],
    ],
)
def test_all_sampling_rounds_run_in_one_awake_block(setup, overrides):
    cfg, tokenizer, data, engine, rewards = setup
    cfg = load_config(None, [f"model.path={cfg.model.path}", *OVERRIDES, *overrides])
    loader = PromptLoader(data, cfg.data.train_batch_size, seed=0)
    engine.calls.clear()
    sampler = Sampler(cfg, engine, rewards, tokenizer)
    assert sampler.replica == ReplicaInfo(index=0, count=1, is_leader=True)
    samples, metrics = sampler.collect(iter(loader), 1, Timer())
    assert engine.calls[0] == "wake_up" and engine.calls[-1] == "sleep"
    assert engine.calls.count("wake_up") == engine.calls.count("sleep") == 1
    generates = len(engine.calls) - 2
    if cfg.algorithm.adv_estimator == "remax":
        assert generates == 2  # the sampled answers and the greedy baselines
        # Each sample's baseline is the score of its prompt's greedy answer, recomputed here.
        items = {s.group: s.item for s in samples}
        answers = sampler.generate(list(items.values()), 1, sampler.sampling(1, train=False))
        sampler.score(answers)
        expected = {g: a.score for g, a in zip(items, answers, strict=True)}
        assert [s.reward_baseline for s in samples] == [expected[s.group] for s in samples]
    else:
        assert generates == metrics["dapo/gen_batches"] == 3, metrics
        # Every round's samples reach the step, whose filter (rlcli.rollout.dynamic_sampling) keeps the
        # informative groups.
        assert len({s.group for s in samples}) == 3 * cfg.data.train_batch_size


def test_a_replica_with_no_prompts_still_steps_the_engine(setup):
    cfg, tokenizer, data, engine, rewards = setup
    third = CountingEngine(engine.engine)
    third.replica = ReplicaInfo(2, 3, True)  # replica 2 of 3
    sampler = Sampler(cfg, third, rewards, tokenizer)
    # Replica 2 of 3 gets no prompt out of 2 (split_evenly gives 1, 1, 0).
    samples = sampler.generate(list(data)[:2], 1, sampler.sampling(1, train=False))
    assert samples == [] and third.calls == ["generate(0)"]
