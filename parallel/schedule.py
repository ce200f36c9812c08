"""The one forward/backward entry point the trainer uses, on megatron-core's pipeline schedules.

``forward_backward`` runs a list of micro-batches through megatron-core's
``get_forward_backward_func`` (no pipelining, 1F1B, or interleaved 1F1B for virtual pipeline
stages). On the last pipeline stage it turns the model output into

* ``log_probs [mb, S-1]``: ``log softmax(logits[:, :-1] / temperature)`` at the next token
  ``input_ids[:, 1:]``, computed vocab-parallel (``parallel.logprobs``), plus ``entropy
  [mb, S-1]`` when asked, for policy models;
* ``values [mb, S]`` for critic models (``build_model(..., critic=True)``),

and hands them to ``loss_fn(outputs, micro_batch) -> (loss, report)`` (``ModelOutputs`` in,
``LossReport`` out; ``parallel.step_types``).

Gradient semantics (exact): after ``forward_backward(..., forward_only=False)`` each rank's
gradient equals the gradient of the SUM over its micro-batches of ``loss_fn``'s loss.
Megatron divides every micro-batch loss by the number of micro-batches; the loss handed to
megatron is multiplied by that number first, so the two cancel. Over data parallelism,
megatron's DDP (``parallel.optim.wrap_for_training``) then AVERAGES the gradients of the DP
replicas (it scales by 1/dp before its sum all-reduce). So a trainer that wants the mean of a
per-sample loss over a global batch of N samples should divide each micro-batch's summed loss
by N / dp (the per-rank share of N), or equivalently use per-micro-batch means scaled by
mb * dp / N.

Micro-batches are ``parallel.step_types.MicroBatch`` es: ``input_ids [mb, S]`` (int64,
right-padded so plain causal attention is correct), ``attention_mask [mb, S]`` (1 on real
tokens), optional ``position_ids [mb, S]`` (default ``arange(S)``), and whatever further fields
a subclass declares for ``loss_fn`` (handed to it untouched, on ``device()``).
Without pipeline parallelism every micro-batch runs at its own ``S`` (``parallel.micro_batches`` trims
each to its longest row, and a token budget groups rows of similar length), so padding costs
little. Pipeline point-to-point communication needs one ``[S, mb, hidden]`` shape for the whole
call: there shorter micro-batches are right-padded to the longest ``S`` for the model and the
outputs are cut back to each micro-batch's own length before ``loss_fn`` sees them, and all
micro-batches must have the same ``mb``. Under sequence parallelism ``S`` is rounded up to a
multiple of tp.

Packed sequences (``pack_sequences=True``; attention "sdpa" or "te"): each micro-batch runs as
ONE row of its rows' real tokens end to end (megatron-core's THD layout, ``parallel.model_inputs``),
so no padded token is computed, and its outputs are unpacked back into the per-row layout above
before ``loss_fn`` sees them (0 past each row's length): the same ``[mb, S-1]`` / ``[mb, S]``
tensors as the padded path, equal on every real position up to kernel rounding. Micro-batch
sizes may then differ under pipeline parallelism too: the packed rows are padded to the call's
longest (the padding attends only to itself). ``parallel.micro_batches(pack=True)`` fills each
micro-batch up to a token budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from parallel.cpu_compat import device
from parallel.logprobs import (
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
    vocab_parallel_top_ids,
)
from parallel.mesh import Mesh
from parallel.model_inputs import PackedRows, packed_inputs, padded_inputs
from parallel.routing_replay import attach_routing, routing_pass
from parallel.step_types import LossFn, LossReport, MicroBatch, MicroBatchResult, ModelOutputs


@dataclass(frozen=True)
class OutputRequest:
    """What the last stage computes from a policy model's logits besides the log-probs."""

    temperature: float = 1.0  # divides the logits first
    entropy: bool = False  # ModelOutputs.entropy
    top_k: int = 0  # > 0: ModelOutputs.top_log_probs / top_ids (forward-only passes)


def forward_backward(
    models: list[torch.nn.Module],
    mesh: Mesh,
    micro_batches: list[MicroBatch],
    loss_fn: LossFn | None,
    *,
    forward_only: bool,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    top_k: int = 0,
    pack_sequences: bool = False,
    record_routing: bool = False,
) -> list[MicroBatchResult]:
    """Forward (and backward unless ``forward_only``) over ``micro_batches``; see module doc.

    Args:
        models: the model chunks of this rank (one per virtual pipeline stage), bare or
            wrapped in megatron DDP. Gradient reduction over DP happens inside megatron when
            the config carries ``finalize_model_grads_func`` (set by ``wrap_for_training``).
        mesh: the parallel layout from ``parallel.mesh.init_parallel``.
        micro_batches: as described in the module docstring.
        loss_fn: ``(outputs, micro_batch) -> (scalar loss, LossReport)``; ``outputs`` (a
            ``ModelOutputs``) holds ``log_probs`` (and ``entropy``) ``[mb, S-1]`` or ``values
            [mb, S]``. May be ``None`` when ``forward_only``.
        forward_only: no backward; no autograd graph is built.
        temperature: divides the logits before the softmax.
        compute_entropy: also compute ``entropy [mb, S-1]`` (policy models only).
        top_k: also give each position's ``top_k`` likeliest tokens (``top_log_probs`` /
            ``top_ids [mb, S-1, top_k]``; policy models, ``forward_only``). Micro-batches with
            ``scored_ids`` always get ``scored_log_probs``.
        pack_sequences: run each micro-batch as one packed row (module docstring); the model
            must be built for it (``ModelBuildOptions(pack_sequences=True)``).
        record_routing: note the experts every token goes to in this rank's MoE layers
            (``MicroBatchResult.routing``); micro-batches that carry ``routing`` replay it
            instead (``parallel.routing_replay``: the model must be built for it).

    Returns:
        One ``MicroBatchResult`` per micro-batch, in order, on every rank of the model-parallel
        group (broadcast from the last pipeline stage): ``loss_fn``'s report (metrics as
        floats) and, when ``forward_only``, the outputs (detached, float32, on ``device()``).
    """
    if not micro_batches:
        return []
    if loss_fn is None and not forward_only:
        raise ValueError("forward_backward needs a loss_fn unless forward_only=True")
    if top_k and not forward_only:
        raise ValueError("top_k is for forward-only passes (its outputs carry no gradient)")
    # Sequence parallelism splits the sequence over the TP ranks: S must divide by tp.
    multiple = mesh.tp if getattr(get_model_config(models[0]), "sequence_parallel", False) else 1
    layout = packed_inputs if pack_sequences else padded_inputs
    padded = layout(micro_batches, common_length=mesh.pp > 1, multiple=multiple)
    routing = routing_pass(models, mesh, micro_batches, record_routing)
    lengths = [mb.input_ids.shape[1] for mb in micro_batches]
    seq_len, mb = padded[0].input_ids.shape[1], padded[0].input_ids.shape[0]
    originals: list[MicroBatch | None] = list(micro_batches)
    if len(models) > 1:
        # The interleaved schedule needs at least pp micro-batches: pad with dummy ones whose
        # loss is 0 and whose results are dropped.
        dummies = max(0, mesh.pp - len(padded))
        padded += [padded[-1]] * dummies
        originals += [None] * dummies
        lengths = lengths + [seq_len] * dummies
        config = get_model_config(models[0])
        config.microbatch_group_size_per_vp_stage = _interleaving_group_size(len(padded), mesh.pp)
        # In its steady state the interleaved schedule sends an activation AND a gradient to
        # the same peer when pp == 2. Batched p2p (the config default) posts both on one
        # communicator, where gloo pairs them by posting order and swaps them (wrong
        # gradients, correct forward). Megatron's unbatched p2p uses a separate group per
        # direction when pp == 2, which keeps the two apart.
        config.batch_p2p_comm = False

    forward_step = partial(
        _forward_step,
        originals=iter(originals),
        lengths=iter(lengths),
        loss_fn=loss_fn,
        scale=len(padded),
        forward_only=forward_only,
        request=OutputRequest(temperature, compute_entropy, top_k),
        mesh=mesh,
        routing=routing,
    )
    # The schedule pulls micro-batches per model chunk; every chunk gets the same sequence.
    chunk_iterators = [iter(padded) for _ in models]
    schedule = get_forward_backward_func()
    try:
        with torch.no_grad() if forward_only else torch.enable_grad():
            per_microbatch = schedule(
                forward_step_func=forward_step,
                data_iterator=chunk_iterators if len(models) > 1 else chunk_iterators[0],
                model=models if len(models) > 1 else models[0],
                num_microbatches=len(padded),
                seq_length=seq_len,
                micro_batch_size=mb,
                forward_only=forward_only,
            )
    finally:
        if routing is not None:
            routing.finish()
    results = _share_from_last_stage(per_microbatch[: len(micro_batches)], mesh, forward_only)
    if routing is not None:
        attach_routing(results, routing, micro_batches, padded)
    return results


def _interleaving_group_size(num_microbatches: int, pp: int) -> int:
    """Micro-batches run per virtual stage at a time: megatron's default ``pp`` when it
    divides the count, else the smallest size whose last group is not shorter than ``pp``
    (megatron rejects schedules with such dependency bubbles)."""
    for size in range(pp, num_microbatches + 1):
        remainder = num_microbatches % size
        if remainder == 0 or remainder >= pp:
            return size
    return num_microbatches


def _unpadded_vocab_size(model: torch.nn.Module) -> int | None:
    return get_attr_wrapped_model(model, "unpadded_vocab_size", allow_none=True)


def _forward_step(
    data_iterator,
    model,
    *,
    originals,
    lengths,
    loss_fn,
    scale,
    forward_only,
    request,
    mesh,
    routing,
):
    """Megatron forward_step_func: run one chunk; on the last stage return the loss closure."""
    inputs = next(data_iterator)
    if routing is not None:
        routing.before(model, inputs.routing)
    packed: PackedRows | None = inputs.packed
    # Right padding + causal attention: real tokens never attend to padding, so no mask; packed
    # rows are masked by their cu_seqlens. MoE routers take the padding positions, to leave them
    # out of the load-balancing loss (packed rows hold no padding).
    moe = get_model_config(model).num_moe_experts is not None
    padding = {"padding_mask": inputs.attention_mask == 0} if moe and packed is None else {}
    images = {"images": inputs.images} if inputs.images is not None else {}
    output = model(
        inputs.input_ids,
        inputs.position_ids,
        attention_mask=None,
        packed_seq_params=packed.params if packed is not None else None,
        **padding,
        **images,
    )
    if routing is not None:
        routing.after(model)
    if not _is_last_stage_chunk(model, mesh):
        return output, None
    micro_batch, length = next(originals), next(lengths)
    if micro_batch is None:  # interleaving filler, see forward_backward
        return output, _dummy_loss
    return output, partial(
        _loss_closure,
        micro_batch=micro_batch,
        input_ids=inputs.input_ids[:, :length] if packed is None else inputs.input_ids,
        packed=packed,
        width=length,
        loss_fn=loss_fn,
        scale=scale,
        forward_only=forward_only,
        request=request,
        model=model,
        mesh=mesh,
    )


def _dummy_loss(model_output: torch.Tensor) -> tuple[torch.Tensor, MicroBatchResult]:
    # Zero loss with a graph, so the backward pass through the filler runs and adds nothing.
    return model_output.sum() * 0.0, MicroBatchResult(LossReport())


def _is_last_stage_chunk(model: torch.nn.Module, mesh: Mesh) -> bool:
    # post_process is True only on the chunk that owns the output layer.
    return bool(get_attr_wrapped_model(model, "post_process")) and mesh.is_last_stage


def _loss_closure(
    model_output,
    *,
    micro_batch,
    input_ids,
    packed,
    width,
    loss_fn,
    scale,
    forward_only,
    request,
    model,
    mesh,
):
    outputs = _per_row_outputs(
        model_output, input_ids, micro_batch.scored_ids, packed, width, request, model, mesh
    )
    if loss_fn is None:
        loss, report = torch.zeros((), device=input_ids.device), LossReport()
    else:
        loss, report = loss_fn(outputs, micro_batch.to(device()))
    result = MicroBatchResult(report.as_floats())
    if forward_only:
        result.outputs = ModelOutputs(**{k: v.detach() for k, v in outputs.filled().items()})
    # Megatron divides by the number of micro-batches; undo it so gradients are of the SUM.
    return loss * scale, result


def _per_row_outputs(
    model_output, input_ids, scored_ids, packed, width, request, model, mesh
) -> ModelOutputs:
    """``log_probs`` (and what ``request`` and ``scored_ids`` ask for) ``[mb, width-1, ...]`` or
    ``values [mb, width]`` from the last stage's output for ``input_ids`` (``[mb, S]`` rows, or
    the packed row of ``packed``)."""
    length = input_ids.shape[1]
    if model_output.dim() == 2:  # critic: parallel.model.ValueHead gives values [mb, S]
        if request.entropy:
            raise ValueError("compute_entropy=True needs a policy model, got a critic")
        values = model_output[:, :length].float()
        return ModelOutputs(values=values if packed is None else packed.unpack(values, width))
    # Every position of the [b, S, V] logits is used and the last one's result dropped
    # afterwards: slicing the logits would make autograd build a zero-filled [b, S, V]
    # gradient and copy into it; slicing the [b, S] results costs nothing. The last
    # position's label is a stand-in (its log-prob is cut off, so its gradient is zero).
    logits = model_output if model_output.shape[1] == length else model_output[:, :length]
    # float32 before the division: a bf16 quotient would round every logit once more. At
    # temperature 1 the division is skipped (exact), which saves a pass over [b, S, V] and
    # its backward.
    logits = logits.float()
    if request.temperature != 1.0:
        logits = logits / request.temperature
    if packed is None:
        labels = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
    else:
        labels = packed.labels
    # Given ids (``scored_ids``) and the model's own likeliest (``request.top_k``) take their
    # log-probs from the same softmax as the next token's: one pass over the logits.
    vocab_size = _unpadded_vocab_size(model)
    ids_of: dict[str, torch.Tensor] = {}  # output name -> [mb, S, k] ids
    if scored_ids is not None:
        ids_of["scored_log_probs"] = scored_ids.to(labels.device)
    if request.top_k:
        ids_of["top_log_probs"] = vocab_parallel_top_ids(
            logits, request.top_k, mesh.tp_group, vocab_size
        )
    if ids_of:
        if packed is not None:
            raise ValueError("scored_ids and top_k need padded rows, not pack_sequences")
        labels = torch.cat([labels.unsqueeze(-1), *ids_of.values()], dim=-1)
    per_token = {}
    if request.entropy:
        log_probs, per_token["entropy"] = vocab_parallel_log_probs_and_entropy(
            logits, labels, mesh.tp_group, vocab_size
        )
    else:
        log_probs = vocab_parallel_log_probs(logits, labels, mesh.tp_group, vocab_size)
    per_token["log_probs"] = log_probs[..., 0] if ids_of else log_probs
    if ids_of:
        widths = [ids.shape[-1] for ids in ids_of.values()]
        per_token.update(zip(ids_of, log_probs[..., 1:].split(widths, dim=-1), strict=True))
    if request.top_k:
        per_token["top_ids"] = ids_of["top_log_probs"]
    if packed is None:
        return ModelOutputs(**{name: value[:, :-1] for name, value in per_token.items()})
    return ModelOutputs(
        **{name: packed.unpack(value, width - 1, shift=1) for name, value in per_token.items()}
    )


def _share_from_last_stage(
    per_microbatch: list[MicroBatchResult], mesh: Mesh, forward_only: bool
) -> list[MicroBatchResult]:
    """The last pipeline stage's results on every stage: reports and output shapes by object
    broadcast, then each output tensor by tensor broadcast into a buffer of that shape."""
    summaries = None
    if mesh.is_last_stage:
        summaries = [
            (
                r.report,
                {k: (tuple(v.shape), v.dtype) for k, v in r.outputs.filled().items()}
                if r.outputs
                else None,
            )
            for r in per_microbatch
        ]
    summaries = mesh.broadcast_object_from_last_stage(summaries)
    results = []
    for index, (report, shapes) in enumerate(summaries):
        result = MicroBatchResult(report)
        if shapes is not None:
            outputs = {}
            for name, (shape, dtype) in shapes.items():
                if mesh.is_last_stage:
                    tensor = getattr(per_microbatch[index].outputs, name).contiguous()
                else:
                    tensor = torch.empty(shape, dtype=dtype, device=device())
                outputs[name] = mesh.broadcast_from_last_stage(tensor)
            result.outputs = ModelOutputs(**outputs)
        results.append(result)
    return results
