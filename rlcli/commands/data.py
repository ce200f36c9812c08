"""``rlcli data gsm8k|arith|images``: datasets in the prompt schema rlcli trains on."""

from __future__ import annotations

from pathlib import Path

import typer

data_app = typer.Typer(
    help="Prepare datasets in the prompt schema rlcli trains on.", no_args_is_help=True
)


@data_app.command("gsm8k")
def data_gsm8k(
    input: Path = typer.Option(..., "--input", help="GSM8K raw JSONL (question / answer rows)."),
    output: Path = typer.Option(..., "--output", help="Output directory."),
):
    """Turn GSM8K's raw rows into rlcli's (verl's) prompt schema."""
    from rlcli.data.gsm8k import convert_gsm8k

    counts = convert_gsm8k(str(input), str(output))
    for split, rows in counts.items():
        typer.echo(f"wrote {output / f'{split}.jsonl'} ({rows} rows)")
    key = {"train": "data.train_files", "test": "data.val_files"}
    settings = [f"{key[s]}=[{output / f'{s}.jsonl'}]" for s in counts if s in key]
    if settings:
        typer.echo("train on them with: " + " ".join(settings))


@data_app.command("arith")
def data_arith(
    output: Path = typer.Option(..., "--output", help="Output directory."),
    num_max: int = typer.Option(50, help="Operands are drawn from 0..num_max-1."),
    num_val: int = typer.Option(200, help="Held-out pairs."),
):
    """Write the quickstart's synthetic addition task (train and held-out JSONL)."""
    from rlcli.data.synthetic import write_arith_dataset

    paths = write_arith_dataset(str(output), num_max=num_max, num_val=num_val)
    typer.echo(f"wrote {paths}")


@data_app.command("images")
def data_images(
    images: Path = typer.Option(..., "--images", help="Folder of the images."),
    questions: Path = typer.Option(
        ...,
        "--questions",
        help='JSONL / Parquet rows: "image" (or "images"), "question", "answer".',
    ),
    output: Path = typer.Option(..., "--output", help="Output JSONL of prompt rows."),
    data_source: str = typer.Option(
        "images", "--data-source", help="Each row's data_source (selects the reward function)."
    ),
):
    """Turn a folder of images and questions about them into prompt rows with images (for a
    vision-language model; docs/vision-language.md)."""
    from rlcli.data.images import image_question_rows
    from rlcli.data.rows import write_jsonl

    rows = image_question_rows(str(images), str(questions), data_source)
    write_jsonl(str(output), rows)
    typer.echo(f"wrote {output} ({len(rows)} rows)")
