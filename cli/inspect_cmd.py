from pathlib import Path

import click

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store import open_cache
from dflash_cache.store.inspect import describe_cache, describe_sample
from dflash_cache_cli.options import INT_LIST


@click.command("inspect")
@click.argument("cache", type=click.Path())
@click.option(
    "--target",
    type=click.Path(path_type=Path),
    help="With a data file in place of a cache: the target whose cache of it is estimated.",
)
@click.option("--layers", type=INT_LIST, help="With --target: the layers extract would capture (default: its rule).")
@click.option(
    "--token-budget",
    type=click.IntRange(min=1),
    default=49152,
    show_default=True,
    help="Token budget for the batch table.",
)
@click.option(
    "--sample",
    "sample_id",
    type=int,
    help="Show this sample instead (its sample id: the record's number in the --data files, from 0).",
)
@click.option(
    "--record",
    "record_id",
    help="Show the sample of this record id instead (the record's own `id`; an integer id as its digits).",
)
def command(
    cache: str,
    target: Path | None,
    layers: list[int] | None,
    token_budget: int,
    sample_id: int | None,
    record_id: str | None,
) -> None:
    """Show a cache's spec, size, compression and length buckets (reads the manifest only), or one
    sample; or, given a data file and --target, the disk its cache would take with each codec."""
    if sample_id is not None and record_id is not None:
        raise DFlashCacheError("give --sample or --record, not both")
    if target is not None:
        from dflash_cache.extract.disk_plan import describe_data_disk

        for line in describe_data_disk(target, [Path(cache)], layers):
            click.echo(line)
        return
    opened = open_cache(cache)
    key = sample_id if sample_id is not None else record_id
    lines = describe_cache(opened, token_budget) if key is None else describe_sample(opened, key)
    for line in lines:
        click.echo(line)
