"""A run's inputs, prepared on every rank in the same order: process groups, the checked config,
the (built) model directory, the tokenizer and the prompt data."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from parallel.mesh import Mesh, init_parallel
from rlcli.config import RLConfig
from rlcli.config_validation import validate
from rlcli.data import PromptDataset
from rlcli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class RunInputs:
    cfg: RLConfig
    mesh: Mesh
    output_dir: Path
    model_dir: str
    tokenizer: PreTrainedTokenizerBase
    train_data: PromptDataset
    val_data: PromptDataset | None
    sft_files: list[str]  # SFT pairs of the synthetic task (for the warm start)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def prepare_inputs(cfg: RLConfig) -> RunInputs:
    """Start the process groups, write synthetic data / build the model when asked, load data."""
    from transformers import AutoTokenizer

    from rlcli.data import load_prompt_dataset

    mesh = init_parallel(
        cfg.parallel.tp,
        cfg.parallel.pp,
        cfg.parallel.vpp,
        seed=cfg.trainer.seed,
        timeout_s=cfg.parallel.timeout_minutes * 60,
        ep=cfg.parallel.ep,
        etp=cfg.parallel.expert_tp,
    )
    validate(cfg, world_size=mesh.world_size)
    output_dir = Path(cfg.trainer.output_dir)
    sft_files: list[str] = []
    if cfg.data.synthetic == "arith":
        from rlcli.data import write_arith_dataset

        data_dir = output_dir / "data"
        if mesh.rank == 0 and not (data_dir / "val.jsonl").exists():
            write_arith_dataset(str(data_dir))
        barrier()
        cfg.data.train_files = cfg.data.train_files or [str(data_dir / "train.jsonl")]
        cfg.data.val_files = cfg.data.val_files or [str(data_dir / "val.jsonl")]
        sft_files = [str(data_dir / "sft_train.jsonl")]
    model_dir = cfg.model.path
    if cfg.model.build:
        # Only rank 0 looks: another rank could see a half-written config.json and skip the
        # barrier rank 0 waits in.
        if mesh.rank == 0 and not Path(model_dir, "config.json").exists():
            _build_model(cfg, model_dir, sft_files)
        barrier()
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
    train = load_prompt_dataset(cfg.data.train_files, **kwargs)
    val = load_prompt_dataset(cfg.data.val_files, **kwargs) if cfg.data.val_files else None
    return RunInputs(cfg, mesh, output_dir, model_dir, tokenizer, train, val, sft_files)


def _build_model(cfg: RLConfig, model_dir: str, sft_files: list[str]) -> None:
    from rlcli.data import read_sft_pairs
    from rlcli.model_builder import build_model_dir

    corpus = [p + r for f in sft_files for p, r in read_sft_pairs(f)]
    if not corpus:
        raise UserError("model.build needs text to train its tokenizer: use data.synthetic=arith")
    build_model_dir(cfg.model.spec, model_dir, corpus, seed=cfg.trainer.seed)
