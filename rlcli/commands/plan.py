"""``rlcli plan RECIPE [overrides] --nodes N --gpus-per-node G``: per-GPU memory of the recipe's
layout, phase by phase, before any allocation is spent finding out (formulas and their sources:
``parallel.memory_plan``). With ``rollout.placement=separate`` it plans both kinds of GPU: the
trainer's (no engine) phase by phase, and the rollout ranks' (only the engine). Exit code 0 when the layout fits, 1 when it does not (the output names
the smallest change that fits), 2 for bad input.

Mounted by rlcli.cli as ``app.command("plan")(plan_command)``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Optional

import typer

from rlcli.commands.plan_inputs import GB, build_plan_inputs, model_shape
from rlcli.errors import UserError


def _candidates(cfg, shape, gpus_per_node: int, world_size: int, plan) -> list[list[str]]:
    """Single changes, cheapest first: offload, distributed optimizer, recompute, smaller
    micro-batches, less vLLM memory, more EP (MoE), more TP, more PP."""
    from rlcli.validation.placement import trainer_ranks

    a, par = cfg.actor, cfg.parallel
    world_size = trainer_ranks(cfg, world_size)  # the ranks TP x PP x DP lay out
    # Each trained model has its own offload keys (PPO: the critic's too); the actor's make room
    # for a colocated engine only.
    trained = ["actor", "critic"] if plan.inputs.critic is not None else ["actor"]
    if plan.inputs.separate:
        trained = [m for m in trained if m != "actor"]
    state = [f"{m}.offload_{kind}=true" for m in trained for kind in ("grads", "optimizer")]
    out = []
    if trained and not (a.offload_grads and a.offload_optimizer):
        out.append(state)
    if not (a.offload_params and cfg.ref.offload):
        everything = [f"{m}.offload_params=true" for m in trained] + state + ["ref.offload=true"]
        if plan.inputs.reward_model is not None:
            everything.append("reward.model.offload=true")
        out.append(everything)
    if not par.use_distributed_optimizer and world_size // (par.tp * par.pp) > 1:
        out.append(["parallel.use_distributed_optimizer=true"])
    for mode in ("selective", "full"):
        if a.recompute != mode and not (mode == "selective" and a.recompute == "full"):
            out.append([f"actor.recompute={mode}"])
    mbs = a.micro_batch_size // 2
    while mbs >= 1:
        out.append([f"actor.micro_batch_size={mbs}"])
        mbs //= 2
    generate = plan.rollout_rank or plan.phases["generate"]
    others = generate.total - generate.terms.get("vLLM (gpu_memory_utilization)", 0)
    util = int((plan.inputs.gpu_memory_bytes - others) / plan.inputs.gpu_memory_bytes * 20) / 20
    if 0 < util < cfg.rollout.gpu_memory_utilization:
        out.append([f"rollout.gpu_memory_utilization={util:.2f}"])
    ep = par.ep * 2  # MoE: spread the experts further
    while shape.is_moe and shape.experts % ep == 0:
        if (world_size // par.pp) % (ep * (par.expert_tp or par.tp)):
            break
        out.append([f"parallel.ep={ep}"])
        ep *= 2
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
    phases = list(plan.phases)  # the "reward" phase only with a reward model or a judge
    rows = []
    for phase in phases:
        rows += [t for t in plan.phases[phase].terms if t not in rows]
    head = f"{'per GPU, GiB':34}" + "".join(f"{p:>11}" for p in phases)
    lines = [head, "-" * len(head)]
    for term in rows:
        cells = "".join(f"{_gib(plan.phases[p].terms.get(term, 0)):>11}" for p in phases)
        lines.append(f"{term:34}{cells}")
    lines.append("-" * len(head))
    lines.append(f"{'total':34}" + "".join(f"{_gib(plan.phases[p].total):>11}" for p in phases))
    if plan_offloaded is not None:  # (separate engines: the actor has nothing to offload for)
        lines.append(
            f"{'total, everything offloaded':34}"
            + "".join(f"{_gib(plan_offloaded.phases[p].total):>11}" for p in phases)
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
) -> None:
    """Per-GPU memory of each phase (generate, reward, log-probs, update, sync): does the
    layout fit?"""

    from parallel.memory_plan import plan_memory
    from rlcli.validation.loader import load_config

    if nodes < 1 or gpus_per_node < 1 or gpu_memory_gb <= 0:
        raise UserError("--nodes, --gpus-per-node and --gpu-memory-gb must be positive")
    world = nodes * gpus_per_node
    cfg = load_config(recipe, overrides or [])
    shape, source = model_shape(cfg, model_config)

    def plan_for(extra: list[str]):
        c = load_config(recipe, [*(overrides or []), *extra]) if extra else cfg
        inputs = build_plan_inputs(c, shape, world_size=world, gpu_memory_gb=gpu_memory_gb)
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
        reward_model_offload=True,
    )
    echo = typer.echo
    echo(
        f"rlcli plan: {recipe} on {nodes} node(s) x {gpus_per_node} GPUs, {gpu_memory_gb:g} GiB each"
    )
    echo(
        f"model: {source}: {actor.params / 1e9:.3f} B params on the busiest rank, "
        f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads"
    )
    if shape.vision is not None:
        trained = "trained" if actor.train_vision_tower else "frozen: no gradient, no optimizer"
        echo(
            f"vision tower: {shape.vision.params / 1e9:.3f} B params ({shape.vision.depth} "
            f"blocks, width {shape.vision.hidden}), whole on the first stage of every TP rank, "
            f"{trained}; image tokens are prompt tokens (data.max_prompt_length)"
        )
    if shape.is_moe:
        echo(
            f"experts: {shape.experts} per MoE layer, top-{shape.topk}, ep={actor.ep} "
            f"expert_tp={actor.etp or actor.tp} (expert dp={actor.expert_dp}): "
            f"{actor.expert_params / 1e9:.3f} B expert params on the busiest rank"
        )
    echo(
        f"layout: tp={actor.tp} pp={actor.pp} dp={actor.dp} {actor.dtype}, distributed optimizer "
        f"{'on' if actor.distributed_optimizer else 'off'}, recompute {actor.recompute}, "
        f"micro-batch {actor.micro_batch_size} x {actor.seq_len} tokens"
        f"{' (packed)' if cfg.actor.pack_sequences else ''}, attention {actor.attention}; "
        f"vLLM tp={cfg.rollout.tp}"
    )
    echo("")
    c = plan.components
    echo(
        f"optimizer state: {c['actor optimizer (distributed)'] / GB:.2f} GiB distributed, "
        f"{c['actor optimizer (not distributed)'] / GB:.2f} GiB not distributed"
    )
    if plan.inputs.separate:
        r = cfg.rollout
        echo(
            f"rollout.placement=separate: {world - r.num_ranks} trainer GPUs (the table: no "
            f"engine; 'generate' is their wait for samples), {r.num_ranks} rollout GPUs "
            f"({r.num_ranks // r.tp} engines of rollout.tp={r.tp})"
        )
    for line in _table(plan, None if plan.inputs.separate else plan_memory(everything)):
        echo(line)
    if plan.rollout_rank is not None:
        terms = ", ".join(f"{k} {v / GB:.2f}" for k, v in plan.rollout_rank.terms.items())
        echo(f"{'rollout GPU':34}{_gib(plan.rollout_rank.total):>11}   ({terms} GiB)")
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
    rollout_peak = (
        f", rollout GPUs at {plan.rollout_rank.total / GB:.2f} GiB" if plan.rollout_rank else ""
    )
    echo(
        f"peak: {plan.peak_phase} at {plan.peak / GB:.2f} GiB{rollout_peak} of "
        f"{gpu_memory_gb:g} GiB -> {verdict}"
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
