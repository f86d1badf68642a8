"""Extraction and a training run that follows it (`train --follow`) on one GPU at once, against each alone.

    python -m benchmarks.follow --work /tmp/follow [--shape qwen3-0.6b] [--tokens 3000000] [--token-budget 49152]
        [--command "dflash-cache"] [--json FILE]      # BENCHMARKS.md, "Training beside its extraction"
    python -m benchmarks.follow --work /tmp/follow --shape tiny --tokens 20000 --token-budget 2048 --device cpu

1. A random-weight Qwen3 target (--shape: qwen3-0.6b's shape, 28 layers, hidden 1024; or tiny) saved as a
   model directory with a tokenizer covering its vocabulary; pre-tokenized random records (lengths
   lognormal around 2,600 tokens) as a parquet file of `input_ids`.
2. Alone: `extract` at its defaults, then `train --drafter target --steps S` on the finished cache, S being
   nine tenths of its first epoch (so the followed run below stays in the epoch that follows).
3. At once: the cache deleted, `train --follow` with the same options started, then a fresh `extract`.

Each side's tokens/s is read from its own output: extraction's `rank 0: N tokens, R tokens/s` line, and the
trainer's per-step figures (metrics.jsonl: tokens over step seconds, what its progress lines print) beside
its tokens over the wall time from its first step to its last (which counts waits for shards). Also: the
seconds from starting both to the drafter's first step, and from then to the extraction's end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from benchmarks.extract_cold import write_data
from benchmarks.targets import VOCAB, target_config, word_tokenizer

RANK_LINE = re.compile(r"rank 0: ([\d,]+) tokens, ([\d,]+) tokens/s")  # extract's summary line

SHAPES = {
    "qwen3-0.6b": lambda: Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    "tiny": lambda: target_config("tiny"),
}


@dataclass
class Run:
    """A CLI process whose output lines are kept with the second each arrived (from `t0`)."""

    argv: list[str]
    log: Path
    t0: float
    lines: list[tuple[float, str]] = field(default_factory=list)

    def start(self) -> Run:
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1"},
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter() - self.t0, line))

    def wait(self) -> float:
        rc = self.proc.wait()
        self.reader.join()
        end = time.perf_counter() - self.t0
        self.log.write_text("$ " + shlex.join(self.argv) + "\n" + "".join(f"[{t:7.1f}] {s}" for t, s in self.lines))
        if rc != 0:
            tail = "".join(s for _, s in self.lines[-5:])
            raise SystemExit(f"{self.log.stem} failed (exit {rc}); see {self.log}:\n{tail}")
        return end

    def first(self, prefix: str) -> float | None:
        return next((t for t, s in self.lines if s.startswith(prefix)), None)

    def last(self, prefix: str) -> float | None:
        return next((t for t, s in reversed(self.lines) if s.startswith(prefix)), None)


def save_target(folder: Path, shape: str, device: str) -> int:
    """The parameter count; the weights are random (seed 0)."""
    config = SHAPES[shape]()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    word_tokenizer(config.vocab_size).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def extraction_rate(run: Run) -> dict:
    text = "".join(s for _, s in run.lines)
    match = RANK_LINE.search(text)
    if match is None:
        raise SystemExit(f"extract printed no `rank 0: N tokens, R tokens/s` line ({run.log}): update RANK_LINE")
    return {"tokens": int(match.group(1).replace(",", "")), "tok_s": float(match.group(2).replace(",", ""))}


def training_rate(run: Run, folder: Path) -> dict:
    steps = [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "tokens_per_s" in r]
    first, last = run.first("step 1/"), run.last("step ")
    tokens = sum(r["tokens"] for r in steps)
    return {
        "steps": len(steps),
        "tokens": tokens,
        "tok_s": tokens / sum(r["step_time_s"] for r in steps),
        # from the first step's line to the last's: the first step's own tokens are left out
        "wall_tok_s": (tokens - steps[0]["tokens"]) / max(last - first, 1e-9),
        "first_step_s": first,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/follow"))
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--tokens", type=int, default=3_000_000)
    parser.add_argument("--token-budget", type=int, default=49152, help="train --token-budget (its default on a GPU)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--command", default="dflash-cache", help="how to call the CLI")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    target, data, cache, logs = args.work / "target", args.work / "data.parquet", args.work / "cache", args.work
    params = save_target(target, args.shape, args.device)
    vocab = SHAPES[args.shape]().vocab_size
    rows = write_data(data, args.tokens, vocab)
    tokens = sum(map(len, rows))
    steps = max(1, int(0.9 * tokens / args.token_budget))
    print(f"target {args.shape}, {params / 1e6:.0f}M parameters; {len(rows)} records, {tokens} tokens", flush=True)

    cli = shlex.split(args.command)
    extract = [*cli, "extract", "--target", str(target), "--data", str(data), "--out", str(cache)]
    gpus = ["--gpus", "0"] if args.device == "cuda" else []

    def train(out: Path, *extra: str) -> list[str]:
        return [
            *cli,
            "train",
            "--cache",
            str(cache),
            "--out",
            str(out),
            "--steps",
            str(steps),
            "--token-budget",
            str(args.token_budget),
            "--eval-fraction",
            "0",
            "--save-every",
            str(steps),
            "--log-every",
            "1",
            *gpus,
            *extra,
        ]

    t0 = time.perf_counter()
    run = Run(extract, logs / "extract-alone.log", t0).start()
    alone = {"extract": {"wall_s": run.wait()} | extraction_rate(run)}
    t0 = time.perf_counter()
    run = Run(train(args.work / "run-alone"), logs / "train-alone.log", t0).start()
    alone["train"] = {"wall_s": run.wait()} | training_rate(run, args.work / "run-alone")
    shutil.rmtree(cache)

    t0 = time.perf_counter()
    training = Run(train(args.work / "run-follow", "--follow"), logs / "train-follow.log", t0).start()
    extraction = Run(extract, logs / "extract-beside.log", t0).start()
    extract_end = extraction.wait()
    train_end = training.wait()
    together = {
        "extract": {"wall_s": extract_end} | extraction_rate(extraction),
        "train": {"wall_s": train_end} | training_rate(training, args.work / "run-follow"),
    }
    first_step = together["train"]["first_step_s"]
    result = {
        "shape": args.shape,
        "params": params,
        "tokens": tokens,
        "steps": steps,
        "token_budget": args.token_budget,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "alone": alone,
        "together": together,
        "first_step_before_extract_end_s": extract_end - first_step,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(
        f"\n| side | alone tok/s | together tok/s | wall alone / together (s) |\n| --- | ---: | ---: | ---: |\n"
        f"| extract | {alone['extract']['tok_s']:,.0f} | {together['extract']['tok_s']:,.0f} | "
        f"{alone['extract']['wall_s']:.1f} / {extract_end:.1f} |\n"
        f"| train (step / wall) | {alone['train']['tok_s']:,.0f} / {alone['train']['wall_tok_s']:,.0f} | "
        f"{together['train']['tok_s']:,.0f} / {together['train']['wall_tok_s']:,.0f} | "
        f"{alone['train']['wall_s']:.1f} / {train_end:.1f} |\n\n"
        f"first drafter step {first_step:.1f} s after both started, {extract_end - first_step:.1f} s before "
        f"the extraction ended ({extract_end:.1f} s); one after the other: "
        f"{alone['extract']['wall_s'] + alone['train']['wall_s']:.1f} s, at once: {max(extract_end, train_end):.1f} s"
    )


if __name__ == "__main__":
    main()
