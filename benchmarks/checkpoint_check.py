"""What checking a checkpoint against its manifest costs next to loading it (the numbers in
docs/troubleshooting.md): ``python -m benchmarks.checkpoint_check [--work-dir DIR]``.

For the quickstart's model (rlcli's default ``model.spec``) and the benchmark's 25M model, one
process saves a run-shaped checkpoint (model and Adam's moments through
``parallel.checkpoint``, the manifest through ``rlcli.run.checkpoints``) after one update, then
times, best of ``--repeats``, with the page cache warm and with the checkpoint's files evicted
from it (``posix_fadvise(DONTNEED)``; the files are fsynced by the commit):

    check   ``CheckpointManager.check`` (every file's size and CRC-32)
    load    megatron-core's load of the model and the optimizer
    resume  check, then load (what a resume does): against ``load`` alone, the check's overhead
    save    the whole committed save, of which the manifest's hashing is about ``check`` (warm)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import typer

from benchmarks.common import SEED, random_token_ids
from benchmarks.train_section import megatron_actor, nll_loss
from benchmarks.workload import CPU_25M, ModelShape, ensure_model
from rlcli.config.model import ModelBuildConfig

_QUICKSTART_SPEC = ModelBuildConfig()
QUICKSTART = ModelShape(
    "quickstart",
    _QUICKSTART_SPEC.hidden_size,
    _QUICKSTART_SPEC.num_layers,
    _QUICKSTART_SPEC.num_heads,
    _QUICKSTART_SPEC.num_kv_heads,
    _QUICKSTART_SPEC.intermediate_size,
    _QUICKSTART_SPEC.vocab_size,
    tie_word_embeddings=_QUICKSTART_SPEC.tie_word_embeddings,
)


def evict(directory: Path) -> None:
    """Drop ``directory``'s files from the page cache (clean pages only: they are fsynced)."""
    for folder, _, files in os.walk(directory):
        for name in files:
            descriptor = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


def best_seconds(run: Callable[[], None], repeats: int, before: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(shape: ModelShape, work_dir: Path, repeats: int) -> dict:
    from parallel.checkpoint import load_checkpoint, save_checkpoint
    from parallel.mesh import destroy_parallel, init_parallel
    from parallel.step_types import MicroBatch
    from rlcli.run.checkpoints import CheckpointManager

    model_dir = ensure_model(shape, work_dir / "models", "float32")
    mesh = init_parallel(tp=1, pp=1, seed=SEED)
    actor = megatron_actor(mesh, model_dir, "float32", micro_batch_size=2, steps=1)
    ids = random_token_ids(2, 32, shape.vocab_size, SEED)
    actor.train_step(MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids)), nll_loss)
    manager = CheckpointManager(work_dir / "checkpoints" / shape.name, keep_last=1)
    step = [0]

    def save() -> None:
        step[0] += 1
        with manager.saving(step[0], subdirs=("model",)) as directory:
            save_checkpoint(directory / "model", actor.models, mesh, actor.optimizer)

    save_s = best_seconds(save, repeats, lambda: None)
    folder = manager.latest_dir()
    assert folder is not None

    def check() -> None:
        health = manager.check(folder)
        assert health.state == "intact", health.describe()

    def load() -> None:
        load_checkpoint(folder / "model", actor.models, mesh, actor.optimizer)

    def resume() -> None:
        check()
        load()

    result = {
        "model": shape.name,
        "params": sum(p.numel() for p in actor.models[0].parameters()),
        "checkpoint_mb": manager.check(folder).bytes / 1e6,
        "save_s": save_s,
    }
    for cache, before in (("warm", lambda: None), ("evicted", lambda: evict(folder))):
        for name, run in (("check", check), ("load", load), ("resume", resume)):
            result[f"{name}_{cache}_s"] = best_seconds(run, repeats, before)
        result[f"overhead_{cache}"] = result[f"resume_{cache}_s"] / result[f"load_{cache}_s"] - 1
    destroy_parallel()
    return result


def main(
    work_dir: Path = typer.Option(Path("/tmp/rlcli-checkpoint-check"), "--work-dir"),
    repeats: int = typer.Option(5, "--repeats"),
) -> None:
    for shape in (QUICKSTART, CPU_25M):
        print(json.dumps(measure(shape, work_dir, repeats)), flush=True)


if __name__ == "__main__":
    typer.run(main)
