"""``rlcli eval RECIPE [overrides] [--model DIR]``: the held-out metrics of a model folder, as a
run of the recipe would measure them before RL (``trainer.val_before_train``): the recipe's
rollout engine answers its held-out prompts (``data.val_files``, or the synthetic task's) at
``rollout.val_temperature``, ``rollout.val_n`` samples each, and its reward scores them.

For a model the run does not train: a distillation teacher, a checkpoint exported with
``rlcli export``, a Hub model; the same command before and after training compares the two on
one footing. Nothing is trained and no Megatron model is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rlcli.commands.train import NPROC, OVERRIDES, RECIPE, _load_for_run
from rlcli.errors import UserError

MODEL = typer.Option(
    None,
    "--model",
    help="HF model folder to evaluate (sets model.path, and model.tokenizer_path unless given); "
    "default: the recipe's model.path.",
)


def eval_command(
    recipe: Path = RECIPE,
    overrides: Optional[list[str]] = OVERRIDES,
    model: Optional[Path] = MODEL,
    nproc: int = NPROC,
):
    """Held-out accuracy of a model folder with the recipe's engine, data and reward."""
    extra = [] if model is None else [f"model.path={model}", "model.build=false"]
    cfg = _load_for_run(recipe, [*(overrides or []), *extra], nproc)
    from rlcli.console import say
    from rlcli.train.build import check_multi_turn
    from rlcli.train.build_rollouts import build_rewards, build_sampler
    from rlcli.train.inputs import prepare_inputs

    inputs = prepare_inputs(cfg)
    if not inputs.val_data:
        raise UserError(
            "rlcli eval: the recipe has no held-out prompts: set data.val_files (or "
            "data.synthetic, whose task has them)"
        )
    say(inputs.mesh, f"evaluating {inputs.model_dir} on the {cfg.rollout.engine} engine")
    sampler = build_sampler(inputs, build_rewards(cfg), check_multi_turn(inputs), read_weights=True)
    try:
        metrics = sampler.evaluate(inputs.val_data, step=0)
    finally:
        sampler.close()
    for key in sorted(metrics):
        if key.startswith("val/"):
            say(inputs.mesh, f"{key} {metrics[key]:.4g}")
    accuracy = metrics.get("val/reward/accuracy")
    if accuracy is not None:
        say(
            inputs.mesh,
            f"held-out accuracy {accuracy:.3f} on {int(metrics['val/num_prompts'])} prompts "
            f"({inputs.model_dir}, {metrics['timing/val']:.1f} s)",
        )
