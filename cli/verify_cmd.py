import click
from tqdm import tqdm

from dflash_cache.console.units import size
from dflash_cache.store import open_cache


@click.command("verify")
@click.argument("cache", type=click.Path())
def command(cache: str) -> None:
    """Re-read every shard of CACHE: sha256, per-row checksums, and a decode of every tensor.

    Exits 0 with a one-line summary, or 1 naming the first bad shard and row.
    """
    from dflash_cache.store.verify import verify_cache

    opened = open_cache(cache)
    total = sum(s.bytes for s in opened.shards)
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", leave=False, disable=None) as bar:
        report = verify_cache(opened, progress=bar.update)
    click.echo(
        f"ok: {report.shards} shards, {report.rows:,} samples, {report.tokens:,} tokens, {size(report.bytes)} verified"
    )
