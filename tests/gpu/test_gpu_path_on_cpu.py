"""What the GPU path's fixes look like on CPU: the engine's replica layout, sleep / wake / load
order and dummy start on the real vLLM-CPU engine, Transformer Engine detection, the layers /
attention resolution and fused-kernel switches, the process-group timeout, and `make gpu-check`
itself (its CPU dry run)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from parallel import model as pmodel
from parallel import model_backends as backends
from parallel.mesh import Mesh
from parallel.model_options import ModelBuildOptions
from rlcli.config.schema import RolloutConfig
from rlcli.rollout import SamplingConfig, make_engine
from tests.parallel.dist_utils import make_tiny_hf_model

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 42, 7], [100, 3]]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no vLLM")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # vLLM's CPU attention needs head_dim >= 32
    return make_tiny_hf_model(
        tmp_path_factory.mktemp("qwen2"), "qwen2", hidden_size=128, max_position_embeddings=256
    )


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


# ---- point 2: independent replicas ------------------------------------------------------


@needs_vllm
@pytest.mark.vllm
def test_vllm_replicas_are_independent_never_one_data_parallel_group():
    from rlcli.rollout.vllm_engine import replica_options

    # 16 GPUs, rollout.tp=2: 8 replicas, each only tensor_parallel_size=2.
    assert replica_options(2, 8, on_gpu=True) == {
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "external_launcher",
    }
    assert replica_options(1, 8, on_gpu=True) == {
        "tensor_parallel_size": 1,
        "distributed_executor_backend": "external_launcher",
    }
    # CPU, tp=1: an in-process engine per rank; one GPU: the uniprocess engine.
    assert replica_options(1, 2, on_gpu=False) == {"tensor_parallel_size": 1}
    assert replica_options(1, 1, on_gpu=True) == {"tensor_parallel_size": 1}
    for tp, replicas, gpu in [(2, 8, True), (1, 4, True), (2, 1, False), (1, 2, False)]:
        assert "data_parallel_size" not in replica_options(tp, replicas, gpu)


# ---- points 7 and 8: call order, level-2 sleep, dummy start ------------------------------


@needs_vllm
@pytest.mark.vllm
def test_vllm_sleep_level_2_needs_a_sync_after_every_sleep_and_records_the_order(model_dir):
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    greedy = SamplingConfig(temperature=0, max_tokens=6)
    section = RolloutConfig(engine="vllm", kv_cache_gb=0.05, sleep_level=2, load_format="auto")
    engine = make_engine(section, str(model_dir), max_model_len=128)
    try:
        assert not engine.needs_weight_sync  # load_format=auto: real weights at start
        first = engine.generate(PROMPTS, 1, greedy)
        engine.sleep()
        assert engine.needs_weight_sync  # level 2 discarded the weights
        engine.wake_up()
        with pytest.raises(RuntimeError, match="sync the weights"):
            engine.generate(PROMPTS, 1, greedy)
        engine.sleep()
        engine.load_weights(weights.items())  # the trainer's sync, while asleep
        assert not engine.needs_weight_sync
        engine.wake_up()
        again = engine.generate(PROMPTS, 1, greedy)
        assert [c[0].token_ids for c in again] == [c[0].token_ids for c in first]
        assert list(engine.calls) == [
            "generate",
            "sleep",
            "wake_up",
            "generate",
            "sleep",
            "load_weights",
            "wake_up",
            "generate",
        ]
    finally:
        engine.close()


@needs_vllm
@pytest.mark.vllm
def test_vllm_dummy_start_then_first_sync_equals_the_checkpoint(model_dir):
    """load_format=dummy + a full load_weights gives the same greedy tokens and log-probs as an
    engine that read the checkpoint (HF generate is the reference)."""
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    greedy = SamplingConfig(temperature=0, max_tokens=8)
    hf = make_engine(RolloutConfig(engine="hf"), str(model_dir))
    expected = hf.generate(PROMPTS, 1, greedy)
    hf.close()
    section = RolloutConfig(engine="vllm", kv_cache_gb=0.05, load_format="dummy")
    engine = make_engine(section, str(model_dir), max_model_len=128)
    try:
        assert engine.needs_weight_sync
        with pytest.raises(RuntimeError, match="sync the weights"):
            engine.generate(PROMPTS, 1, greedy)
        engine.load_weights(weights.items())
        got = engine.generate(PROMPTS, 1, greedy)
    finally:
        engine.close()
    for g, e in zip(got, expected, strict=True):
        assert g[0].token_ids == e[0].token_ids
        torch.testing.assert_close(
            torch.tensor(g[0].logprobs), torch.tensor(e[0].logprobs), atol=1e-4, rtol=0
        )


def test_bad_sleep_level_and_load_format_name_the_key():
    from rlcli.errors import UserError
    from rlcli.validation.loader import load_config

    with pytest.raises(UserError, match=r"rollout\.sleep_level=.*choose one of: 1, 2"):
        load_config(None, ["model.path=/m", "rollout.sleep_level=3"])
    with pytest.raises(UserError, match="rollout.load_format"):
        load_config(None, ["model.path=/m", "rollout.load_format=safetensors-ish"])


# ---- point 4: Transformer Engine detection, sequence parallelism, fused kernels ----------


@pytest.fixture
def fresh_te_status():
    backends.transformer_engine_status.cache_clear()
    yield
    backends.transformer_engine_status.cache_clear()


def test_layers_and_attention_resolve_together(fresh_te_status, monkeypatch):
    resolve, Backends = backends.resolve_backends, backends.Backends
    te_ok = backends.transformer_engine_status()[0]
    assert resolve("local", "local") == Backends("local", "local")  # megatron's unfused one
    assert resolve("local") == resolve("auto", "sdpa") == Backends("local", "sdpa")
    if not te_ok:
        assert resolve() == Backends("local", "sdpa")  # CPU without TE
        with pytest.raises(backends.ModelConfigError, match="model.transformer_impl=local"):
            resolve("transformer_engine")
        with pytest.raises(backends.ModelConfigError, match="model.attention_backend=te but"):
            resolve("auto", "te")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        # CUDA without TE: memory-efficient attention through sdpa, no longer a startup error
        assert resolve() == Backends("local", "sdpa")
    with pytest.raises(backends.ModelConfigError, match="model.transformer_impl"):
        resolve("apex")
    with pytest.raises(backends.ModelConfigError, match="model.attention_backend"):
        resolve("auto", "flash")
    # With a working TE: auto is TE's layers and attention; sdpa / local choose the local layers
    monkeypatch.setattr(backends, "transformer_engine_status", lambda: (True, ""))
    assert resolve() == resolve("transformer_engine", "te") == Backends("transformer_engine", "te")
    assert resolve("auto", "sdpa") == Backends("local", "sdpa")
    with pytest.raises(backends.ModelConfigError, match="model.transformer_impl=local"):
        resolve("transformer_engine", "sdpa")  # contradictory keys
    with pytest.raises(backends.ModelConfigError, match="model.transformer_impl=local"):
        resolve("local", "te")


def test_a_broken_transformer_engine_is_reported_with_its_import_error(
    fresh_te_status, tmp_path, monkeypatch
):
    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text(
        "raise OSError('libtransformer_engine.so: undefined symbol: _ZN3c10')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)
    available, why = backends.transformer_engine_status()
    assert not available and "fails to import" in why and "undefined symbol" in why
    with pytest.raises(backends.ModelConfigError, match="undefined symbol"):
        backends.resolve_backends("transformer_engine")
    with pytest.raises(backends.ModelConfigError, match="undefined symbol"):
        backends.resolve_backends("auto", "te")


def test_sequence_parallel_without_te_names_the_key(fresh_te_status):
    from transformers import Qwen2Config

    if backends.transformer_engine_status()[0]:
        pytest.skip("Transformer Engine is installed")
    mesh = Mesh(2, 0, 0, 2, 1, 1, None, 0, 0, 0, True, True)  # tp=2; nothing collective runs
    config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(backends.ModelConfigError, match="parallel.sequence_parallel"):
        pmodel.build_model(config, mesh, options=ModelBuildOptions(sequence_parallel=True))
    with pytest.raises(backends.ModelConfigError, match="parallel.sequence_parallel"):
        backends.check_model_settings("auto", "auto", sequence_parallel=True, tp=4)
    resolved = backends.check_model_settings("auto", "auto", sequence_parallel=True, tp=1)
    assert resolved == backends.Backends("local", "sdpa")
    # ... and it reaches the model config when asked for
    tc = pmodel.transformer_config_from_hf(config, tp=2, pp=1, sequence_parallel=True)
    assert tc.sequence_parallel


def test_fused_kernels_follow_what_is_installed(monkeypatch):
    assert not any(backends.fused_kernel_options("local").values())  # CPU: all off
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_te = backends.fused_kernel_options("transformer_engine")
    assert on_te["gradient_accumulation_fusion"] and on_te["apply_rope_fusion"]
    assert on_te["bias_activation_fusion"]
    local = backends.fused_kernel_options("local")
    assert not local["apply_rope_fusion"]  # TE's fused RoPE only: packed rows take the THD path
    apex = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    assert local["gradient_accumulation_fusion"] == apex


# ---- point 6: process-group timeout -------------------------------------------------------


def test_process_group_timeout_reaches_torch_and_megatron_groups():
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from megatron.core import parallel_state
        from parallel.mesh import init_parallel
        init_parallel(timeout_s=45 * 60)
        cpu = torch.device("cpu")
        for group in (dist.group.WORLD, parallel_state.get_data_parallel_group()):
            print(int(group._get_backend(cpu).options._timeout.total_seconds()))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2700", "2700"]


# ---- make gpu-check -------------------------------------------------------------------------


def test_gpu_check_without_a_gpu_checks_nothing_and_exits_0(tmp_path):
    env = {**_env(), "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "tests/gpu/gpu_check.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no GPU" in out.stdout and "nothing checked" in out.stdout
    assert "PASS" not in out.stdout
    assert "nothing checked" in (tmp_path / "gpu_check.log").read_text()


@pytest.mark.dist
def test_gpu_check_cpu_dry_run_passes(tmp_path):
    """Checks 1-3 and 5-10 on CPU (tiny shapes, bf16, the hf engine): among them the bf16
    model-only resume, which reverts without `reload_master_weights` (point 3), the attentions
    with and without packing, the varlen call of packed rows (on meta tensors) and the hybrid
    layers' gradients."""
    env = {**_env(), "OUT": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "tests/gpu/gpu_check.py", "--cpu-dry-run", "--engine", "hf"]
        + ["--only", "1,2,3,5,6,7,8,9,10"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = (tmp_path / "gpu_check.log").read_text()
    assert out.returncode == 0, log + out.stderr[-3000:]
    for number in (1, 2, 3, 5, 6, 7, 8, 9, 10):
        assert f"{number}. PASS" in log, log
    assert "with reload_master_weights" in log and "kept" in log
    assert "routed differently" in log and "with R3" in log
    assert "sdpa + packing" in log and "varlen on meta tensors" in log
    assert "DeltaNet grads finite on 15 tensors" in log


@needs_vllm
@pytest.mark.dist
@pytest.mark.vllm
def test_vllm_replicas_step_independently_under_torchrun(model_dir):
    """4 ranks, rollout.tp=2: replica 0 generates three times while replica 1 never steps its
    engine (point 2); with one vLLM data-parallel group replica 0 would hang."""
    from tests.parallel.dist_utils import run_torchrun

    out = run_torchrun(Path(__file__).with_name("replicas_worker.py"), 4, str(model_dir))
    for rank in range(4):
        replica = rank // 2
        assert f"rank {rank} replica {replica} of 2: {[2, 2, 2] if replica == 0 else []}" in out
        assert f"rank {rank} done" in out
