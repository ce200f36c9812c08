"""Rollout engines on one process: the interface's checks, HF generate against an HF forward
pass, and vLLM against HF (greedy tokens, sampled-token log-probs, in-place weight reload)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlcli.config.schema import RolloutConfig
from rlcli.errors import UserError
from rlcli.rollout import GenerationRequest, ReplicaInfo, SamplingConfig, make_engine
from tests.parallel.dist_utils import make_tiny_hf_model

# vLLM's CPU attention needs head_dim >= 32: hidden 128 over 4 heads.
VLLM_SHAPE = dict(hidden_size=128, max_position_embeddings=256)
PROMPTS = [[5, 17, 42, 7], [100, 3], [9, 9, 9, 9, 9, 200]]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no vLLM")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", **VLLM_SHAPE)


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    return make_tiny_hf_model(
        tmp_path_factory.mktemp("qwen2_tied"), "qwen2", tie_word_embeddings=True, **VLLM_SHAPE
    )


def engine_for(kind, model_dir, max_model_len=None, **rollout):
    """An engine built as the trainer builds it: from a `rollout` section (weights read from
    the folder; the trainer's default is dummy weights plus a sync)."""
    section = RolloutConfig(engine=kind, load_format="auto", **rollout)
    return make_engine(section, str(model_dir), max_model_len=max_model_len)


def hf_reference_logprobs(model, prompt, completion, temperature):
    """log_softmax(logits / T) of each completion token, from one HF forward pass: [len]."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    scale = temperature if temperature > 0 else 1.0
    return (logits / scale).log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]


def perturbed_weights(model_dir, seed=1):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


# ---- configuration errors -------------------------------------------------------------


def test_unknown_engine_kind_lists_the_choices(model_dir):
    from rlcli.validation.loader import load_config

    # Checked once, as the config loads (the factory takes a validated section).
    for key in ("rollout.engine", "reward.judge.engine"):
        with pytest.raises(UserError, match=key) as error:
            load_config(None, [f"model.path={model_dir}", f"{key}=sglang"])
        assert "vllm" in str(error.value) and "hf" in str(error.value)


def test_hf_engine_tp_is_checked_when_the_config_loads(model_dir):
    from rlcli.validation.loader import load_config

    with pytest.raises(UserError, match=r"rollout.engine=hf runs one full model per rank"):
        load_config(None, [f"model.path={model_dir}", "rollout.engine=hf", "rollout.tp=2"])
    judge = [f"reward.judge.path={model_dir}", "reward.judge.engine=hf", "reward.judge.tp=2"]
    with pytest.raises(UserError, match=r"set reward.judge.tp=1"):
        load_config(None, [f"model.path={model_dir}", *judge])


@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_bad_model_path_names_model_path(tmp_path, kind):
    with pytest.raises(UserError, match="model.path"):
        engine_for(kind, tmp_path / "no_such_model")


def test_vllm_missing_suggests_hf(model_dir, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a),
    )
    with pytest.raises(UserError, match="rollout.engine=hf"):
        engine_for("vllm", model_dir)


def test_rollout_replicas():
    assert ReplicaInfo.of(4, 3, 2) == ReplicaInfo(index=1, count=2, is_leader=False, size=2)
    assert ReplicaInfo.of(4, 2, 2) == ReplicaInfo(index=1, count=2, is_leader=True, size=2)
    assert ReplicaInfo.of(4, 1, 1) == ReplicaInfo(index=1, count=4, is_leader=True, size=1)
    assert ReplicaInfo.of(2, 1, 2).index == 0 and ReplicaInfo.of(4, 3, 2).first_rank == 2
    with pytest.raises(UserError, match="rollout.tp"):
        ReplicaInfo.of(6, 0, 4)


# ---- HF engine ------------------------------------------------------------------------


def test_hf_engine_log_probs_match_forward_and_stop_tokens(model_dir):
    from transformers import AutoModelForCausalLM

    engine = engine_for("hf", model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sampling = SamplingConfig(temperature=0.7, max_tokens=12, seed=3)
    assert engine.generate([], 3, sampling) == []
    results = engine.generate(PROMPTS, n=3, sampling=sampling)
    assert [len(r) for r in results] == [3, 3, 3]
    for prompt, samples in zip(PROMPTS, results, strict=True):
        assert len({tuple(s.token_ids) for s in samples}) > 1  # n samples differ
        for sample in samples:
            assert len(sample.token_ids) == 12 and sample.finish_reason == "length"
            expected = hf_reference_logprobs(reference, prompt, sample.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)

    # A stop token ends the sample and is its last token.
    first_greedy = engine.generate(PROMPTS[:1], 1, SamplingConfig(temperature=0, max_tokens=8))
    stop = first_greedy[0][0].token_ids[2]
    stopped = engine.generate(
        PROMPTS[:1], 1, SamplingConfig(temperature=0, max_tokens=8, stop_token_ids=[stop])
    )[0][0]
    cut = first_greedy[0][0].token_ids.index(stop) + 1
    assert stopped.token_ids == first_greedy[0][0].token_ids[:cut]
    assert stopped.finish_reason == "stop" and len(stopped.logprobs) == cut


def test_hf_engine_load_weights_with_tied_embeddings(tied_model_dir):
    engine = engine_for("hf", tied_model_dir)
    new_model = perturbed_weights(tied_model_dir)
    # Send only the input embedding name for the tied pair, as a resharder may.
    weights = [(k, v) for k, v in new_model.state_dict().items() if k != "lm_head.weight"]
    engine.load_weights(weights)
    greedy = SamplingConfig(temperature=0, max_tokens=10)
    for prompt, samples in zip(PROMPTS, engine.generate(PROMPTS, 1, greedy), strict=True):
        expected = hf_reference_logprobs(new_model, prompt, samples[0].token_ids, 0)
        torch.testing.assert_close(torch.tensor(samples[0].logprobs), expected, atol=1e-4, rtol=0)
        logits = new_model(torch.tensor([prompt + samples[0].token_ids])).logits[0]
        argmax = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert samples[0].token_ids == argmax


def test_hf_engine_loads_per_expert_names_into_fused_experts(tmp_path):
    """transformers 5 fuses a MoE layer's experts ([E, 2F, h] gate_up_proj); the engine takes
    the per-expert checkpoint names the resharder sends and matches a model loaded from disk."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_hf_model(tmp_path / "moe", "qwen3_moe")
    engine = engine_for("hf", model_dir)
    changed = {
        k: v + 0.01 * torch.randn_like(v)
        for k, v in load_file(model_dir / "model.safetensors").items()
    }
    engine.load_weights(list(changed.items()))
    save_file(changed, model_dir / "model.safetensors", metadata={"format": "pt"})
    expected = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    loaded = engine.model.state_dict()
    assert loaded.keys() == expected.keys() and "model.layers.0.mlp.experts.gate_up_proj" in loaded
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    with pytest.raises(KeyError, match="model.layers.0.mlp.no_such.weight"):
        engine.load_weights([("model.layers.0.mlp.no_such.weight", torch.zeros(2))])


# ---- vLLM engine ----------------------------------------------------------------------


# One vLLM engine per process at a time (vLLM's parallel state is process-wide): the tests
# that start their own engines run before the module's shared engine is created.


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize(
    "options, key",
    [
        (dict(kv_cache_gb=1e-5, max_model_len=256), "rollout.kv_cache_gb"),
        (dict(max_model_len=100_000), "rollout.max_model_len"),
    ],
)
def test_vllm_start_errors_name_the_setting(model_dir, options, key):
    if torch.cuda.is_available() and key == "rollout.kv_cache_gb":
        key = "rollout.gpu_memory_utilization"
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        engine_for("vllm", model_dir, **options)


@needs_vllm
@pytest.mark.vllm
def test_vllm_reload_with_tied_embeddings(tied_model_dir):
    """Only model.embed_tokens is sent (as the resharder does): the LM head must follow it."""
    engine = engine_for("vllm", tied_model_dir, kv_cache_gb=0.05, max_model_len=256)
    try:
        reference = perturbed_weights(tied_model_dir)
        weights = [(k, v) for k, v in reference.state_dict().items() if k != "lm_head.weight"]
        assert weights[0][0] == "model.embed_tokens.weight"
        engine.load_weights(weights[:1])  # two calls: the embedding alone first
        engine.load_weights(weights[1:])
        sampled = SamplingConfig(temperature=0.8, max_tokens=16, seed=2)
        for prompt, samples in zip(PROMPTS, engine.generate(PROMPTS, 2, sampled), strict=True):
            for sample in samples:
                expected = hf_reference_logprobs(reference, prompt, sample.token_ids, 0.8)
                actual = torch.tensor(sample.logprobs)
                torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def vllm_engine(model_dir):
    engine = engine_for("vllm", model_dir, kv_cache_gb=0.05, max_model_len=256)
    yield engine
    engine.close()


@needs_vllm
@pytest.mark.vllm
def test_vllm_on_cpu_compiles_nothing_when_it_samples_or_scores(vllm_engine):
    """vLLM compiles its log-prob ranking op with inductor on first use (1.8 s a process on CPU):
    the engine runs it eager on CPU. The results equal the compiled op's (the scoring and
    sampling tests below compare them with transformers)."""
    from torch._dynamo.utils import counters

    before = counters["frames"]["total"]
    sampled = SamplingConfig(temperature=1.0, max_tokens=4, seed=3)
    for completion in vllm_engine.generate(PROMPTS, 2, sampled)[0]:
        assert len(completion.logprobs) == len(completion.token_ids) > 0
    vllm_engine.sequence_log_probs([PROMPTS[0] + [11]], 2)
    assert counters["frames"]["total"] == before  # no frame went through torch.compile


# Before the reload test below: it needs the folder's weights in the shared engine.
@needs_vllm
@pytest.mark.vllm
def test_vllm_scores_given_tokens_as_transformers_does(vllm_engine, model_dir):
    """Prompt log-probs, as a distillation teacher scores: every token's, and every position's
    top 5 (ids and log-probs), equal transformers' log-softmax (the HF engine) at temperature 1."""
    sequences = [prompt + [11, 12, 13] for prompt in PROMPTS]
    plain = [scored.log_probs for scored in vllm_engine.sequence_log_probs(sequences)]
    top = vllm_engine.sequence_log_probs(sequences, 5)
    reference = engine_for("hf", model_dir).sequence_log_probs(sequences, 5)
    for ids, own, mine, expected in zip(sequences, plain, top, reference, strict=True):
        assert len(own) == len(ids) - 1 and mine.top_ids.shape == (len(ids) - 1, 5)
        torch.testing.assert_close(
            torch.tensor(own), torch.tensor(expected.log_probs), atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(mine.log_probs), torch.tensor(expected.log_probs), atol=1e-4, rtol=0
        )
        assert torch.equal(mine.top_ids, expected.top_ids)
        torch.testing.assert_close(mine.top_log_probs, expected.top_log_probs, atol=1e-4, rtol=0)


@needs_vllm
@pytest.mark.vllm
def test_vllm_matches_hf_greedy_and_logprobs_before_and_after_reload(vllm_engine, model_dir):
    from transformers import AutoModelForCausalLM

    hf_engine = engine_for("hf", model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    greedy = SamplingConfig(temperature=0, max_tokens=16)
    sampled = SamplingConfig(temperature=0.8, top_p=1.0, max_tokens=16, seed=11)
    for step in range(2):
        vllm_greedy = vllm_engine.generate(PROMPTS, 2, greedy)
        hf_greedy = hf_engine.generate(PROMPTS, 1, greedy)
        for v, h in zip(vllm_greedy, hf_greedy, strict=True):
            assert v[0].token_ids == v[1].token_ids == h[0].token_ids
            torch.testing.assert_close(
                torch.tensor(v[0].logprobs), torch.tensor(h[0].logprobs), atol=1e-4, rtol=0
            )
        for prompt, samples in zip(PROMPTS, vllm_engine.generate(PROMPTS, 4, sampled), strict=True):
            assert len({tuple(s.token_ids) for s in samples}) > 1
            for sample in samples:
                expected = hf_reference_logprobs(reference, prompt, sample.token_ids, 0.8)
                actual = torch.tensor(sample.logprobs)
                torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
        if step == 0:  # in-place reload to new weights, then compare again
            reference = perturbed_weights(model_dir)
            vllm_engine.load_weights(reference.state_dict().items())
            hf_engine.load_weights(reference.state_dict().items())


@needs_vllm
@pytest.mark.vllm
def test_vllm_seeds_stop_tokens_and_sleep(vllm_engine):
    sampling = SamplingConfig(temperature=1.0, max_tokens=8, seed=5)
    assert vllm_engine.generate([], 4, sampling) == []
    first = vllm_engine.generate(PROMPTS, 4, sampling)
    again = vllm_engine.generate(PROMPTS, 4, sampling)
    assert [[s.token_ids for s in r] for r in first] == [[s.token_ids for s in r] for r in again]
    # Two replicas with the same base seed must not repeat each other's samples.
    own = vllm_engine.replica
    vllm_engine.replica = ReplicaInfo(index=1, count=2, is_leader=True)
    try:
        other = vllm_engine.generate(PROMPTS, 4, sampling)
    finally:
        vllm_engine.replica = own
    assert [[s.token_ids for s in r] for r in first] != [[s.token_ids for s in r] for r in other]

    stop = first[0][0].token_ids[1]
    length = first[0][0].token_ids.index(stop) + 1
    cut = vllm_engine.generate(
        PROMPTS[:1], 4, SamplingConfig(temperature=1.0, max_tokens=8, seed=5, stop_token_ids=[stop])
    )[0][0]
    assert cut.finish_reason == "stop" and cut.token_ids == first[0][0].token_ids[:length]
    assert len(cut.logprobs) == length

    vllm_engine.sleep()
    vllm_engine.wake_up()
    assert vllm_engine.generate(PROMPTS, 4, sampling)[0][0].token_ids == first[0][0].token_ids


@needs_vllm
@pytest.mark.vllm
def test_vllm_requests_are_answered_alike_alone_or_together(vllm_engine):
    """What a multi-turn loop relies on: each request's completions follow from its own token
    ids, sampling and seed, not from the other requests of the call."""
    sampling = SamplingConfig(temperature=1.0, max_tokens=8)
    requests = [GenerationRequest(p, sampling, n=2, seed=100 + i) for i, p in enumerate(PROMPTS)]
    together = vllm_engine.generate_requests(requests)
    alone = [vllm_engine.generate_requests([r])[0] for r in requests]
    assert [[c.token_ids for c in r] for r in together] == [[c.token_ids for c in r] for r in alone]
    # generate() is the same requests with per-(replica, prompt) seed blocks
    base = SamplingConfig(temperature=1.0, max_tokens=8, seed=7)
    from rlcli.rollout.base import request_seed

    by_prompt = vllm_engine.generate(PROMPTS, 2, base)
    seeded = [
        GenerationRequest(p, base, 2, request_seed(7, 0, i, 2)) for i, p in enumerate(PROMPTS)
    ]
    explicit = vllm_engine.generate_requests(seeded)
    assert [[c.token_ids for c in r] for r in by_prompt] == [
        [c.token_ids for c in r] for r in explicit
    ]


@needs_vllm
@pytest.mark.vllm
def test_two_vllm_engines_in_one_process(model_dir, tmp_path):
    """The policy's engine and a judge's (another model, built from a reward.judge section) live
    in one process: each answers as HF greedy does for its own model, and closing the policy's
    leaves the judge's working (vLLM's shared state is torn down when the last one closes)."""
    from rlcli.config.schema import JudgeConfig

    judge_dir = make_tiny_hf_model(tmp_path / "judge", "llama", seed=5, **VLLM_SHAPE)
    policy = engine_for("vllm", model_dir, kv_cache_gb=0.05, max_model_len=64)
    section = JudgeConfig(engine="vllm", kv_cache_gb=0.05, path=str(judge_dir))
    judge = make_engine(section, str(judge_dir), max_model_len=64, key="reward.judge")
    greedy = SamplingConfig(temperature=0, max_tokens=8)
    try:
        for engine, folder in ((policy, model_dir), (judge, judge_dir)):
            expected = engine_for("hf", folder).generate(PROMPTS, 1, greedy)
            actual = engine.generate(PROMPTS, 1, greedy)
            assert [r[0].token_ids for r in actual] == [r[0].token_ids for r in expected], folder
        assert [r[0].token_ids for r in policy.generate(PROMPTS, 1, greedy)] != [
            r[0].token_ids for r in judge.generate(PROMPTS, 1, greedy)
        ]
        policy.close()
        again = judge.generate(PROMPTS, 1, greedy)
        assert [r[0].token_ids for r in again] == [r[0].token_ids for r in actual]
    finally:
        policy.close()
        judge.close()
