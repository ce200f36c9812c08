"""torchrun worker (4 ranks): the separate placement's weight path, piece by piece as the product
wires it. Ranks 0-1 train (Megatron TP2), ranks 2-3 are one vLLM engine (rollout TP2, vLLM's
external launcher inside the rollout ranks' own world).

Each round the trainer changes its weights (noise, as an optimizer step would; the tied
embedding too), announces the version and broadcasts the buckets (``BroadcastTransport``: rank 0
sends, rank 1 only reshards); the engine loads them as they arrive (``receive_weights``), samples,
and sends the samples back over the channel. The trainer's log-probs of those samples must equal
the engine's at the weights that generated them (fp32), and must NOT equal them at the next
round's weights (so the comparison can fail).

usage: torchrun --nproc_per_node 4 separate_sync_worker.py MODEL_DIR
"""

from __future__ import annotations

import sys
import zlib

import torch
import torch.distributed as dist

from parallel.convert import param_mappings
from parallel.mesh import init_parallel
from parallel.roles import init_role_world
from rlcli.config.schema import RolloutConfig
from rlcli.model.trained_model import MicroBatching, TrainedModel
from rlcli.process_lifetime import exit_skipping_teardown
from rlcli.rollout import SamplingConfig, make_engine
from rlcli.rollout.batch import Sample, collate
from rlcli.rollout.channel import Notice, RolloutChannel, StreamedBatch
from rlcli.rollout.transport import BroadcastTransport, receive_weights

ROUNDS = 3
PROMPTS = [[5, 17, 42, 7], [100, 3, 250], [9, 9, 9, 9, 9, 200]]
BUCKET_MB = 0.2  # several buckets


@torch.no_grad()
def perturb(models, hf_config, mesh, round_index: int) -> None:
    for m in param_mappings(models, hf_config, mesh.tp, mesh.tp_rank):
        seed = zlib.crc32(m.hf_names[0].encode()) + 1000 * round_index
        seed += mesh.tp_rank if m.partition_dim is not None else 0
        noise = torch.randn(m.param.shape, generator=torch.Generator().manual_seed(seed))
        m.param.add_(0.05 * noise.to(m.param.dtype))


def trainer(model_dir: str, roles) -> None:
    mesh = init_parallel(tp=2, pp=1, seed=3)
    actor = TrainedModel(mesh, model_dir, dtype="float32", micro_batching=MicroBatching(8))
    channel = RolloutChannel(roles, timeout_s=600)
    transport = BroadcastTransport(roles.weights, BUCKET_MB)
    previous: list[Sample] | None = None
    for round_index in range(ROUNDS):
        if round_index:
            perturb(actor.models, actor.hf_config, mesh, round_index)
        if mesh.rank == 0:
            channel.send_notice(Notice(round_index, weights=True))
        stats = transport.sync(actor.models, mesh)
        assert stats.num_buckets > 1, stats
        box = [channel.receive_batch(round_index + 1).samples if mesh.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        samples = box[0]
        diff = mean_diff(actor, samples)
        assert diff < 1e-5, (round_index, diff)  # the engine held exactly these weights
        if previous is not None:
            stale = mean_diff(actor, previous)
            assert stale > 1e-3, (round_index, stale)  # the check tells other weights apart
        if mesh.rank == 0:
            print(f"SYNC_OK round={round_index} diff={diff:.2e} buckets={stats.num_buckets}")
        previous = samples
    if mesh.rank == 0:
        channel.send_notice(Notice(-1, stop=True))


def mean_diff(actor: TrainedModel, samples: list[Sample]) -> float:
    batch = collate(samples, pad_id=0)
    log_probs = actor.forward(batch, temperature=1.0)
    mask = batch.loss_mask.bool()
    return (log_probs - batch.engine_log_probs).abs()[mask].mean().item()


def rollout(model_dir: str, roles) -> None:
    config = RolloutConfig(tp=2, kv_cache_gb=0.05, placement="separate", num_ranks=2)
    with roles.role_environment():
        engine = make_engine(config, model_dir, dtype="float32", seed=11, max_model_len=64)
    channel = RolloutChannel(roles, timeout_s=600)
    sampling = SamplingConfig(temperature=1.0, max_tokens=6, seed=5)
    while not (notice := channel.receive_notice()).stop:
        receive_weights(roles.weights, engine)
        outputs = engine.generate(PROMPTS, 2, sampling)  # both ranks of the TP2 engine
        samples = [
            Sample(i, prompt, c.token_ids, c.logprobs, c.finish_reason, None)
            for i, (prompt, group) in enumerate(zip(PROMPTS, outputs, strict=True))
            for c in group
        ]
        if roles.rank == 0:
            step = notice.version + 1
            channel.send_batch(StreamedBatch(step, samples, {}, notice.version, {}, {}))
    engine.close()


def main(model_dir: str) -> None:
    roles = init_role_world(num_rollout_ranks=2, timeout_s=600)
    (trainer if roles.is_trainer else rollout)(model_dir, roles)
    roles.barrier_all("end")  # rank 0 hosts the store: it leaves last


if __name__ == "__main__":
    main(sys.argv[1])
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
