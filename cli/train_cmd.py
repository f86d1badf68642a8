import click

from dflash_cache.choices import LOSSES
from dflash_cache.store.pool import DEFAULT_MAX_OPEN_SHARDS
from dflash_cache.train.config import TrainConfig
from dflash_cache_cli.options import INT_LIST, LAYER_RULE


@click.command("train")
@click.option(
    "--cache",
    "caches",
    multiple=True,
    type=click.Path(),
    help="Cache directory written by `extract`, or its fsspec URL (s3://bucket/prefix). Repeat to train "
    "on the union of several caches (same target, layers, codec and tokenizer).",
)
@click.option(
    "--live-target",
    type=click.Path(),
    help="Instead of --cache: a Hugging Face model directory run beside the drafter, computing every batch "
    "as coupled pipelines do (the baseline a cache is measured against). Needs --data.",
)
@click.option(
    "--data",
    multiple=True,
    type=click.Path(),
    help="With --live-target: the data files, as for `extract --data` (conversations JSONL or pre-tokenized "
    "Parquet/Arrow/JSONL). Repeatable.",
)
@click.option(
    "--layers",
    type=INT_LIST,
    help="With --live-target: target layers to feed the drafter, e.g. 1,16,31,46,61 (as for extract).",
)
@click.option("--num-draft-layers", type=int, help="With --live-target: " + LAYER_RULE)
@click.option(
    "--target-gpus",
    type=INT_LIST,
    help="With --live-target: the GPU of each training rank's own copy of the target, in --gpus order "
    "(--target-gpus 0 --gpus 1: target on GPU 0 feeding the drafter on GPU 1). Default: each rank's "
    "training GPU.",
)
@click.option(
    "--max-length",
    type=int,
    default=8192,
    show_default=True,
    help="With --live-target: longer samples are truncated (as for extract).",
)
@click.option(
    "--exact-target",
    is_flag=True,
    help="With --live-target: run each sample alone through the target, as `extract --batching padded --token-budget 1` "
    "does, so the losses equal those of training from such a bf16-zstd cache bit for bit (slower). "
    "Default: a batch's samples in padded target forwards of at most --token-budget tokens.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(),
    help="Run directory: metrics.jsonl, TensorBoard files in tb/, checkpoints/step-N/. Must be new or "
    "empty, unless --resume.",
)
@click.option(
    "--drafter",
    default="target",
    show_default=True,
    help="Drafter shape. 'target': the target's own hidden size, FFN size, heads, KV heads and head_dim, "
    "5 layers, block 16 (the rule the z-lab DFlash drafters follow). A preset (qwen3-8b, qwen3.6-27b: "
    "those drafters' shapes, with the cache's hidden size, vocabulary and layers), or a JSON file of "
    "drafter fields (README: 'Drafter JSON').",
)
@click.option(
    "--gpus",
    type=INT_LIST,
    help="GPUs to train on, one DDP process each, e.g. 5-7. Default: every visible GPU; the CPU when "
    "there is none. Under torchrun, the GPU of each local rank.",
)
@click.option("--epochs", type=int, help="Passes over the training samples. Default: 1 (unless --steps).")
@click.option("--steps", type=int, help="Optimizer steps to run instead of whole epochs.")
@click.option(
    "--token-budget",
    type=int,
    help="Tokens per batch on each GPU (packed, no padding in eager mode). Default: 49152 on a GPU, 2048 on the CPU.",
)
@click.option("--lr", type=float, default=6e-4, show_default=True, help="Peak AdamW learning rate.")
@click.option("--warmup", type=int, help="Linear warmup steps before the cosine decay. Default: 4% of the run.")
@click.option("--min-lr-ratio", type=float, default=0.1, show_default=True, help="The cosine ends at lr times this.")
@click.option("--weight-decay", type=float, default=0.01, show_default=True, help="AdamW weight decay (matrices only).")
@click.option("--grad-clip", type=float, default=1.0, show_default=True, help="Clip the gradient norm to this.")
@click.option(
    "--grad-accum",
    type=int,
    default=1,
    show_default=True,
    help="Batches per GPU per optimizer step; the global batch is GPUs x this x --token-budget.",
)
@click.option(
    "--max-anchors",
    type=int,
    help="Most training blocks per sequence. Default: 512 on a GPU, 8 on the CPU (whose attention cost "
    "grows with blocks x tokens of a batch).",
)
@click.option(
    "--anchors-per-batch",
    type=int,
    help="Most training blocks per batch: a uniform subset of the blocks its sequences get (--max-anchors "
    "each). A fixed count is what --compile needs to pad nothing. Default: no cap, except on a GPU "
    "where the plan's largest batch would not fit in memory: then the most that fit, printed at the start.",
)
@click.option(
    "--gamma", type=float, default=7.0, show_default=True, help="Loss weight of block slot k is exp(-(k-1)/gamma)."
)
@click.option(
    "--labels",
    type=click.Choice(["target", "tokens"]),
    default="target",
    show_default=True,
    help="Train on the target's own next-token predictions, or on the data's tokens.",
)
@click.option(
    "--loss",
    type=click.Choice(LOSSES),
    default=TrainConfig.loss,
    show_default=True,
    help="Training objective. dflash: cross-entropy against the labels, slot k weighted exp(-(k-1)/gamma). "
    "dpace: the same cross-entropy weighted by D-PACE's confidence-derived slot weights (see "
    "--dpace-alpha). topk: distil the target's top-K distribution, as a cache extracted with --topk K "
    "stores it (renormalised over the K tokens), slots weighted as dflash weighs them.",
)
@click.option(
    "--dpace-alpha",
    type=float,
    default=TrainConfig.dpace_alpha,
    show_default=True,
    help="With --loss dpace: each slot's confidence q counts as alpha + (1 - alpha) * q, in (0, 1]; 1 weighs "
    "every slot by the counted slots from it on.",
)
@click.option(
    "--compile",
    "compile_",
    is_flag=True,
    help="Run the drafter under torch.compile, batches padded to a fixed size (one graph): the token "
    "budget, and the most blocks a batch of the plan can get (--anchors-per-batch caps it). Faster "
    "than eager only when batches get about that many blocks; the start says how much is padding.",
)
@click.option(
    "--eval-fraction",
    type=float,
    default=0.01,
    show_default=True,
    help="Share of samples held out for evaluation, chosen by a hash of the sample id.",
)
@click.option("--eval-every", type=int, default=500, show_default=True, help="Evaluate every N steps (and at the end).")
@click.option(
    "--save-every",
    type=int,
    default=1000,
    show_default=True,
    help="Checkpoint every N steps (and at the end); 0: never, for throughput experiments (such a run cannot be resumed).",
)
@click.option(
    "--keep-last",
    type=int,
    default=0,
    show_default=True,
    help="Keep only the newest N complete checkpoints (0: keep every one).",
)
@click.option(
    "--log-every",
    type=int,
    default=1,
    show_default=True,
    help="Print a progress line every N steps (metrics.jsonl gets every step).",
)
@click.option("--resume", is_flag=True, help="Continue the run in --out from its newest complete checkpoint.")
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the batch plan, anchors and initial weights."
)
@click.option(
    "--prefetch", type=int, default=4, show_default=True, help="Batches read and decompressed ahead, per GPU."
)
@click.option("--workers", type=int, default=8, show_default=True, help="Reader threads per GPU.")
@click.option(
    "--skip-nonfinite",
    is_flag=True,
    help="Skip a step whose loss is NaN/Inf (counted in the metrics) instead of stopping.",
)
@click.option(
    "--collective-timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds a rank may wait in a collective before the run is stopped as hung.",
)
@click.option(
    "--local-cache",
    type=click.Path(),
    help="With a remote --cache: fetch whole shards into this folder and read them there (default: read "
    "each sample by byte ranges).",
)
@click.option(
    "--local-cache-size",
    type=float,
    help="GiB of shards --local-cache may hold per process; least recently used shards are deleted past it.",
)
@click.option(
    "--max-open-shards",
    type=int,
    help=f"Shard files each GPU's readers keep open (least recently used closed first): one file descriptor "
    f"and one memory map each, whatever the number of shards (default: {DEFAULT_MAX_OPEN_SHARDS}, or a "
    f"quarter of `ulimit -n` where that is lower).",
)
@click.option(
    "--follow",
    is_flag=True,
    help="Start while the cache is still being extracted: the first epoch trains on each shard once it is "
    "committed, waiting for the next one (and saying so); later epochs use the whole cache. Needs --steps.",
)
@click.option(
    "--follow-timeout",
    type=float,
    help="With --follow: stop with an error after this many seconds without a new shard. Default: wait on.",
)
def command(
    caches,
    live_target,
    data,
    layers,
    num_draft_layers,
    target_gpus,
    max_length,
    exact_target,
    out,
    drafter,
    gpus,
    epochs,
    steps,
    token_budget,
    lr,
    warmup,
    min_lr_ratio,
    weight_decay,
    grad_clip,
    grad_accum,
    max_anchors,
    anchors_per_batch,
    gamma,
    labels,
    loss,
    dpace_alpha,
    compile_,
    eval_fraction,
    eval_every,
    save_every,
    keep_last,
    log_every,
    resume,
    seed,
    prefetch,
    workers,
    skip_nonfinite,
    collective_timeout,
    local_cache,
    local_cache_size,
    max_open_shards,
    follow,
    follow_timeout,
):
    """Train a DFlash drafter from one or more caches, with no target model loaded.

    With --live-target instead of --cache, the target runs beside the drafter and computes each batch
    when the step needs it (the coupled baseline); everything after the source is the same.

    Writes metrics.jsonl, TensorBoard files and checkpoints to --out; `dflash-cache export` turns a
    checkpoint into the reference layout. The step runs under bf16 autocast; checkpoints hold fp32
    weights. On a GPU, AdamW keeps fp32 masters of the matrices, which the drafter uses as bf16 copies
    (their gradients, summed over --grad-accum and averaged over GPUs, are bf16).
    """
    config = TrainConfig(
        caches=list(caches),
        live_target=live_target,
        data=list(data),
        layers=layers,
        num_draft_layers=num_draft_layers,
        target_gpus=target_gpus,
        max_length=max_length,
        exact_target=exact_target,
        out=out,
        drafter=drafter,
        gpus=gpus,
        epochs=epochs,
        steps=steps,
        token_budget=token_budget,
        lr=lr,
        warmup=warmup,
        min_lr_ratio=min_lr_ratio,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        grad_accum=grad_accum,
        max_anchors=max_anchors,
        anchors_per_batch=anchors_per_batch,
        gamma=gamma,
        labels=labels,
        loss=loss,
        dpace_alpha=dpace_alpha,
        compile=compile_,
        eval_fraction=eval_fraction,
        eval_every=eval_every,
        save_every=save_every,
        keep_last=keep_last,
        log_every=log_every,
        resume=resume,
        seed=seed,
        prefetch=prefetch,
        workers=workers,
        skip_nonfinite=skip_nonfinite,
        collective_timeout_s=collective_timeout,
        local_cache=local_cache,
        local_cache_bytes=None if local_cache_size is None else int(local_cache_size * (1 << 30)),
        max_open_shards=max_open_shards,
        follow=follow,
        follow_timeout_s=follow_timeout,
    )
    from dflash_cache.train.train import train

    train(config, echo=click.echo)
    click.echo(f"done: {out}")
