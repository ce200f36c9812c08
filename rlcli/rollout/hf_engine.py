"""HF transformers `generate` behind the rollout interface: the numerical reference for the vLLM
engine and the fallback where vLLM is not installed. One full model per rank (rollout.tp = 1)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import groupby

import torch

from parallel.dtypes import DTYPES
from rlcli.errors import UserError
from rlcli.rollout.base import (
    Completion,
    GenerationRequest,
    RolloutEngine,
    SamplingConfig,
    SequenceLogProbs,
    copies,
    current_replica,
    model_eos_token_ids,
    model_path_key,
    read_hf_config,
)
from rlcli.rollout.engine_images import check_takes_images, hf_image_inputs, image_token_of

MAX_SEQUENCES_PER_CALL = 64  # bounds the padded [batch, len, vocab] scores kept by generate


class HFEngine(RolloutEngine):
    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        key: str = "rollout",
    ) -> None:
        """``key``: the config section the engine is built from (errors name its model path)."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        super().__init__(seed, current_replica(1))
        hf_config = read_hf_config(model_dir, key)
        self._image_token_id = image_token_of(hf_config)
        self.takes_images = self._image_token_id is not None
        model_class = AutoModelForImageTextToText if self.takes_images else AutoModelForCausalLM
        try:
            model = model_class.from_pretrained(model_dir, dtype=DTYPES[dtype])
        except OSError as error:
            raise UserError(
                f"cannot load the model at {model_path_key(key)}={model_dir!r}: {error}"
            ) from error
        device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
        self.model = model.to(device or "cpu").eval()
        self.max_model_len = max_model_len
        self._stop_ids = model_eos_token_ids(model_dir)

    @torch.no_grad()
    def generate_requests(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """Runs of requests with the same sampling and `n` go through `generate` together, up
        to MAX_SEQUENCES_PER_CALL sequences a call, seeded from the run's first request (so a
        rank's results do not depend on other ranks)."""
        check_takes_images(requests, self.takes_images, "HF")
        results: list[list[Completion]] = []
        for (_, n), same in groupby(requests, key=lambda r: (_key(r.sampling), r.n)):
            run = list(same)
            stops = sorted(set(self._stop_ids) | set(run[0].sampling.stop_token_ids))
            greedy = run[0].sampling.temperature == 0
            per_call = 1 if greedy else n  # greedy: one completion per prompt, n copies
            prompts_per_call = max(1, MAX_SEQUENCES_PER_CALL // per_call)
            for start in range(0, len(run), prompts_per_call):
                chunk = run[start : start + prompts_per_call]
                seed = chunk[0].seed if chunk[0].seed is not None else self._seeds.getrandbits(31)
                done = self._generate_chunk(chunk, per_call, chunk[0].sampling, stops, seed)
                results += [copies(c[0], n) for c in done] if greedy else done
        return results

    def _generate_chunk(
        self,
        requests: list[GenerationRequest],
        n: int,
        sampling: SamplingConfig,
        stops: list[int],
        seed: int,
    ) -> list[list[Completion]]:
        from transformers import GenerationConfig

        device = self.model.device
        prompts = [r.prompt_token_ids for r in requests]
        width = max(len(p) for p in prompts)
        pad_id = stops[0] if stops else 0
        # Left padding: every prompt ends at column `width`, where generation starts.
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, device=device)
            attention_mask[row, width - len(ids) :] = 1
        greedy = sampling.temperature == 0
        # Every filter set explicitly: generate fills unset fields from the checkpoint's
        # generation_config.json and then from its own defaults (top_k=50).
        config = GenerationConfig(
            do_sample=not greedy,
            temperature=1.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy or sampling.top_k <= 0 else sampling.top_k,
            typical_p=1.0,
            min_p=0.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            min_new_tokens=0,
            max_new_tokens=sampling.max_tokens,
            num_return_sequences=n,
            eos_token_id=stops or None,
            pad_token_id=pad_id,
            output_scores=True,  # after temperature / top-k / top-p, like vLLM's processed
            return_dict_in_generate=True,
        )
        with (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            _routers_recorded(self.model, sampling.routing) as routed,
        ):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                **hf_image_inputs(requests, input_ids, self._image_token_id),
            )
        new_tokens = out.sequences[:, width:]  # [len(prompts) * n, steps]
        scores = torch.stack(out.scores, dim=1).float()  # [len(prompts) * n, steps, vocab]
        logprobs = scores.log_softmax(-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        completions = [
            _completion(tokens.tolist(), row_logprobs.tolist(), set(stops), sampling)
            for tokens, row_logprobs in zip(new_tokens, logprobs, strict=True)
        ]
        if sampling.routing:
            rows = _routing_per_row(routed, len(completions), width)
            for row, completion in enumerate(completions):
                read = len(prompts[row // n]) + len(completion.token_ids) - 1
                completion.routing = rows[row, width - len(prompts[row // n]) :][:read]
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def sequence_log_probs(
        self, sequences: list[list[int]], top_k: int = 0
    ) -> list[SequenceLogProbs]:
        """One forward per sequence (no padding: the values equal the model's on each alone)."""
        results = []
        for ids in sequences:
            tokens = torch.tensor([ids], device=self.model.device)
            log_p = torch.log_softmax(self.model(tokens).logits[0, :-1].float(), dim=-1)
            picked = log_p.gather(-1, tokens[0, 1:, None])[:, 0]
            top = log_p.topk(top_k, dim=-1)
            results.append(SequenceLogProbs(picked.tolist(), top.values.cpu(), top.indices.cpu()))
        return results

    def sleep(self) -> None:
        pass  # HF keeps no KV cache between calls

    def wake_up(self) -> None:
        pass

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        checkpoint_names = {}
        for name, tensor in weights:
            if name in params:
                # With tied embeddings both names point at one tensor: either name updates it.
                params[name].copy_(tensor)
            else:
                checkpoint_names[name] = tensor
        if checkpoint_names:
            _load_checkpoint_names(self.model, checkpoint_names)

    def close(self) -> None:
        self.model = None


def _load_checkpoint_names(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load tensors named as in a checkpoint rather than as the model's parameters: transformers
    5 holds a MoE layer's experts as fused [E, ...] tensors (`mlp.experts.gate_up_proj`) and
    converts the checkpoint's per-expert tensors when it loads a model; its own loader does the
    same here. All experts of a layer must come in one call (the resharder sends them in one
    bucket)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    mapping = get_model_conversion_mapping(model)
    config = LoadStateDictConfig(weight_mapping=mapping, dtype=next(model.parameters()).dtype)
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Loading weights" bar on every weight sync otherwise
    try:
        info, _ = convert_and_load_state_dict_in_model(model, tensors, config)
    finally:
        if progress:
            hf_logging.enable_progress_bar()
    if info.unexpected_keys:
        unknown = sorted(info.unexpected_keys)
        raise KeyError(f"{unknown} are not weights of {type(model).__name__}")


@contextmanager
def _routers_recorded(model: torch.nn.Module, record: bool) -> Iterator[list[list[torch.Tensor]]]:
    """With ``record``, the top-k expert indices every MoE router of ``model`` hands its experts,
    per layer, one ``[tokens, k]`` entry per forward (transformers' ``*TopKRouter`` modules return
    ``(logits, weights, indices)`` over the flattened ``[batch * length]`` tokens)."""
    if not record:
        yield []
        return
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        raise UserError(
            "model.moe_routing_replay=r3 reads the engine's MoE routers, and this model has "
            "none (a dense model): set model.moe_routing_replay=null"
        )
    routed: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [
        router.register_forward_hook(
            lambda module, args, outputs, seen=seen: seen.append(outputs[-1].to("cpu", torch.int16))
        )
        for router, seen in zip(routers, routed, strict=True)
    ]
    try:
        yield routed
    finally:
        for hook in hooks:
            hook.remove()


def _routing_per_row(routed: list[list[torch.Tensor]], rows: int, width: int) -> torch.Tensor:
    """``[rows, width + steps - 1, L, k]``: each row's experts at every position ``generate``
    read: the ``width`` left-padded prompt columns (the first forward), then one token a step."""
    per_layer = []
    for forwards in routed:
        prompt = forwards[0].reshape(rows, width, -1)
        steps = [f.reshape(rows, 1, -1) for f in forwards[1:]]
        per_layer.append(torch.cat([prompt, *steps], dim=1))
    return torch.stack(per_layer, dim=2)


def _key(sampling: SamplingConfig) -> tuple:
    """What must be equal for requests to share one `generate` call."""
    return (
        sampling.temperature,
        sampling.top_p,
        sampling.top_k,
        sampling.max_tokens,
        tuple(sampling.stop_token_ids),
        sampling.logprobs,
        sampling.routing,
    )


def _completion(
    tokens: list[int], logprobs: list[float], stops: set[int], sampling: SamplingConfig
) -> Completion:
    """Cut a generated row after its first stop token; what follows is padding."""
    for i, token in enumerate(tokens):
        if token in stops:
            return Completion(
                tokens[: i + 1], logprobs[: i + 1] if sampling.logprobs else [], "stop"
            )
    return Completion(tokens, logprobs if sampling.logprobs else [], "length")
