"""Shared pieces of the GPU check: shapes, the random HF models, the actor, timing, memory."""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parallel.model_options import ModelBuildOptions
from parallel.step_types import LossReport, MicroBatch, ModelOutputs

BF16 = torch.bfloat16
REPO_ROOT_ENV = str(Path(__file__).resolve().parents[2])  # for child processes' PYTHONPATH

# A small Qwen2 for the correctness checks: GQA, odd vocabulary (TP padding), biases on q/k/v.
SMALL_GPU = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=1408,
    vocab_size=4099,
    max_position_embeddings=1024,
)
SMALL_CPU = dict(  # head_dim 64: vLLM-CPU's bf16 attention has no kernel for 16
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=384,
    vocab_size=251,
    max_position_embeddings=256,
)


@dataclass
class Actor:
    models: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    pack_sequences: bool = False


@dataclass
class Context:
    cpu: bool
    work: Path
    log: Callable[[str], None]
    engine: str = "auto"  # rollout engine kind for checks 3, 4, 6
    mesh: Any = None
    small_model_dir: Path | None = None
    _tmp: Any = None
    _engine: Any = None
    notes: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(
        cls, *, cpu_dry_run: bool, work_dir: str | None, log, engine: str = "auto"
    ) -> Context:
        from parallel.mesh import init_parallel

        tmp = None
        if work_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="rlcli-gpu-check-")
            work_dir = tmp.name
        ctx = cls(cpu=cpu_dry_run and not torch.cuda.is_available(), work=Path(work_dir), log=log)
        ctx._tmp = tmp
        if engine == "auto":
            engine = "vllm" if importlib.util.find_spec("vllm") else "hf"
        ctx.engine = engine
        ctx.work.mkdir(parents=True, exist_ok=True)
        ctx.mesh = init_parallel(tp=1, pp=1, seed=1234, timeout_s=600)
        ctx.small_model_dir = make_hf_model(
            ctx.work / "small", SMALL_CPU if ctx.cpu else SMALL_GPU, seed=0
        )
        return ctx

    @property
    def device(self) -> torch.device:
        from parallel.cpu_compat import device

        return device()

    def describe(self) -> str:
        from parallel.model_backends import transformer_engine_status

        te_ok, te_why = transformer_engine_status()
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run)"
        versions = []
        for package in ("megatron.core", "transformers", "vllm"):
            spec = importlib.util.find_spec(package)
            if spec is None:
                versions.append(f"{package}=absent")
                continue
            module = __import__(package, fromlist=["__version__"])
            versions.append(f"{package}={getattr(module, '__version__', '?')}")
        te = "TE ok" if te_ok else f"TE: {te_why[:80]}"
        return f"gpu-check on {name}; engine {self.engine}; torch {torch.__version__}; {', '.join(versions)}; {te}"

    def release_memory(self) -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def rollout_engine(self) -> Any:
        """One engine for the whole check, as in training: vLLM's shutdown also destroys
        torch.distributed's default group, so it is closed only at the very end."""
        if self._engine is None:
            from rlcli import rollout
            from rlcli.config.schema import RolloutConfig

            section = RolloutConfig(
                engine=self.engine,
                gpu_memory_utilization=0.3,
                kv_cache_gb=0.25,
                load_format="auto",
            )
            self._engine = rollout.make_engine(
                section, str(self.small_model_dir), dtype="bfloat16", seed=0, max_model_len=256
            )
        return self._engine

    def close(self) -> None:
        from parallel.mesh import destroy_parallel

        if self._engine is not None:
            self._engine.close()
        destroy_parallel()
        if self._tmp is not None:
            shutil.rmtree(self.work, ignore_errors=True)


def make_hf_model(out_dir: Path, shape: dict, seed: int) -> Path:
    """A random fp32 Qwen2 saved as safetensors (norms and biases randomised too, so a mapping
    mistake shows), with a generation_config naming EOS 0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (out_dir / "config.json").exists():
        return out_dir
    config = Qwen2Config(
        **shape,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def hf_config_of(model_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def make_actor(
    ctx: Context,
    hf_config: Any,
    *,
    model_dir: Path | None,
    distributed_optimizer: bool,
    lr: float = 1e-3,
    seed: int = 0,
    transformer_impl: str = "local",
    attention_backend: str = "auto",
    pack_sequences: bool = False,
) -> Actor:
    """A bf16 Megatron actor: model (HF weights from `model_dir`, or random init with `seed`),
    megatron DDP and optimizer (fp32 master weights); `pack_sequences` makes `step` run its
    micro-batches packed."""
    from parallel.convert import load_hf_weights
    from parallel.model import build_model
    from parallel.optim import OptimizerSettings, build_optimizer, wrap_for_training

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    models = build_model(
        hf_config,
        ctx.mesh,
        dtype=BF16,
        options=ModelBuildOptions(
            transformer_impl=transformer_impl,
            attention_backend=attention_backend,
            pack_sequences=pack_sequences,
        ),
    )
    if model_dir is not None:
        load_hf_weights(models, ctx.mesh, model_dir)
    models = wrap_for_training(models, ctx.mesh, use_distributed_optimizer=distributed_optimizer)
    optimizer, scheduler = build_optimizer(
        models,
        OptimizerSettings(lr=lr, use_distributed_optimizer=distributed_optimizer, total_steps=100),
    )
    return Actor(models, optimizer, scheduler, pack_sequences)


def nll_loss(outputs: ModelOutputs, micro_batch: MicroBatch) -> tuple[torch.Tensor, LossReport]:
    """Mean next-token NLL over the micro-batch's real tokens."""
    mask = micro_batch.attention_mask[:, 1:].float()
    loss = -(outputs.log_probs * mask).sum() / mask.sum().clamp(min=1)
    return loss, LossReport({"loss": loss.detach()})


def token_batch(
    ctx: Context, vocab: int, rows: int, length: int, micro: int, seed: int = 0
) -> list[MicroBatch]:
    """Random token rows split into micro-batches (all tokens real)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, length), generator=generator).to(ctx.device)
    mask = torch.ones_like(ids)
    return [
        MicroBatch(input_ids=i, attention_mask=m)
        for i, m in zip(ids.split(micro), mask.split(micro), strict=True)
    ]


def step(ctx: Context, actor: Actor, batch: list[MicroBatch]) -> float:
    from parallel.optim import train_step

    result = train_step(
        actor.models,
        ctx.mesh,
        actor.optimizer,
        actor.scheduler,
        batch,
        nll_loss,
        pack_sequences=actor.pack_sequences,
    )
    losses = [report.metrics["loss"] for report in result.reports]
    return sum(losses) / len(losses)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> float:
    """Mean seconds per call after `warmup` calls."""
    for _ in range(warmup):
        fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize()
    return (time.perf_counter() - start) / repeats


def used_memory_gb() -> float:
    """Device memory in use by anything (cudaMemGetInfo); on CPU the process RSS."""
    if torch.cuda.is_available():
        synchronize()
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 2**30


def flat_params(models: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Detached fp32 copies of every parameter, by name (for before / after comparisons)."""
    return {
        f"{i}.{name}": p.detach().float().clone()
        for i, chunk in enumerate(models)
        for name, p in chunk.named_parameters()
    }


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)
