"""``rlcli plan RECIPE [overrides] --nodes N --gpus-per-node G``: per-GPU memory of the recipe's
layout, phase by phase, before any allocation is spent finding out (formulas and their sources:
``parallel.memory_plan``). Exit code 0 when the layout fits, 1 when it does not (the output names
the smallest change that fits), 2 for bad input.

Mounted by rlcli.cli as ``app.command("plan")(plan_command)``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from rlcli.errors import UserError

GB = 1024**3


def _model_shape(cfg, model_config: Optional[Path]):
    """(shape, where it came from): --model-config, the recipe's config.json, model.build's spec,
    or the table of known shapes keyed by model.path's basename."""
    from parallel.model_shapes import KNOWN_SHAPES, ModelShape, known_shape

    candidates = [model_config] if model_config else []
    if cfg.model.path:
        candidates.append(Path(cfg.model.path))
    for path in candidates:
        file = path / "config.json" if path.is_dir() else path
        if file.is_file():
            try:
                return ModelShape.from_hf_config(json.loads(file.read_text())), str(file)
            except (KeyError, ValueError) as err:
                raise UserError(f"{file}: not an HF model config ({err})") from None
        if path is model_config:
            raise UserError(f"--model-config {path}: no such config.json")
    if cfg.model.build:
        spec = cfg.model.spec
        shape = ModelShape(
            spec.hidden_size,
            spec.num_layers,
            spec.num_heads,
            spec.num_kv_heads,
            spec.hidden_size // spec.num_heads,
            spec.intermediate_size,
            spec.vocab_size,
            spec.tie_word_embeddings,
            spec.architecture == "qwen2",
        )
        return shape, "model.spec (built locally)"
    shape = known_shape(cfg.model.path)
    if shape is None:
        raise UserError(
            f"model shape unknown: {cfg.model.path}/config.json does not exist and "
            f"'{Path(cfg.model.path).name}' is not a known shape ({', '.join(KNOWN_SHAPES)}); "
            "pass --model-config path/to/config.json"
        )
    return shape, f"known shape for '{Path(cfg.model.path).name}'"


def build_plan_inputs(cfg, shape, *, world_size: int, gpu_memory_gb: float, flash_attention: bool):
    """parallel.memory_plan's inputs for a validated RLConfig on `world_size` GPUs."""
    from parallel.memory_plan import PlanInputs, RolloutEngine
    from parallel.memory_terms import TrainedModel
    from parallel.reshard import AUTO_BUCKET_MB
    from rlcli.batch import mini_batch_count
    from rlcli.config_validation import derive_dp, uses_critic, validate
    from rlcli.lora import lora_spec

    validate(cfg, world_size=world_size)
    par = cfg.parallel
    dp = derive_dp(par, world_size)
    if shape.kv_heads % par.tp:
        raise UserError(
            f"parallel.tp={par.tp} must divide the model's {shape.kv_heads} key/value heads"
        )
    if shape.layers % (par.pp * (par.vpp or 1)):
        raise UserError(
            f"{shape.layers} layers cannot be split over parallel.pp * parallel.vpp = "
            f"{par.pp * (par.vpp or 1)} stages"
        )
    seq_len = cfg.data.max_prompt_length + cfg.rollout.max_tokens
    sequences = cfg.data.train_batch_size * cfg.rollout.n

    lora = lora_spec(cfg.actor.lora, cfg.trainer.seed)

    def trained(section, critic: bool = False) -> TrainedModel:
        """The memory terms of the model an ``actor`` / ``critic`` section trains: the run's
        layout, the section's micro-batches per optimizer step, recomputation and offloading
        (the actor's LoRA adapters: only they have gradients and optimizer state)."""
        adapters = lora if not critic else None
        prompts = cfg.data.train_batch_size
        mini = prompts // mini_batch_count(prompts, section.ppo_mini_batch_size) * cfg.rollout.n
        return TrainedModel(
            shape,
            dtype=cfg.model.dtype,
            tp=par.tp,
            pp=par.pp,
            vpp=par.vpp,
            dp=dp,
            distributed_optimizer=par.use_distributed_optimizer,
            micro_batch_size=section.micro_batch_size,
            seq_len=seq_len,
            num_micro_batches=max(1, mini // dp // section.micro_batch_size),
            recompute=section.recompute,
            recompute_method=section.recompute_method,
            recompute_num_layers=section.recompute_num_layers,
            sequence_parallel=par.sequence_parallel,
            flash_attention=flash_attention,
            offload_params=section.offload_params,
            offload_grads=section.offload_grads,
            offload_optimizer=section.offload_optimizer,
            critic=critic,
            lora_rank=adapters.rank if adapters is not None else 0,
            lora_target_modules=adapters.targets() if adapters is not None else (),
        )

    actor = trained(cfg.actor)
    engines = world_size // cfg.rollout.tp
    rollout = RolloutEngine(
        tp=cfg.rollout.tp,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        max_model_len=cfg.rollout.max_model_len or seq_len,
        sequences=-(-sequences // engines),
        dtype=cfg.model.dtype,
        sync_bucket_bytes=(cfg.rollout.sync_bucket_mb or AUTO_BUCKET_MB) * 1024**2,
    )
    critic = trained(cfg.critic, critic=True) if uses_critic(cfg) else None
    return PlanInputs(
        actor=actor,
        rollout=rollout,
        gpu_memory_bytes=int(gpu_memory_gb * GB),
        # a LoRA actor's reference is the actor itself, adapters off: no weights of its own
        ref=(cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and lora is None,
        ref_offload=cfg.ref.offload,
        critic=critic,
    )


def _candidates(cfg, shape, gpus_per_node: int, world_size: int, plan) -> list[list[str]]:
    """Single changes, cheapest first: offload, distributed optimizer, recompute, smaller
    micro-batches, less vLLM memory, more TP, more PP."""
    a, par = cfg.actor, cfg.parallel
    # Each trained model has its own offload keys (PPO: the critic's too).
    trained = ["actor", "critic"] if plan.inputs.critic is not None else ["actor"]
    state = [f"{m}.offload_{kind}=true" for m in trained for kind in ("grads", "optimizer")]
    out = []
    if not (a.offload_grads and a.offload_optimizer):
        out.append(state)
    if not (a.offload_params and cfg.ref.offload):
        out.append([f"{m}.offload_params=true" for m in trained] + state + ["ref.offload=true"])
    if not par.use_distributed_optimizer and world_size // (par.tp * par.pp) > 1:
        out.append(["parallel.use_distributed_optimizer=true"])
    for mode in ("selective", "full"):
        if a.recompute != mode and not (mode == "selective" and a.recompute == "full"):
            out.append([f"actor.recompute={mode}"])
    mbs = a.micro_batch_size // 2
    while mbs >= 1:
        out.append([f"actor.micro_batch_size={mbs}"])
        mbs //= 2
    generate = plan.phases["generate"]
    others = generate.total - generate.terms.get("vLLM (gpu_memory_utilization)", 0)
    util = int((plan.inputs.gpu_memory_bytes - others) / plan.inputs.gpu_memory_bytes * 20) / 20
    if 0 < util < cfg.rollout.gpu_memory_utilization:
        out.append([f"rollout.gpu_memory_utilization={util:.2f}"])
    tp = par.tp * 2
    while tp <= gpus_per_node and shape.kv_heads % tp == 0 and world_size % (tp * par.pp) == 0:
        out.append([f"parallel.tp={tp}"])
        tp *= 2
    pp = par.pp * 2
    while world_size % (par.tp * pp) == 0 and shape.layers % (pp * (par.vpp or 1)) == 0:
        out.append([f"parallel.pp={pp}"])
        pp *= 2
    return out


def _gib(n: int) -> str:
    return f"{n / GB:8.2f}"


def _table(plan, plan_offloaded) -> list[str]:
    from parallel.memory_plan import PHASES

    rows = []
    for phase in PHASES:
        rows += [t for t in plan.phases[phase].terms if t not in rows]
    head = f"{'per GPU, GiB':34}" + "".join(f"{p:>11}" for p in PHASES)
    lines = [head, "-" * len(head)]
    for term in rows:
        cells = "".join(f"{_gib(plan.phases[p].terms.get(term, 0)):>11}" for p in PHASES)
        lines.append(f"{term:34}{cells}")
    lines.append("-" * len(head))
    lines.append(f"{'total':34}" + "".join(f"{_gib(plan.phases[p].total):>11}" for p in PHASES))
    lines.append(
        f"{'total, everything offloaded':34}"
        + "".join(f"{_gib(plan_offloaded.phases[p].total):>11}" for p in PHASES)
    )
    return lines


def plan_command(
    recipe: Path = typer.Argument(..., help="Recipe YAML, e.g. recipes/grpo_qwen7b.yaml"),
    overrides: Optional[list[str]] = typer.Argument(None, help="Dot-list overrides"),
    nodes: int = typer.Option(1, "--nodes", help="Nodes in the job."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node."),
    gpu_memory_gb: float = typer.Option(80.0, "--gpu-memory-gb", help="Memory per GPU (GiB)."),
    model_config: Optional[Path] = typer.Option(
        None,
        "--model-config",
        help="HF config.json giving the model shape (default: the recipe's).",
    ),
    flash_attention: bool = typer.Option(
        True,
        "--flash-attention/--no-flash-attention",
        help="Attention without an s x s score tensor (Transformer Engine installed).",
    ),
) -> None:
    """Per-GPU memory of each phase (generate, log-probs, update, sync): does the layout fit?"""

    from parallel.memory_plan import plan_memory
    from rlcli.config_loader import load_config

    if nodes < 1 or gpus_per_node < 1 or gpu_memory_gb <= 0:
        raise UserError("--nodes, --gpus-per-node and --gpu-memory-gb must be positive")
    world = nodes * gpus_per_node
    cfg = load_config(recipe, overrides or [])
    shape, source = _model_shape(cfg, model_config)

    def plan_for(extra: list[str]):
        c = load_config(recipe, [*(overrides or []), *extra]) if extra else cfg
        inputs = build_plan_inputs(
            c, shape, world_size=world, gpu_memory_gb=gpu_memory_gb, flash_attention=flash_attention
        )
        return plan_memory(inputs)

    plan = plan_for([])
    actor = plan.inputs.actor
    offloaded = dict(offload_params=True, offload_grads=True, offload_optimizer=True)
    critic = plan.inputs.critic
    everything = dataclasses.replace(
        plan.inputs,
        actor=dataclasses.replace(actor, **offloaded),
        critic=dataclasses.replace(critic, **offloaded) if critic is not None else None,
        ref_offload=True,
    )
    echo = typer.echo
    echo(
        f"rlcli plan: {recipe} on {nodes} node(s) x {gpus_per_node} GPUs, {gpu_memory_gb:g} GiB each"
    )
    echo(
        f"model: {source}: {actor.params / 1e9:.3f} B params on the busiest rank, "
        f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads"
    )
    echo(
        f"layout: tp={actor.tp} pp={actor.pp} dp={actor.dp} {actor.dtype}, distributed optimizer "
        f"{'on' if actor.distributed_optimizer else 'off'}, recompute {actor.recompute}, "
        f"micro-batch {actor.micro_batch_size} x {actor.seq_len} tokens; vLLM tp={cfg.rollout.tp}"
    )
    echo("")
    c = plan.components
    echo(
        f"optimizer state: {c['actor optimizer (distributed)'] / GB:.2f} GiB distributed, "
        f"{c['actor optimizer (not distributed)'] / GB:.2f} GiB not distributed"
    )
    for line in _table(plan, plan_memory(everything)):
        echo(line)
    echo("")
    per_seq = plan.kv_cache_needed / max(plan.inputs.rollout.sequences, 1)
    held = int(plan.kv_cache // per_seq) if per_seq else 0
    if plan.kv_cache <= 0:
        echo(
            "vLLM KV cache: NONE (its weights fill rollout.gpu_memory_utilization): vLLM won't start"
        )
    else:
        echo(
            f"vLLM KV cache {plan.kv_cache / GB:.2f} GiB: {held} sequences of "
            f"{plan.inputs.rollout.max_model_len} tokens at once "
            f"(asked for {plan.inputs.rollout.sequences} per engine"
            + ("" if held >= plan.inputs.rollout.sequences else ": vLLM will queue the rest")
            + ")"
        )
    if actor.lora_rank:
        _lora_gains(plan, plan_for, cfg, echo)
    verdict = "fits" if plan.fits else "does NOT fit"
    echo(
        f"peak: {plan.peak_phase} at {plan.peak / GB:.2f} GiB of {gpu_memory_gb:g} GiB -> {verdict}"
    )
    if plan.fits:
        return
    _recommend(plan, plan_for, cfg, shape, gpus_per_node, world, echo)
    # not typer.Exit: the CLI runs click with standalone_mode=False, which returns its code
    sys.exit(1)


def _lora_gains(plan, plan_for, cfg, echo) -> None:
    """A LoRA actor against full fine-tuning of the same recipe: the memory the adapters free
    (no base gradients, Adam moments, master weights or reference), and the smaller TP and the
    larger micro-batch that fit thanks to it."""
    actor = plan.inputs.actor
    full = plan_for(["actor.lora.enable=false", "rollout.lora_sync=merged"])
    echo(
        f"LoRA rank {actor.lora_rank} on {', '.join(actor.lora_target_modules)}: "
        f"{actor.lora_params / 1e6:.1f} M trainable params per GPU "
        f"({actor.lora_params / actor.params:.2%} of the base's {actor.params / 1e9:.2f} B); "
        "the reference is the actor with its adapters off (no weights of its own)"
    )
    echo(
        "  vs full fine-tuning: "
        + ", ".join(
            f"{phase} {full.phases[phase].total / GB:.2f} -> {plan.phases[phase].total / GB:.2f}"
            for phase in plan.phases
        )
        + f" GiB; peak {full.peak / GB:.2f} -> {plan.peak / GB:.2f} GiB "
        f"({(full.peak - plan.peak) / GB:.2f} GiB freed per GPU)"
    )
    full_ft = ["actor.lora.enable=false", "rollout.lora_sync=merged"]
    smaller_tp = [f"parallel.tp={tp}" for tp in (2**k for k in range(8)) if tp < cfg.parallel.tp]
    larger_mbs = [f"actor.micro_batch_size={cfg.actor.micro_batch_size * 2**k}" for k in (1, 2, 3)]
    gains = []
    for change in [*reversed(smaller_tp), *larger_mbs]:
        try:
            with_lora, without = plan_for([change]), plan_for([*full_ft, change])
        except UserError:  # a layout the model or the batch cannot take
            continue
        if with_lora.fits:
            verdict = "fits" if without.fits else "does NOT fit"
            gains.append(
                f"{change}: peak {with_lora.peak / GB:.2f} GiB (full fine-tuning "
                f"{without.peak / GB:.2f} GiB, {verdict})"
            )
    if gains:
        echo("  with LoRA these fit too:")
        for line in gains:
            echo(f"    {line}")


def _recommend(plan, plan_for, cfg, shape, gpus_per_node, world, echo) -> None:
    candidates = _candidates(cfg, shape, gpus_per_node, world, plan)
    fitting = []
    for change in candidates:
        try:
            p = plan_for(change)
        except UserError:
            continue
        if p.fits:
            fitting.append((change, p))
    if fitting:
        change, p = fitting[0]
        echo(f"smallest change that fits: {' '.join(change)} (peak {p.peak / GB:.2f} GiB)")
        others = [" ".join(ch) for ch, _ in fitting[1:4]]
        if others:
            echo(f"other single changes that fit: {'; '.join(others)}")
        return
    chosen: list[str] = []
    best = plan
    for change in candidates:  # greedily combine the changes that lower the peak
        try:
            p = plan_for([*chosen, *change])
        except UserError:
            continue
        if p.peak < best.peak and p.kv_cache > 0:
            chosen, best = [*chosen, *change], p
            if p.fits:
                echo(
                    f"no single change fits; together: {' '.join(chosen)} (peak {p.peak / GB:.2f} GiB)"
                )
                return
    echo(
        f"no combination of offload, recompute, micro-batch, TP and PP fits (best peak "
        f"{best.peak / GB:.2f} GiB with {' '.join(chosen) or 'no change'}): use more GPUs "
        "(--nodes) or GPUs with more memory"
    )
