"""The benchmark's sections, run in child processes (see run.py). A full run gives each section
a fresh process, so its peak memory is its own and megatron / vLLM global state never leaks from
one section into the next; a smoke run saves the start-up cost and runs them all in one:

    python -m benchmarks.sections <section[,section...]> <workload.json> <work_dir> <result.json>

    device   device name, data-sheet peak, measured dense matmul FLOP/s
    rollout  vLLM engine vs HF `generate` engine: new tokens/s, same model, prompts, sampling
    sync     parallel.reshard weight sync vs naive per-tensor gather-and-load vs memcpy floor
             (sync_section.py)
    train    Megatron actor update (rlcli.trained_model) vs a plain HF + torch AdamW loop: tokens/s
    grpo     a short real `rlcli train` run of the quickstart recipe: per-phase time shares, and
             the plain PyTorch loop on the same model and batch (grpo.py)
    placement  colocated vs separate (synchronous, staleness 1) `rlcli train --nproc 2` runs of
             the quickstart task: steps/s, idle shares, held-out accuracy per second
             (placement.py)
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.grpo import grpo_section
from benchmarks.hardware import detect_hardware, measure_matmul_flops
from benchmarks.memory import measure_peak_memory
from benchmarks.placement import placement_section
from benchmarks.sync_section import sync_section
from benchmarks.workload import Workload, ensure_model

REPO_ROOT = Path(__file__).resolve().parents[1]
SEED = 1234


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_token_ids(rows: int, length: int, vocab_size: int, seed: int) -> torch.Tensor:
    """[rows, length] int64 ids below vocab_size - 1 (the workload models' EOS is the last id)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size - 1, (rows, length), generator=generator)


# ---------------------------------------------------------------------------------------------
# device


def device_section(workload: Workload, work_dir: Path) -> dict:
    hardware = detect_hardware()
    dtype = getattr(torch, workload.dtype)
    flops = measure_matmul_flops(workload.matmul_size, dtype, _device())
    return {
        "hardware": hardware.to_dict(),
        "torch_threads": torch.get_num_threads(),
        "matmul_flops": flops,
        "matmul_dtype": workload.dtype,
        "matmul_size": workload.matmul_size,
    }


# ---------------------------------------------------------------------------------------------
# rollout


def rollout_section(workload: Workload, work_dir: Path) -> dict:
    from rlcli.config import RolloutConfig
    from rlcli.rollout import SamplingConfig, make_engine

    w = workload
    model_dir = ensure_model(w.rollout_model, work_dir / "models", w.dtype)
    prompts = random_token_ids(
        w.rollout_prompts, w.rollout_prompt_len, w.rollout_model.vocab_size, SEED
    ).tolist()
    # What RL sampling asks of an engine: temperature 1, n samples per prompt, the sampled
    # tokens' log-probs. Both engines stop at EOS; new tokens are counted, not assumed.
    sampling = SamplingConfig(temperature=1.0, max_tokens=w.rollout_max_tokens, seed=SEED)
    warmup = SamplingConfig(temperature=1.0, max_tokens=4, seed=SEED)
    result: dict = {
        "model": w.rollout_model.name,
        "params": w.rollout_model.num_params(),
        "matmul_params": w.rollout_model.num_matmul_params(),
        "prompts": w.rollout_prompts,
        "prompt_len": w.rollout_prompt_len,
        "n": w.rollout_n,
        "max_tokens": w.rollout_max_tokens,
        "dtype": w.dtype,
    }
    for kind in ("hf", "vllm"):  # HF first: its memory is freed cleanly before vLLM starts
        with measure_peak_memory() as memory:
            rollout = RolloutConfig(
                engine=kind, kv_cache_gb=0.5, gpu_memory_utilization=0.4, load_format="auto"
            )
            engine = make_engine(
                rollout,
                str(model_dir),
                dtype=w.dtype,
                seed=SEED,
                max_model_len=w.rollout_prompt_len + w.rollout_max_tokens,
            )
            engine.generate(prompts, w.rollout_n, warmup)  # first calls allocate, pick kernels
            _synchronize()
            start = time.perf_counter()
            completions = engine.generate(prompts, w.rollout_n, sampling)
            _synchronize()
            seconds = time.perf_counter() - start
            engine.close()
            del engine
            _free_memory()
        new_tokens = sum(len(c.token_ids) for group in completions for c in group)
        result[kind] = {
            "new_tokens": new_tokens,
            "seconds": seconds,
            "tokens_per_s": new_tokens / seconds,
            "memory": memory.to_dict(),
        }
    result["vllm_over_hf"] = result["vllm"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
    return result


# ---------------------------------------------------------------------------------------------
# training


def _nll_loss(outputs: dict[str, torch.Tensor], micro_batch: dict[str, torch.Tensor]):
    """Mean next-token negative log-likelihood of one micro-batch: outputs["log_probs"] is
    [mb, S-1], the log-prob of token t+1 given tokens <= t."""
    loss = -outputs["log_probs"].mean()
    return loss, {"loss": loss.item()}


def _time_steps(step: Callable[[], None], count: int) -> list[float]:
    """Seconds of `count` calls of `step`, after one untimed warm-up call."""
    step()
    seconds = []
    for _ in range(count):
        _synchronize()
        start = time.perf_counter()
        step()
        _synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def _throughput(seconds: list[float], tokens_per_step: int, params: int) -> dict:
    mean = sum(seconds) / len(seconds)
    tokens_per_s = tokens_per_step / mean
    # 6 FLOPs per parameter per token: 2 forward, 4 backward (attention scores not counted).
    return {
        "step_seconds": seconds,
        "tokens_per_s": tokens_per_s,
        "flops_per_s": 6 * params * tokens_per_s,
    }


def train_section(workload: Workload, work_dir: Path) -> dict:
    w = workload
    model_dir = ensure_model(w.train_model, work_dir / "models", w.dtype)
    rows = w.train_micro_batches * w.train_micro_batch_size
    ids = random_token_ids(rows, w.train_seq_len, w.train_model.vocab_size, SEED).to(_device())
    micro_batches = [
        {"input_ids": chunk, "attention_mask": torch.ones_like(chunk)}
        for chunk in ids.split(w.train_micro_batch_size)
    ]
    tokens_per_step = rows * w.train_seq_len
    result: dict = {
        "model": w.train_model.name,
        "tokens_per_step": tokens_per_step,
        "micro_batches": w.train_micro_batches,
        "micro_batch_size": w.train_micro_batch_size,
        "seq_len": w.train_seq_len,
        "dtype": w.dtype,
    }

    with measure_peak_memory() as memory:
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        seconds, params = _megatron_training_steps(
            model_dir, w.dtype, batch, w.train_micro_batch_size, w.train_steps
        )
        _free_memory()
    result["params"] = params
    result["megatron"] = {**_throughput(seconds, tokens_per_step, params),
                          "memory": memory.to_dict()}  # fmt: skip

    with measure_peak_memory() as memory:
        seconds, hf_params = _hf_training_steps(model_dir, micro_batches, w.train_steps)
        _free_memory()
    result["hf_baseline"] = {**_throughput(seconds, tokens_per_step, hf_params),
                             "memory": memory.to_dict()}  # fmt: skip
    result["megatron_over_hf"] = (
        result["megatron"]["tokens_per_s"] / result["hf_baseline"]["tokens_per_s"]
    )
    result["mixed_lengths"] = _mixed_length_update(w, model_dir)
    return result


def _mixed_length_update(w: Workload, model_dir: Path) -> dict:
    """The actor update on rows of mixed lengths (uniform in [S/8, S]): fixed micro-batches of
    `train_micro_batch_size` rows against a token budget of the same padded size
    (`actor.max_tokens_per_micro_batch` = rows x S). Tokens/s counts real tokens only."""
    from parallel.schedule import micro_batches

    rows = 4 * w.train_micro_batches * w.train_micro_batch_size
    ids = random_token_ids(rows, w.train_seq_len, w.train_model.vocab_size, SEED + 1)
    generator = torch.Generator().manual_seed(SEED)
    lengths = torch.randint(w.train_seq_len // 8, w.train_seq_len + 1, (rows,), generator=generator)
    mask = (torch.arange(w.train_seq_len)[None] < lengths[:, None]).long()
    batch = {"input_ids": (ids * mask).to(_device()), "attention_mask": mask.to(_device())}
    real = int(mask.sum())
    out: dict = {"rows": rows, "seq_len": w.train_seq_len, "real_tokens": real}
    for name, budget in (
        ("fixed", 0),
        ("token_budget", w.train_micro_batch_size * w.train_seq_len),
    ):
        parts = micro_batches(batch, w.train_micro_batch_size, max_tokens=budget)
        computed = sum(p["input_ids"].numel() for p in parts)
        seconds, _ = _megatron_training_steps(
            model_dir, w.dtype, batch, w.train_micro_batch_size, w.train_steps, max_tokens=budget
        )
        _free_memory()
        out[name] = {
            "micro_batches": len(parts),
            "computed_tokens": computed,
            "padded_fraction": 1 - real / computed,
            "step_seconds": seconds,
            # The median step: on a shared machine one slow step would skew a mean.
            "tokens_per_s": real / statistics.median(seconds),
        }
    # Before per-micro-batch trimming every micro-batch kept the batch-wide S.
    out["batch_wide_padded_fraction"] = 1 - real / (rows * w.train_seq_len)
    out["budget_over_fixed"] = out["token_budget"]["tokens_per_s"] / out["fixed"]["tokens_per_s"]
    return out


def _megatron_training_steps(
    model_dir: Path,
    dtype: str,
    batch: dict[str, torch.Tensor],
    micro_batch_size: int,
    steps: int,
    max_tokens: int = 0,
) -> tuple[list[float], int]:
    """rlcli's actor (`rlcli.trained_model.TrainedModel`: megatron-core GPTModel, DDP,
    distributed optimizer off, Adam, clipping at 1.0) on one process: seconds of each timed
    step, params."""
    from parallel.mesh import destroy_parallel, init_parallel
    from rlcli.trained_model import MicroBatching, OptimizerSettings, TrainedModel

    mesh = init_parallel(tp=1, pp=1, seed=SEED)
    settings = OptimizerSettings(
        lr=1e-5, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
        clip_grad=1.0, warmup_steps=0, total_steps=steps + 1, decay_style="constant",
        use_distributed_optimizer=False,
    )  # fmt: skip
    actor = TrainedModel(
        mesh,
        str(model_dir),
        dtype=dtype,
        optim=settings,
        micro_batching=MicroBatching(micro_batch_size, max_tokens),
    )
    seconds = _time_steps(lambda: actor.train_step(batch, _nll_loss), steps)
    params = len_unique_params(actor.models)
    destroy_parallel()
    return seconds, params


def len_unique_params(models: list[torch.nn.Module]) -> int:
    """Parameters held by `models`, a shared (tied) tensor counted once."""
    seen = {id(p): p.numel() for model in models for p in model.parameters()}
    return sum(seen.values())


def _hf_training_steps(
    model_dir: Path, micro_batches: list[dict[str, torch.Tensor]], steps: int
) -> tuple[list[float], int]:
    """The loop a user writes without a framework: HF model, torch AdamW, gradient accumulation
    over the same micro-batches and loss (sum of per-micro-batch mean NLL), clipping at 1.0.
    On GPU: fp32 weights and optimizer under bf16 autocast (as Megatron keeps fp32 main
    parameters)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(_device())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    on_gpu = torch.cuda.is_available()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for micro in micro_batches:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu):
                loss = model(input_ids=micro["input_ids"], labels=micro["input_ids"]).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return _time_steps(step, steps), len_unique_params([model])


SECTIONS: dict[str, Callable[[Workload, Path], dict]] = {
    "device": device_section,
    "rollout": rollout_section,
    "sync": sync_section,
    "train": train_section,
    "grpo": grpo_section,
    "placement": placement_section,
}


def main(argv: list[str]) -> None:
    """Run the comma-separated sections in order; after each, rewrite the result file with
    {name: {"result": ...} or {"error": traceback}}, so a crash keeps what finished."""
    names, workload_file, work_dir, result_file = argv
    workload = Workload.from_dict(json.loads(Path(workload_file).read_text()))
    outcomes: dict[str, dict] = {}
    for name in names.split(","):
        start = time.perf_counter()
        try:
            result = SECTIONS[name](workload, Path(work_dir))
            outcomes[name] = {"result": {**result, "section_seconds": time.perf_counter() - start}}
        except Exception:
            traceback.print_exc()
            outcomes[name] = {"error": traceback.format_exc()}
        finally:
            _leave_parallel_state()
        Path(result_file).write_text(json.dumps(outcomes, indent=2))


def _leave_parallel_state() -> None:
    """The next section in this process starts its own process groups."""
    if "parallel.mesh" in sys.modules:
        from parallel.mesh import destroy_parallel

        destroy_parallel()


if __name__ == "__main__":  # megatron's checkpoint writer re-imports the main module (spawn)
    main(sys.argv[1:])
