from pathlib import Path

import click

from dflash_cache.choices import CODECS, DEMO_ASSETS, DEMO_STEPS, DEMO_TRAIN_DATA


@click.command("demo")
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    help="Folder for the cache, the training run and the data subset. Default: a new temporary folder.",
)
@click.option(
    "--assets",
    type=click.Path(path_type=Path),
    default=DEMO_ASSETS,
    show_default=True,
    help="The demo assets: target/ (model and tokenizer), data/train_regenerated.jsonl (or train.jsonl), data/heldout.jsonl.",
)
@click.option("--codec", type=click.Choice(CODECS), default="bf16-zstd", show_default=True, help="The cache's codec.")
@click.option(
    "--train-data",
    type=click.Choice(DEMO_TRAIN_DATA),
    default=DEMO_TRAIN_DATA[0],
    show_default=True,
    help="Training conversations in data/: answered by the target itself (regenerated), or the bundled answers.",
)
@click.option(
    "--steps", type=click.IntRange(min=1), default=DEMO_STEPS, show_default=True, help="Drafter training steps."
)
def command(workdir, assets, codec, train_data, steps):
    """Extract, train and evaluate a drafter on the bundled tiny target and data, in a few minutes.

    Speculative decoding of the trained drafter on held-out prompts is checked against the target's
    own greedy output, and its mean acceptance length (tau) is reported.
    """
    from dflash_cache.demo import DemoOptions, run_demo

    result = run_demo(
        DemoOptions(workdir=workdir, assets=assets, codec=codec, train_data=train_data, steps=steps), echo=click.echo
    )
    report = result.report
    click.echo(f"eval: speculative decoding of {report.prompts} held-out prompts ({result.seconds['eval']:.0f} s)")
    for line in report.lines():
        click.echo(f"  {line}")
    click.echo(f"done in {sum(result.seconds.values()):.0f} s; outputs in {result.workdir}:")
    click.echo(f"  cache    {result.cache}")
    click.echo(f"  run      {result.run} (metrics.jsonl, TensorBoard files in tb/)")
    click.echo(f"  drafter  {result.checkpoint}")
    click.echo("evaluate it again with:")
    click.echo(f"  dflash-cache eval --drafter {result.checkpoint} --target {result.target} --data {result.heldout}")
