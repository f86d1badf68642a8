import click

from dflash_cache.train.config import TrainConfig
from dflash_cache_cli.options import config_options


@click.command("train")
@config_options(TrainConfig)
def command(**options):
    """Train a DFlash drafter from one or more caches, with no target model loaded.

    With --live-target instead of --cache, the target runs beside the drafter and computes each batch
    when the step needs it (the coupled baseline); everything after the source is the same.

    Writes metrics.jsonl, TensorBoard files and checkpoints to --out; `dflash-cache export` turns a
    checkpoint into the reference layout. The step runs under bf16 autocast (in fp32 on a CPU that
    computes bf16 products slowly); weights, gradients and checkpoints are fp32, except with
    --optimizer adamw on a GPU, where AdamW keeps fp32 masters of the matrices, which the drafter uses as
    bf16 copies (their gradients, summed over --grad-accum and averaged over GPUs, are bf16).
    """
    config = TrainConfig(**options)
    from dflash_cache.train.train import train

    train(config, echo=click.echo)
    click.echo(f"done: {config.out}")
