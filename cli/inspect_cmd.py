import click

from dflash_cache.inspect import describe_cache
from dflash_cache.store import open_cache


@click.command("inspect")
@click.argument("cache", type=click.Path())
@click.option("--token-budget", type=click.IntRange(min=1), default=49152, show_default=True, help="Token budget for the batch table.")
def command(cache: str, token_budget: int) -> None:
    """Show a cache's spec, size, compression and length buckets (reads the manifest only)."""
    for line in describe_cache(open_cache(cache), token_budget):
        click.echo(line)
