"""The fixed workloads: one per mode, sized to the hardware, and the random models they run on.

Models are random Qwen2s built with rlcli's own builder (`rlcli.model.builder`) and saved as HF
safetensors, so every engine reads them exactly as it would read a downloaded checkpoint.
Modes: "smoke" (seconds; checks the code paths), "cpu" (tens of millions of parameters, a few
minutes on 2 cores), "gpu" (Qwen2-0.5B / 1.5B shapes, bf16).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

MODES = ("smoke", "cpu", "gpu")


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2 architecture (random weights). vLLM's CPU attention needs head_dim >= 32."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    def num_params(self) -> int:
        """Parameter count of the HF model (a tied embedding counted once)."""
        h, head_dim = self.hidden_size, self.hidden_size // self.num_heads
        kv = self.num_kv_heads * head_dim
        attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (+bias), k, v (+bias), o
        mlp = 3 * h * self.intermediate_size
        layer = attention + mlp + 2 * h  # two RMSNorms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + h

    def num_matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: all but an untied input embedding
        (a table lookup)."""
        lookup = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_params() - lookup


SMOKE = ModelShape("smoke-0.4M", 128, 2, 4, 2, 256, 512)
CPU_5M = ModelShape("cpu-5M", 256, 4, 4, 2, 704, 4096)
CPU_25M = ModelShape("cpu-25M", 512, 6, 8, 2, 1408, 8192)
CPU_60M = ModelShape("cpu-60M", 768, 8, 12, 4, 2048, 8192)
QWEN2_05B = ModelShape("qwen2-0.5B", 896, 24, 14, 2, 4864, 151936, tie_word_embeddings=True)
QWEN2_15B = ModelShape("qwen2-1.5B", 1536, 28, 12, 2, 8960, 151936, tie_word_embeddings=True)
# benchmarks/sync_bench.py builds untied fp32 models: the sync rows use untied twins.
QWEN2_05B_UNTIED = replace(QWEN2_05B, name="qwen2-0.5B-untied", tie_word_embeddings=False)
QWEN2_15B_UNTIED = replace(QWEN2_15B, name="qwen2-1.5B-untied", tie_word_embeddings=False)


@dataclass
class Workload:
    mode: str
    dtype: str  # of every model and engine: "float32" on CPU, "bfloat16" on GPU
    # rollout: the same prompts and sampling on both engines
    rollout_model: ModelShape
    rollout_prompts: int
    rollout_prompt_len: int
    rollout_n: int
    rollout_max_tokens: int
    # weight sync, one row per size
    sync_models: list[ModelShape]
    sync_bucket_mb: int  # 0: parallel.reshard's automatic size
    sync_repeats: int
    # actor update: `train_steps` timed steps after `train_warmup_steps` warm-up steps
    train_model: ModelShape
    train_micro_batches: int
    train_micro_batch_size: int
    train_seq_len: int
    train_steps: int
    # a short real GRPO run of the trainer on the quickstart recipe
    grpo_steps: int
    grpo_overrides: list[str] = field(default_factory=list)
    # The first step builds the optimizer state. On CPU the next ones are slow too while glibc's
    # heap grows to the update's working set: the 25M update's log-softmax took 134 ms in its
    # second step and 5 ms from its fifth on. Warm-up steps are reported, not averaged.
    train_warmup_steps: int = 1
    matmul_size: int = 1024
    # bonus: the first sync size again from 2-process training layouts under torchrun
    # ("tp" or "pp" -> that size 2); skipped where fewer than 2 cores / GPUs are present
    sync_layouts: list[str] = field(default_factory=list)
    # the lora section: adapters of this rank on every linear of the train model (alpha 2 x rank)
    lora_rank: int = 16
    # placement comparison (benchmarks/placement.py): the quickstart recipe's SFT warm start,
    # then this many GRPO steps per placement, on 2 processes
    placement_sft_steps: int = 450
    placement_steps: int = 150
    placement_overrides: list[str] = field(default_factory=list)
    # the placement runs' engine: "vllm" where installed, else "hf" (None), or this one
    placement_engine: str | None = None
    # trainer/engine mismatch (benchmarks/mismatch.py): the quickstart's SFT warm start, then this
    # many GRPO steps per rollout correction and per MoE routing replay, one process each
    mismatch_sft_steps: int = 600
    mismatch_steps: int = 20
    mismatch_overrides: list[str] = field(default_factory=list)
    mismatch_corrections: list[str] = field(default_factory=list)  # empty: every one
    mismatch_replays: list[str] = field(default_factory=list)  # empty: none, r2, r3
    # recovery from a lost rank (benchmarks/recovery.py): this many killed-and-restarted runs of
    # the quickstart on 2 processes; their engine ("vllm" where installed, else "hf": None)
    recovery_runs: int = 3
    recovery_engine: str | None = None
    recovery_overrides: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Workload:
        data = dict(data)
        for key in ("rollout_model", "train_model"):
            data[key] = ModelShape(**data[key])
        data["sync_models"] = [ModelShape(**shape) for shape in data["sync_models"]]
        return cls(**data)


# The quickstart recipe, trimmed to a few plain GRPO steps from the random model: no SFT warm
# start, no DAPO filtering (a random model's groups all score 0 and would all be dropped, so no
# update or sync would run), no validation before training.
GRPO_BASE_OVERRIDES = [
    "sft.steps=0",
    "algorithm.dynamic_sampling.enabled=false",
    "trainer.val_before_train=false",
    "trainer.val_freq=0",
    "logging.backends=[jsonl]",
    "checkpoint.save_optimizer=false",
]


def workload_for(mode: str, gpu_memory_gib: float = 80.0) -> Workload:
    """The fixed workload of `mode` (one of MODES); on GPU the trained model follows the
    device's memory (the HF + AdamW baseline keeps fp32 weights, grads and Adam state: 16 bytes
    per parameter, 24 GiB at 1.5B)."""
    if mode == "smoke":
        return Workload(
            mode=mode, dtype="float32",
            rollout_model=SMOKE, rollout_prompts=4, rollout_prompt_len=8, rollout_n=2,
            rollout_max_tokens=8,
            sync_models=[SMOKE], sync_bucket_mb=1, sync_repeats=1,
            train_model=SMOKE, train_micro_batches=1, train_micro_batch_size=2,
            train_seq_len=16, train_steps=1,
            grpo_steps=2, grpo_overrides=["data.train_batch_size=2", "rollout.n=2"],
            matmul_size=256,
            placement_sft_steps=10, placement_steps=3,
            placement_overrides=["data.train_batch_size=2", "rollout.n=2",
                                 "algorithm.dynamic_sampling.enabled=false"],
            # the code paths are the engines' own; vLLM's start (7-8 s an engine, four of them)
            # was a third of the smoke run (the rollout section times vLLM)
            placement_engine="hf",
            mismatch_sft_steps=0, mismatch_steps=1,
            mismatch_corrections=["token_mis"], mismatch_replays=["r3"],
            mismatch_overrides=["data.train_batch_size=2", "rollout.n=2", "rollout.max_tokens=8",
                                "algorithm.dynamic_sampling.enabled=false"],
            recovery_runs=1, recovery_engine="hf",
            recovery_overrides=["data.train_batch_size=2", "rollout.n=2", "rollout.max_tokens=8",
                                "algorithm.dynamic_sampling.enabled=false"],
        )  # fmt: skip
    if mode == "cpu":
        return Workload(
            mode=mode, dtype="float32",
            rollout_model=CPU_25M, rollout_prompts=32, rollout_prompt_len=32, rollout_n=4,
            rollout_max_tokens=64,
            sync_models=[CPU_5M, CPU_25M, CPU_60M], sync_bucket_mb=0, sync_repeats=3,
            train_model=CPU_25M, train_micro_batches=2, train_micro_batch_size=4,
            train_seq_len=128, train_steps=5, train_warmup_steps=4,
            grpo_steps=4, matmul_size=2048, sync_layouts=["tp", "pp"],
        )  # fmt: skip
    if mode == "gpu":
        return Workload(
            mode=mode, dtype="bfloat16",
            rollout_model=QWEN2_05B, rollout_prompts=128, rollout_prompt_len=128, rollout_n=4,
            rollout_max_tokens=256,
            sync_models=[QWEN2_05B_UNTIED, QWEN2_15B_UNTIED], sync_bucket_mb=512,
            sync_repeats=5,
            train_model=QWEN2_15B if gpu_memory_gib >= 40 else QWEN2_05B,
            train_micro_batches=4, train_micro_batch_size=4, train_seq_len=1024, train_steps=5,
            train_warmup_steps=2, grpo_steps=6, matmul_size=8192, sync_layouts=["tp", "pp"],
        )  # fmt: skip
    raise ValueError(f"unknown benchmark mode {mode!r}; choose one of {MODES}")


def ensure_model(shape: ModelShape, root: Path, dtype: str, seed: int = 0) -> Path:
    """`root/<shape.name>`: the random HF model of `shape`, built on first use."""
    out = root / f"{shape.name}-{dtype}"
    if (out / "config.json").is_file():
        return out
    import torch

    from rlcli.config.model import ModelBuildConfig
    from rlcli.model.builder import build_random_model

    spec = ModelBuildConfig(
        architecture="qwen2",
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=4096,
    )
    # EOS is the last id: random prompts draw from the ids below it (see sections.random_prompts).
    eos_id = shape.vocab_size - 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # random init of a 1.5B model is minutes on CPU, a second on GPU
        model = build_random_model(spec, shape.vocab_size, eos_id, eos_id, seed)
    model = model.to(getattr(torch, dtype))
    tmp = out.with_name(out.name + ".building")
    model.save_pretrained(tmp, safe_serialization=True)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    tmp.rename(out)
    return out
