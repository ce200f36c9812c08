"""``rlcli train`` / ``rlcli sft``: set up, (warm start,) loop over ``rl_step``, validate, save."""

from __future__ import annotations

import shutil
from pathlib import Path

import algorithms
from rlcli import components as comp
from rlcli.checkpointing import CheckpointManager, load_trainer_state, save_trainer_state
from rlcli.config import RLConfig
from rlcli.data import PromptLoader
from rlcli.trainer import Run, rl_step, sync_weights, validate


def say(c: comp.Components, message: str) -> None:
    if c.mesh.rank == 0:
        print(f"[rlcli] {message}", flush=True)


def run_sft_only(cfg: RLConfig) -> Path:
    c = comp.prepare_inputs(cfg)
    return warm_start(c, force=True)


def warm_start(c: comp.Components, force: bool = False) -> Path:
    """SFT into ``<output_dir>/sft_model`` unless it is already there; RL starts from it."""
    from rlcli.sft import sft_warm_start

    out = c.output_dir / "sft_model"
    if (out / "config.json").exists() and not force:
        say(c, f"warm start: reusing {out}")
        return out
    files = list(c.cfg.sft.train_files) or c.sft_files
    say(c, f"warm start: {c.cfg.sft.steps} SFT steps on {', '.join(files)}")
    tmp = c.output_dir / "sft_model.tmp"
    if c.mesh.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    comp.barrier()
    sft_warm_start(c, files, tmp, log=lambda m: say(c, m))
    if c.mesh.rank == 0:
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # a crash mid-save leaves only sft_model.tmp, never a partial sft_model
    comp.barrier()
    return out


def run_training(cfg: RLConfig) -> dict[str, float]:
    rewards = comp.build_rewards(cfg)  # first: a reward spec that does not import fails at once
    c = comp.prepare_inputs(cfg)
    if cfg.sft.steps > 0:
        c.model_dir = str(warm_start(c))
    loader = PromptLoader(
        c.train_data, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.trainer.seed
    )
    total = cfg.trainer.total_steps or cfg.trainer.total_epochs * loader.batches_per_epoch
    say(c, f"building actor (tp={c.mesh.tp} pp={c.mesh.pp} dp={c.mesh.dp}) from {c.model_dir}")
    actor = comp.build_actor(c, total_steps=total)
    ref = None
    if comp.needs_reference(cfg):
        from rlcli.policy import MegatronPolicy

        ref = MegatronPolicy(c.mesh, c.model_dir, cfg.model.dtype)
        if cfg.ref.offload:
            ref.offload()
    say(c, f"starting the {cfg.rollout.engine} engine (rollout.tp={cfg.rollout.tp})")
    engine, replica = comp.build_engine(c)
    kl = cfg.algorithm.kl_ctrl
    run = Run(
        c=c,
        actor=actor,
        ref=ref,
        engine=engine,
        replica=replica,
        rewards=rewards,
        loader=loader,
        kl_ctrl=algorithms.get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon),
        total_steps=total,
    )
    ckpt = CheckpointManager(comp.checkpoint_root(cfg), keep_last=cfg.checkpoint.keep_last)
    resumed = resume(run, ckpt)
    logger = comp.build_logger(c, total, resumed)
    try:
        return _loop(run, ckpt, logger, resumed)
    finally:
        logger.close()
        run.rewards.close()
        engine.close()


def _loop(run: Run, ckpt: CheckpointManager, logger, resumed: int | None) -> dict[str, float]:
    cfg, c = run.cfg, run.c
    before: dict[str, float] = {}
    if resumed is not None:
        sync_weights(run)  # the engine started from the HF weights, not the checkpoint's
        say(c, f"resumed from step {resumed}")
    elif cfg.trainer.val_before_train:
        before = validate(run)
        logger.log(0, before)
        say(
            c,
            f"validation before RL: accuracy {before.get('val/reward/accuracy', float('nan')):.3f}",
        )
    after: dict[str, float] = {}
    while run.step < run.total_steps:
        run.step += 1
        metrics = rl_step(run)
        metrics.update({"data/epoch": run.loader.epoch, "data/position": run.loader.position})
        last = run.step == run.total_steps
        if (cfg.trainer.val_freq and run.step % cfg.trainer.val_freq == 0) or last:
            after = validate(run)
            metrics.update(after)
        logger.log(run.step, metrics)
        if (cfg.checkpoint.save_freq and run.step % cfg.checkpoint.save_freq == 0) or last:
            save(run, ckpt)
    if before and after:
        say(
            c,
            "held-out accuracy before RL {:.3f} -> after {:.3f} ({} steps)".format(
                before["val/reward/accuracy"], after["val/reward/accuracy"], run.step
            ),
        )
    return {**{f"before/{k}": v for k, v in before.items()}, **after}


def save(run: Run, ckpt: CheckpointManager) -> None:
    from parallel.checkpoint import save_checkpoint

    with ckpt.saving(run.step, subdirs=("model",)) as directory:
        save_checkpoint(
            directory / "model",
            run.actor.models,
            run.c.mesh,
            optimizer=run.actor.optimizer if run.cfg.checkpoint.save_optimizer else None,
            scheduler=run.actor.scheduler,
        )
        if run.c.mesh.rank == 0:  # config + tokenizer: the checkpoint converts to HF on its own
            copy_hf_metadata(run.c.model_dir, directory / "hf")
        save_trainer_state(
            directory,
            {
                "step": run.step,
                "loader": run.loader.state_dict(),
                "kl_coef": float(run.kl_ctrl.value),
                "model_dir": run.c.model_dir,
            },
        )


def copy_hf_metadata(model_dir: str, out: Path) -> None:
    from parallel.convert.hf_io import copy_tokenizer_files

    copy_tokenizer_files(model_dir, out)
    for name in ("config.json", "generation_config.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy2(Path(model_dir) / name, out / name)


def resume(run: Run, ckpt: CheckpointManager) -> int | None:
    from parallel.checkpoint import load_checkpoint

    path = ckpt.resolve_resume(run.cfg.trainer.resume)
    if path is None:
        return None
    state = load_trainer_state(path)
    load_checkpoint(
        path / "model",
        run.actor.models,
        run.c.mesh,
        optimizer=run.actor.optimizer if run.cfg.checkpoint.save_optimizer else None,
        scheduler=run.actor.scheduler,
    )
    run.loader.load_state_dict(state["loader"])
    run.kl_ctrl.value = state["kl_coef"]
    run.step = int(state["step"])
    return run.step
