"""Megatron vs HF transformers: does a converted model compute what the HF model computes?

    megatron_logits(models, mesh, tokens) -> full-vocab logits [b, s, V] on last-stage ranks
    verify_conversion(hf_dir, mesh, tolerance) -> ParityReport
    round_trip_equal(hf_config, hf_name, exported, original) -> bool

Both are collective: every rank of the job calls them. ``rlcli convert verify`` runs them and
prints the report; the CLI holds no Megatron code.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from parallel.convert import HFCheckpointReader, iter_hf_weights
from parallel.convert.mapping import stored_shifted
from parallel.cpu_compat import device
from parallel.hf_model import load_hf_model
from parallel.mesh import Mesh
from parallel.vision_language import ImageInputs, verify_batch

VERIFY_TOKENS = (2, 32)  # batch, sequence length of the fixed verify batch


@dataclass
class ParityReport:
    """The verdict of `verify_conversion`, the same on every rank."""

    batch: int
    length: int
    max_logit_diff: float  # max |Megatron - HF| over the fixed batch (fp32)
    tolerance: float
    tensors: int  # HF tensors produced by the HF -> Megatron -> HF round trip
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def logits_match(self) -> bool:
        return self.max_logit_diff <= self.tolerance

    @property
    def round_trip_exact(self) -> bool:
        return not self.mismatched and not self.missing

    @property
    def passed(self) -> bool:
        return self.logits_match and self.round_trip_exact


def megatron_logits(
    models: list[torch.nn.Module],
    mesh: Mesh,
    tokens: torch.Tensor,
    positions: torch.Tensor | None = None,
    images: ImageInputs | None = None,
) -> torch.Tensor | None:
    """Full-vocab logits ``[b, s, V]`` (vocab padding dropped) of ``tokens [b, s]`` on
    last-stage ranks, None elsewhere. One forward through megatron-core's pipeline schedule,
    then an all-gather of the vocab shards inside the TP group. A vision-language model takes
    its `images` and multimodal `positions` [3, b, s]."""
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    extra = {} if images is None else {"images": images}

    def forward_step(data_iterator, model):
        output = model(tokens, positions, None, **extra)
        return output, lambda out: (out.sum() * 0, {"logits": out.detach()})

    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(()),
        model=models,
        num_microbatches=1,
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=True,
    )
    if not mesh.is_last_stage:
        return None
    local = results[0]["logits"]  # [b, s, padded_vocab / tp]
    shards = [torch.empty_like(local) for _ in range(mesh.tp)]
    dist.all_gather(shards, local.contiguous(), group=mesh.tp_group)
    return torch.cat(shards, dim=-1)[..., : models[-1].unpadded_vocab_size]


def round_trip_equal(hf_config, name: str, exported: torch.Tensor, original: torch.Tensor) -> bool:
    """Bit for bit, except a zero-centred norm Megatron holds as 1 + w: within the rounding of
    that addition (half a unit in the last place of 1 + |w|)."""
    if torch.equal(exported, original):
        return True
    if not stored_shifted(hf_config, name) or exported.shape != original.shape:
        return False
    ulp = torch.finfo(original.dtype).eps * (1 + original.abs())
    return bool(((exported - original).abs() <= ulp).all())


def verify_conversion(hf_dir: str | Path, mesh: Mesh, tolerance: float) -> ParityReport:
    """Load `hf_dir` into Megatron at the mesh's TP x PP, compare its logits with HF
    transformers' on a fixed random batch, and check that exporting the loaded weights gives
    the HF tensors back bit for bit (a zero-centred norm: up to the rounding of 1 + w)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    models = load_hf_model(hf_dir, mesh)
    for model in models:
        model.eval()  # megatron's MoE layer refuses to train at TP > 1 without SP
    hf_config, multimodal = models[0].hf_config, models[0].multimodal_config
    batch, length = VERIFY_TOKENS
    length = min(length, getattr(hf_config, "max_position_embeddings", length))
    if multimodal is None:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, hf_config.vocab_size, (batch, length), generator=generator)
        logits = megatron_logits(models, mesh, tokens.to(device()))
        hf_class, hf_inputs = AutoModelForCausalLM, {"input_ids": tokens}
    else:  # one image per row, through the vision tower
        images = verify_batch(multimodal, hf_config.vocab_size, batch, length)
        logits = megatron_logits(
            models, mesh, images.tokens.to(device()), images.positions.to(device()),
            images.images.to(device()),
        )  # fmt: skip
        hf_class = AutoModelForImageTextToText
        hf_inputs = images.hf_inputs(multimodal.image_token_id)
    diff = None
    if logits is not None and mesh.tp_rank == 0:
        hf_model = hf_class.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            diff = (logits.cpu().float() - hf_model(**hf_inputs).logits).abs().max().item()
    diff = mesh.broadcast_object_from_last_stage(diff)

    seen, mismatched = set(), []
    with ExitStack() as stack:
        reader = HFCheckpointReader(hf_dir, stack)
        for name, tensor in iter_hf_weights(models, mesh):
            seen.add(name)
            if mesh.rank == 0 and not round_trip_equal(
                hf_config, name, tensor.cpu(), reader(name, None, 0, 0)
            ):
                mismatched.append(name)
        missing = sorted(set(reader.weight_map) - seen)
    # Rank 0 (TP rank 0) holds the difference measured by the last stage of its pipeline and
    # the round-trip comparison; every rank returns rank 0's verdict.
    verdict = [diff, mismatched, missing]
    dist.broadcast_object_list(verdict, src=0)
    diff, mismatched, missing = verdict
    return ParityReport(
        batch=batch,
        length=length,
        max_logit_diff=float("inf") if diff is None else diff,
        tolerance=tolerance,
        tensors=len(seen),
        mismatched=mismatched,
        missing=missing,
    )
