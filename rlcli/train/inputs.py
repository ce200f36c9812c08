"""A run's inputs, prepared on every rank in the same order: process groups, the checked config,
the (built) model directory, the tokenizer and the prompt data.

With ``rollout.placement=separate`` the launch is first split into its two roles
(``parallel.roles``): the trainer ranks get megatron's mesh, the rollout ranks none; both wait
for what global rank 0 (trainer rank 0) writes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from parallel.mesh import Mesh, init_parallel
from parallel.model_options import ModelBuildOptions, MoeOptions, Recompute
from parallel.roles import RoleWorld, init_role_world
from rlcli.config.schema import RLConfig, TrainedModelConfig
from rlcli.data import PromptDataset
from rlcli.errors import UserError
from rlcli.run.resume_plan import run_settings
from rlcli.validation.validate import validate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class RunInputs:
    cfg: RLConfig
    mesh: Mesh | None  # None on the rollout ranks of rollout.placement=separate
    roles: RoleWorld | None  # rollout.placement=separate: this rank's role and the channels
    output_dir: Path
    model_dir: str
    tokenizer: PreTrainedTokenizerBase
    processor: Any  # a vision-language model's AutoProcessor (renders rows with images); None
    train_data: PromptDataset
    val_data: PromptDataset | None
    sft_files: list[str]  # SFT rows of the synthetic task (for the warm start)
    # the config as given, before the synthetic data's files are filled in (what a checkpoint
    # records and a resume compares: rlcli.run.resume_plan)
    settings: dict[str, Any]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def tokenizer_setting(cfg: RLConfig) -> str:
    """The config key (and value) that names the run's tokenizer, for error messages."""
    if cfg.model.tokenizer_path:
        return f"model.tokenizer_path={cfg.model.tokenizer_path}"
    return f"model.path={cfg.model.path}"


def barrier_all(roles: RoleWorld | None, name: str) -> None:
    """Every rank of the launch, of both roles (``barrier`` within one world otherwise)."""
    if roles is None:
        barrier()
    else:
        roles.barrier_all(name)


def prepare_inputs(cfg: RLConfig) -> RunInputs:
    """Start the process groups, write synthetic data / build the model when asked, load data."""
    from transformers import AutoTokenizer

    from rlcli.data import load_prompt_dataset

    settings = run_settings(cfg)
    timeout_s = cfg.parallel.timeout_minutes * 60
    roles = None
    if cfg.rollout.is_separate:
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))  # before the split
        roles = init_role_world(cfg.rollout.num_ranks, timeout_s=timeout_s)
    mesh = None
    if roles is None or roles.is_trainer:
        mesh = init_parallel(
            cfg.parallel.tp,
            cfg.parallel.pp,
            cfg.parallel.vpp,
            seed=cfg.trainer.seed,
            timeout_s=timeout_s,
            ep=cfg.parallel.ep,
            etp=cfg.parallel.expert_tp,
        )
    validate(cfg, world_size=roles.global_size if roles else mesh.world_size)
    first_rank = (roles.global_rank if roles else mesh.rank) == 0
    output_dir = Path(cfg.trainer.output_dir)
    sft_files: list[str] = []
    if cfg.data.synthetic == "arith":
        from rlcli.data import write_arith_dataset

        data_dir = output_dir / "data"
        if first_rank and not (data_dir / "val.jsonl").exists():
            write_arith_dataset(str(data_dir))
        barrier_all(roles, "data")
        cfg.data.train_files = cfg.data.train_files or [str(data_dir / "train.jsonl")]
        cfg.data.val_files = cfg.data.val_files or [str(data_dir / "val.jsonl")]
        sft_files = [str(data_dir / "sft_train.jsonl")]
    elif cfg.data.synthetic == "count_squares":
        from rlcli.data.image_task import write_count_squares_dataset

        data_dir = output_dir / "data"
        if first_rank and not (data_dir / "val.jsonl").exists():
            write_count_squares_dataset(str(data_dir), seed=cfg.trainer.seed)
        barrier_all(roles, "data")
        cfg.data.train_files = cfg.data.train_files or [str(data_dir / "train.jsonl")]
        cfg.data.val_files = cfg.data.val_files or [str(data_dir / "val.jsonl")]
        sft_files = [str(data_dir / "sft_train.jsonl")]
    elif cfg.data.synthetic == "tool_multiply":
        from rlcli.data.tool_task import write_tool_multiply_dataset
        from rlcli.tools.calculator import CalculatorTool

        data_dir = output_dir / "data"
        if mesh.rank == 0 and not (data_dir / "val.jsonl").exists():
            # The SFT rows list the calculator: an agent offering it (rollout.agent) sees the
            # system prompt the model was trained with, as the built-in loop's tool config does.
            write_tool_multiply_dataset(
                str(data_dir),
                seed=cfg.trainer.seed,
                tool_share=cfg.data.synthetic_tool_share,
                tools=[CalculatorTool.schema.to_openai()],
            )
        barrier()
        cfg.data.train_files = cfg.data.train_files or [str(data_dir / "train.jsonl")]
        cfg.data.val_files = cfg.data.val_files or [str(data_dir / "val.jsonl")]
        sft_files = [str(data_dir / "sft_train.jsonl")]
    model_dir = cfg.model.path
    if cfg.model.build:
        # Only rank 0 looks: another rank could see a half-written config.json and skip the
        # barrier rank 0 waits in.
        if first_rank and not Path(model_dir, "config.json").exists():
            _build_model(cfg, model_dir, sft_files)
        barrier_all(roles, "model")
    if not Path(model_dir, "config.json").is_file():
        raise UserError(
            f"model.path={model_dir!r} is not a HuggingFace model directory (no config.json)"
        )
    if not cfg.data.train_files:
        raise UserError("data.train_files is empty: give JSONL/Parquet prompt files")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_dir)
    kwargs = dict(
        tokenizer=tokenizer,
        prompt_key=cfg.data.prompt_key,
        max_prompt_length=cfg.data.max_prompt_length,
        apply_chat_template=cfg.data.apply_chat_template,
    )
    if cfg.rollout.multi_turn.enable:
        kwargs["tools"] = multi_turn_prompt_tools(cfg, tokenizer)
    processor = kwargs["processor"] = image_processor(cfg, model_dir)
    train = load_prompt_dataset(cfg.data.train_files, **kwargs)
    val = load_prompt_dataset(cfg.data.val_files, **kwargs) if cfg.data.val_files else None
    return RunInputs(
        cfg, mesh, roles, output_dir, model_dir, tokenizer, processor, train, val, sft_files,
        settings,
    )  # fmt: skip


def image_processor(cfg: RLConfig, model_dir: str) -> Any:
    """A vision-language model's processor (transformers' ``AutoProcessor``: its tokenizer,
    image processor and chat template), which renders the rows with images; None for a text
    model."""
    from rlcli.rollout.base import read_hf_config

    if "vision_config" not in read_hf_config(model_dir, "rollout"):
        return None
    from transformers import AutoProcessor  # (its import alone: 0.3 s a text run would wait)

    source = cfg.model.tokenizer_path or model_dir
    try:
        return AutoProcessor.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise UserError(
            f"{tokenizer_setting(cfg)}: a vision-language model needs its processor "
            f"(preprocessor_config.json beside the tokenizer) to read images: {error}"
        ) from error


def multi_turn_prompt_tools(cfg: RLConfig, tokenizer: PreTrainedTokenizerBase) -> list | None:
    """The tools multi-turn prompts list; ``UserError`` naming the tokenizer's key when it has no
    chat template (or one that cannot append messages turn by turn)."""
    from rlcli.tools.multi_turn import prompt_tools
    from rlcli.tools.rendering import MessageRenderer

    tools = prompt_tools(cfg.rollout.multi_turn)
    MessageRenderer(tokenizer, tools, tokenizer_setting(cfg))  # checks the template
    return tools


def _build_model(cfg: RLConfig, model_dir: str, sft_files: list[str]) -> None:
    from rlcli.data.sft_rows import read_sft_rows, sft_corpus
    from rlcli.model.builder import build_model_dir
    from rlcli.model.vision_builder import build_vision_language_dir

    # (sft_files hold the synthetic task's rows: without a task the launch refused model.build)
    corpus = sft_corpus([row for f in sft_files for row in read_sft_rows(f)])
    build = (
        build_vision_language_dir
        if cfg.model.spec.architecture == "qwen2_5_vl"
        else build_model_dir
    )
    build(cfg.model.spec, model_dir, corpus, seed=cfg.trainer.seed)


def model_options(cfg: RLConfig, section: TrainedModelConfig | None = None) -> ModelBuildOptions:
    """``parallel.model.build_model``'s layout options from the config; a model that trains
    adds its own activation recomputation (``section``: its ``actor`` / ``critic`` section)."""
    m = cfg.model
    recompute = Recompute()
    if section is not None:
        recompute = Recompute(
            section.recompute, section.recompute_method, section.recompute_num_layers
        )
    return ModelBuildOptions(
        sequence_parallel=cfg.parallel.sequence_parallel,
        transformer_impl=m.transformer_impl,
        attention_backend=m.attention_backend,
        recompute=recompute,
        moe=MoeOptions(
            m.moe_aux_loss_coef,
            m.moe_load_balancing,
            m.moe_token_dispatcher,
            # only the actor replays (its update); the reference and critic route freely
            routing_replay=section is cfg.actor and m.moe_routing_replay is not None,
        ),
        train_vision_tower=section is cfg.actor and not m.freeze_vision_tower,
    )
