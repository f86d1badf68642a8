from pathlib import Path

import click

from dflash_cache.choices import EXPORT_DTYPES


@click.command("export")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Directory for config.json and model.safetensors: new, empty, or an earlier export (replaced).",
)
@click.option(
    "--dtype",
    type=click.Choice(EXPORT_DTYPES),
    default="bfloat16",
    show_default=True,
    help="Weight dtype of the export.",
)
def command(checkpoint: Path, out: Path, dtype: str) -> None:
    """Write a drafter CHECKPOINT (a `train` checkpoint directory, or a run folder: its newest checkpoint)
    in the reference DFlash layout.

    The result loads with `dflash.model.DFlashDraftModel.from_pretrained(OUT)` and serves in engines
    that run DFlash drafters.
    """
    from dflash_cache.drafter.export import check_export_out, export_checkpoint
    from dflash_cache.eval.drafters import checkpoint_of, from_newest

    checkpoint_of(checkpoint)  # a path that is not there is named before --out is looked at
    replacing = check_export_out(out)
    checkpoint = from_newest(checkpoint, lambda chosen: export_checkpoint(chosen, out, dtype) and chosen)
    click.echo(
        f"exported {checkpoint} -> {out} ({dtype})" + (", replacing the export that was there" if replacing else "")
    )
