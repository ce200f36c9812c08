"""The benchmark's sections, run in child processes (see run.py). A full run gives each section
a fresh process, so its peak memory is its own and megatron / vLLM global state never leaks from
one section into the next; a smoke run saves the start-up cost and runs them all in one:

    python -m benchmarks.sections <section[,section...]> <workload.json> <work_dir> <result.json>

    device   device name, data-sheet peak, measured dense matmul FLOP/s
    rollout  vLLM engine vs HF `generate` engine: new tokens/s, same model, prompts, sampling
    sync     parallel.reshard weight sync vs naive per-tensor gather-and-load vs memcpy floor
             (sync_section.py)
    train    Megatron actor update (rlcli.model.trained_model) vs a plain HF + torch AdamW loop: tokens/s
             (train_section.py)
    lora     the same update with LoRA adapters: tokens/s and peak memory against full fine-tuning,
             and its weight sync merged vs adapter (lora_section.py)
    grpo     a short real `rlcli train` run of the quickstart recipe: per-phase time shares, and
             the plain PyTorch loop on the same model and batch (grpo.py)
    placement  colocated vs separate (synchronous, staleness 1) `rlcli train --nproc 2` runs of
             the quickstart task: steps/s, idle shares, held-out accuracy per second
             (placement.py)
    mismatch bf16 engine under the fp32 trainer: KL, log-prob gap, masked tokens and held-out
             accuracy per rollout correction; MoE experts routed differently per routing replay
             (mismatch.py)
    recovery a rank of a 2-process quickstart run SIGKILLed: seconds from the kill to the next
             completed step, by phase (recovery.py)
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import SEED, device, free_memory, random_token_ids, synchronize
from benchmarks.grpo import grpo_section
from benchmarks.hardware import detect_hardware, measure_matmul_flops
from benchmarks.lifetime import take_group_down_with_parent
from benchmarks.lora_section import lora_section
from benchmarks.memory import measure_peak_memory
from benchmarks.mismatch import mismatch_section
from benchmarks.placement import placement_section
from benchmarks.recovery import recovery_section
from benchmarks.sync_section import sync_section
from benchmarks.train_section import train_section
from benchmarks.workload import Workload, ensure_model

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# device


def device_section(workload: Workload, work_dir: Path) -> dict:
    hardware = detect_hardware()
    dtype = getattr(torch, workload.dtype)
    flops = measure_matmul_flops(workload.matmul_size, dtype, device())
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
    from rlcli.config.schema import RolloutConfig
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
            synchronize()
            start = time.perf_counter()
            completions = engine.generate(prompts, w.rollout_n, sampling)
            synchronize()
            seconds = time.perf_counter() - start
            engine.close()
            del engine
            free_memory()
        new_tokens = sum(len(c.token_ids) for group in completions for c in group)
        result[kind] = {
            "new_tokens": new_tokens,
            "seconds": seconds,
            "tokens_per_s": new_tokens / seconds,
            "memory": memory.to_dict(),
        }
    result["vllm_over_hf"] = result["vllm"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
    return result


SECTIONS: dict[str, Callable[[Workload, Path], dict]] = {
    "device": device_section,
    "rollout": rollout_section,
    "sync": sync_section,
    "train": train_section,
    "lora": lora_section,
    "grpo": grpo_section,
    "placement": placement_section,
    "mismatch": mismatch_section,
    "recovery": recovery_section,
}


def main(argv: list[str]) -> None:
    """Run the comma-separated sections in order; after each, rewrite the result file with
    {name: {"result": ...} or {"error": traceback}}, so a crash keeps what finished. Whatever ends
    the parent (`python -m benchmarks`) ends this process and all it started (lifetime.py)."""
    take_group_down_with_parent()
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
