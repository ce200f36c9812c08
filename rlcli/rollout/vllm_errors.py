"""What a failed vLLM start means in rlcli's settings: the message names the key to change."""

from __future__ import annotations

import torch

from rlcli.errors import UserError
from rlcli.rollout.base import model_path_key


def start_error(error: Exception, model_dir: str, on_gpu: bool, key: str) -> Exception:
    """A UserError naming the setting to change (under `key`), or `error` itself when it is not a
    known one."""
    message = str(error)
    memory_key = f"{key}.gpu_memory_utilization" if on_gpu else f"{key}.kv_cache_gb"
    if "create shm" in message and "errno: 17" in message:
        # (a file a killed job left with the same port: name_cpu_shm_after_this_job)
        return UserError(
            "vLLM could not create its tensor-parallel shared memory: a file of that name "
            f"exists, most likely left by a killed run (or another {key}.tp > 1 job runs on "
            "this machine). Remove /dev/shm/*cpushm* when no such job runs."
        )
    if "max_model_len" in message and "derived max_model_len" in message:
        return UserError(
            f"{key}.max_model_len is longer than the model supports ({model_dir}): "
            f"lower {key}.max_model_len.\nvLLM: {message[:400]}"
        )
    if "cache blocks" in message or "KV cache is needed" in message:
        return UserError(
            f"the vLLM KV cache does not fit one sequence of {key}.max_model_len tokens: "
            f"raise {memory_key} or lower {key}.max_model_len.\nvLLM: {message[:400]}"
        )
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in message.lower():
        return UserError(
            f"vLLM ran out of memory starting the engine: lower {memory_key} (and "
            f"{key}.max_model_len), or use fewer {key}.tp replicas.\n{message[:400]}"
        )
    if isinstance(error, OSError) or "safetensors" in message or "weights" in message.lower():
        return UserError(
            f"vLLM cannot load the model at {model_path_key(key)}={model_dir!r}: {message[:400]}"
        )
    return error
