"""vLLM-CPU's workarounds, each for a gap of vLLM 0.32's CPU backend that has no setting: the
shared-memory name of a TP group, the prepacked weights (the LM head's embedding, MoE experts)
that a weight update does not repack, and a sampler op compiled on first use.
``rlcli.rollout.vllm_engine`` calls them; each says what it measured without the fix."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def name_cpu_shm_after_this_job() -> None:
    """vLLM-CPU names a TP group's ``/dev/shm`` file after its init method's tail, ``//`` under
    the external launcher, so a second torchrun job with rollout.tp > 1 on the machine (or a
    restart after a killed attempt) fails to start. vLLM has no setting for it: its naming
    function is wrapped (once) to add the job's rendezvous port and restart count."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm.make_group_name, "_rlcli_job_name", False):
        return
    plain = shm.make_group_name

    def make_group_name(communicator) -> str:
        port, restart = os.environ.get("MASTER_PORT"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
        # (no "/" inside a shared-memory name: the plain one begins with the init method's "//")
        return f"rlcli{port}r{restart}-{plain(communicator).replace('/', '')}"

    make_group_name._rlcli_job_name = True  # type: ignore[attr-defined]
    shm.make_group_name = staticmethod(make_group_name)


def refresh_cpu_embedding_gemm(worker) -> None:
    """vLLM's CPU backend packs the (tied) embedding into a oneDNN matmul handle for the LM head
    when the model loads, and ``reload_weights`` does not repack it: the logits would keep using
    the old embedding. Repack every embedding whose weights may have changed (measured: a
    perturbed tied embedding left log-prob differences of ~1.9 without this, ~1e-6 with it)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in worker.model_runner.model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)


def repack_cpu_experts(worker, moe_layers: list[str]) -> None:
    """vLLM's CPU MoE kernel runs on experts prepacked into its grouped-GEMM layout when the
    model loads, but on a weight update (`reload_weights`) vLLM 0.32 copies the new weights in
    unpacked: `UnquantizedFusedMoEMethod._setup_kernel` prepacks only the first time. Prepack
    the routed experts of the layers just loaded (`moe_layers`: HF prefixes such as
    model.layers.3.mlp; measured: log-prob differences of 0.05-0.4 nats without this, ~5e-7
    with it)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    for name, module in worker.model_runner.model.named_modules():
        if not isinstance(module, RoutedExperts) or name.partition(".experts")[0] not in moe_layers:
            continue
        kernel = getattr(module.quant_method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            config = experts.moe_config
            if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
                raise NotImplementedError(
                    f"{name}: the experts' width {config.intermediate_size_per_partition} per "
                    "rank needs vLLM-CPU's padding, which its weight updates do not redo"
                )
            experts.process_weights_after_loading(module)


@contextmanager
def sampler_ops_eager(on_cpu: bool) -> Iterator[None]:
    """On CPU, run vLLM's ``torch.compile``-decorated sampler op (``batched_count_greater_than``,
    the rank of each returned log-prob) as plain torch: compiling it with inductor costs every
    engine process about 1.8 s of CPU on its first generate (hashing torch's sources, a C++
    build), while eager it is one comparison and a sum over a row of logits (measured on a
    2-core AMD EPYC: a first generate of 16 prompts took 2.0 s compiled, 0.1 s after). On a GPU
    the compiled kernel stays (vLLM compiles it to avoid copies of large logits)."""
    if not on_cpu:
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield
