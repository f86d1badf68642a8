import click

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store import open_cache
from dflash_cache.store.inspect import describe_cache, describe_sample


@click.command("inspect")
@click.argument("cache", type=click.Path())
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
def command(cache: str, token_budget: int, sample_id: int | None, record_id: str | None) -> None:
    """Show a cache's spec, size, compression and length buckets (reads the manifest only), or one sample."""
    if sample_id is not None and record_id is not None:
        raise DFlashCacheError("give --sample or --record, not both")
    opened = open_cache(cache)
    key = sample_id if sample_id is not None else record_id
    lines = describe_cache(opened, token_budget) if key is None else describe_sample(opened, key)
    for line in lines:
        click.echo(line)
