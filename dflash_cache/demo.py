"""`run_demo`: the whole job on the bundled assets, end to end, in a few minutes on a laptop.

    extract   the bundled target over the first training conversations               -> WORKDIR/cache
    train     a one-layer drafter from that cache                               -> WORKDIR/run
    eval      speculative decoding of the held-out prompts (data/heldout.jsonl), every output
              checked against the target's own greedy output

The assets (examples/assets: a tiny Qwen3 target trained on standard-library docstrings, its
tokenizer, the data) ship with the source tree, next to the installed (editable) package. The
training conversations are data/train_regenerated.jsonl: data/train.jsonl with every answer written
again by the target itself (`dflash-cache regenerate`, done once by examples/build_assets.py); the
same drafter trained on those accepts more of the target's tokens (BENCHMARKS.md has both).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_cache.choices import DEMO_ASSETS, DEMO_STEPS, DEMO_TRAIN_DATA
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.errors import DFlashCacheError
from dflash_cache.eval.speculative import (
    SpeculativeOptions,
    SpeculativeReport,
    evaluate_speculative,
)
from dflash_cache.extract.pipeline import ExtractOptions, ExtractSummary, extract
from dflash_cache.files.folders import check_holds_only
from dflash_cache.target.info import read_target_info
from dflash_cache.train.checkpoint import latest_checkpoint
from dflash_cache.train.config import TrainConfig
from dflash_cache.train.metrics import METRICS_FILE
from dflash_cache.train.model import tokenizer_mask_token
from dflash_cache.train.train import train

ASSETS = DEMO_ASSETS
ASSET_FILES = ("target/config.json", "data/heldout.jsonl")
CACHE, RUN, DATA, DRAFTER_FILE = "cache", "run", "data", "drafter.json"  # what the demo writes into its workdir
WORKDIR_ENTRIES = (CACHE, RUN, DATA, DRAFTER_FILE)


@dataclass
class DemoOptions:
    workdir: Path | None = None  # None: a new temporary folder (kept, so the outputs can be looked at)
    assets: Path = ASSETS
    codec: str = "bf16-zstd"
    train_data: str = DEMO_TRAIN_DATA[0]  # a file of data/
    # None: every layer of the target. The bundled one has four; the reference rule (layers spread
    # over 1 .. L-3) would leave one, and the drafter learns markedly better from all four.
    layers: list[int] | None = None
    train_samples: int = 800  # the first conversations of the training file to extract and train on
    steps: int = DEMO_STEPS
    # Small batches: on the CPU the drafter's attention uses a dense mask over the whole packed
    # batch, so its cost grows with the square of the batch.
    token_budget: int = 1024
    max_anchors: int = 32
    seed: int = 0
    eval_prompts: int = 8
    max_new_tokens: int = 64
    drafter_layers: int = 1
    block_size: int = 4  # a briefly trained drafter rarely gets a fourth token right


@dataclass
class DemoResult:
    workdir: Path
    target: Path
    heldout: Path
    cache: Path
    run: Path
    checkpoint: Path
    extracted: ExtractSummary
    train_tau: float  # mean tau of the last tenth of the training steps
    report: SpeculativeReport
    seconds: dict[str, float]


def find_assets(assets: Path, train_data: str = DEMO_TRAIN_DATA[0]) -> Path:
    missing = [name for name in (*ASSET_FILES, f"data/{train_data}") if not (assets / name).is_file()]
    if missing:
        raise DFlashCacheError(
            f"demo assets not found in {assets} (missing {missing[0]}); the demo needs a source checkout of "
            "dflash-cache installed with `pip install -e .`, or pass the assets folder."
        )
    return assets


def write_subset(source: Path, out: Path, count: int) -> Path:
    """The first `count` records of a JSONL file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(source, encoding="utf-8") as f, open(out, "w", encoding="utf-8") as g:
        g.writelines(line for _, line in zip(range(count), (line for line in f if line.strip())))
    return out


def drafter_config(target: Path, layers: list[int], num_layers: int, block_size: int) -> DrafterConfig:
    """A small drafter for the target: its hidden size and vocabulary, `num_layers` decoder layers."""
    info = read_target_info(target)
    mask_token_id = tokenizer_mask_token(target)
    if mask_token_id is None:
        raise DFlashCacheError(f"the tokenizer of {target} declares no mask token; the drafter needs one.")
    heads = info.config.num_attention_heads
    return DrafterConfig(
        hidden_size=info.hidden_size,
        intermediate_size=2 * info.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=info.config.num_key_value_heads,
        head_dim=info.hidden_size // heads,
        vocab_size=info.vocab_size,
        rope_theta=info.config.rope_parameters["rope_theta"],
        block_size=block_size,
        target_layer_ids=layers,
        mask_token_id=mask_token_id,
        num_target_layers=info.num_layers,
    )


def run_demo(opts: DemoOptions, echo: Callable[[str], None] = print) -> DemoResult:
    workdir = Path(opts.workdir) if opts.workdir else None
    if workdir is not None:  # an earlier demo's workdir resumes its extraction; any other files are not ours
        check_holds_only(workdir, WORKDIR_ENTRIES, "--workdir", "a demo's")
        if (workdir / RUN).exists():
            raise DFlashCacheError(f"{workdir} already holds a demo run; pass another --workdir or delete it.")
    assets = find_assets(Path(opts.assets), opts.train_data)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="dflash-demo-"))
    cache, run = workdir / CACHE, workdir / RUN
    target = assets / "target"
    layers = opts.layers or list(range(read_target_info(target).num_layers))
    seconds: dict[str, float] = {}
    echo(f"workdir {workdir}")

    started = time.perf_counter()
    data = write_subset(assets / "data" / opts.train_data, workdir / DATA / opts.train_data, opts.train_samples)
    extracted = extract(
        ExtractOptions(
            target=target,
            data=[data],
            out=cache,
            layers=layers,
            codec=opts.codec,
            gpus=[0] if torch.cuda.is_available() else None,
        )
    )
    seconds["extract"] = time.perf_counter() - started
    echo(
        f"extract: {extracted.samples} conversations of {opts.train_data}, {extracted.tokens} tokens, layers {layers} -> {cache} "
        f"({opts.codec}, {extracted.bytes / max(extracted.tokens, 1):.0f} bytes/token, {seconds['extract']:.0f} s)"
    )

    started = time.perf_counter()
    checkpoint, train_tau = _train(opts, target, layers, workdir, echo)
    seconds["train"] = time.perf_counter() - started
    echo(
        f"train: {opts.steps} steps of a {opts.drafter_layers}-layer drafter (block size {opts.block_size}) -> "
        f"{checkpoint} (training tau {train_tau:.2f}, {seconds['train']:.0f} s)"
    )

    started = time.perf_counter()
    heldout = assets / "data" / "heldout.jsonl"
    report = evaluate_speculative(
        SpeculativeOptions(
            drafter=checkpoint,
            target=target,
            data=[heldout],
            max_new_tokens=opts.max_new_tokens,
            num_prompts=opts.eval_prompts,
        )
    )
    seconds["eval"] = time.perf_counter() - started
    return DemoResult(workdir, target, heldout, cache, run, checkpoint, extracted, train_tau, report, seconds)


def _train(
    opts: DemoOptions, target: Path, layers: list[int], workdir: Path, echo: Callable[[str], None]
) -> tuple[Path, float]:
    """Train the small drafter on the demo's cache; returns its checkpoint and its training tau over
    the last tenth of the steps."""
    run = workdir / RUN
    config_file = workdir / DRAFTER_FILE
    config = drafter_config(target, layers, opts.drafter_layers, opts.block_size)
    config_file.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    train(
        TrainConfig(
            caches=[str(workdir / CACHE)],
            out=str(run),
            drafter=str(config_file),
            steps=opts.steps,
            gpus=[0] if torch.cuda.is_available() else None,
            token_budget=opts.token_budget,
            max_anchors=opts.max_anchors,
            eval_fraction=0.0,
            save_every=opts.steps,
            log_every=max(1, opts.steps // 10),
            seed=opts.seed,
            prefetch=2,
            workers=2,
        ),
        echo=lambda line: echo(f"  {line}") if line.startswith("step ") else None,
    )
    records = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    last = [r["tau"] for r in records if "tau" in r][-max(1, opts.steps // 10) :]
    return latest_checkpoint(run), sum(last) / len(last)
