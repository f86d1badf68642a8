"""Extraction and a training run that follows it (`train --follow`) at once, against each alone: on one GPU,
or on GPUs of their own (the eight-GPU layout: `extract --gpus 0-4` beside `train --follow --gpus 5-7`).

    python -m benchmarks.follow --work /tmp/follow [--shape qwen3-0.6b] [--tokens 3000000] [--token-budget 49152]
        [--command "dflash-cache"] [--json FILE]      # BENCHMARKS.md, "Training beside its extraction"
    python -m benchmarks.follow --work /tmp/follow --shape tiny --tokens 20000 --token-budget 2048 --device cpu

The eight-GPU layout (one host of eight 80 GB GPUs; the target about 30 GB, the cache about 100 GB):

    python -m benchmarks.follow --work /data/follow8 --shape qwen3.6-27b-cut --layers-cut 32 --tokens 2000000 \
        --extract-gpus 0-4 --train-gpus 5-7 --json follow8.json

(`--train-launch torchrun` starts training as `CUDA_VISIBLE_DEVICES=5,6,7 torchrun --nproc-per-node 3 -m
dflash_cache_cli.main train ...` instead of README's `train --gpus 5-7`.)

1. A random-weight target (--shape: qwen3-0.6b's shape, 28 layers, hidden 1024; Qwen3.6-27B's hybrid shape
   cut to --layers-cut layers; or tiny) saved as a model directory with a tokenizer covering its
   vocabulary; pre-tokenized random records (lengths lognormal around 2,600 tokens) as a parquet file
   of `input_ids`.
2. Alone: `extract --gpus E` at its defaults, then `train --drafter target --steps S --gpus T` on the
   finished cache, S being nine tenths of its first epoch over T's ranks (so the followed run below stays
   in the epoch that follows).
3. At once: the cache deleted, `train --follow` with the same options started, then a fresh `extract`.
4. `dflash-cache verify` on the finished cache; then a third `train --follow` on it, killed (SIGKILL, the
   `train.step` fault point) after three quarters of its steps, with a checkpoint at half, and the same
   command with `--resume`: it must reach step S, and the steps it trained again must have the losses the
   killed run logged for them.

Each side's tokens/s is read from its own output: extraction's `rank R: N tokens, X tokens/s` lines (summed
over its ranks; also its tokens over its wall time), and the
trainer's per-step figures (metrics.jsonl: tokens over step seconds, what its progress lines print) beside
its tokens over the wall time from its first step to its last (which counts waits for shards). Also: the
seconds from starting both to the drafter's first step, and from then to the extraction's end.

Smoke-tested on the CPU only (`--shape tiny --device cpu`, both launches, two CPU training processes under
torchrun). The GPU split, the qwen3.6-27b-cut shape on GPUs and the eight-GPU layout have never run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from benchmarks.extract_cold import write_data
from benchmarks.targets import VOCAB, target_config, word_tokenizer
from dflash_cache.train.distributed import free_port
from dflash_cache_cli.options import INT_LIST

RANK_LINE = re.compile(r"rank (\d+): ([\d,]+) tokens, ([\d,]+) tokens/s")  # extract's summary line, one per rank

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
CUT = "qwen3.6-27b-cut"


def shape_config(shape: str, layers_cut: int | None):
    return target_config(CUT, layers_cut) if shape == CUT else SHAPES[shape]()


@dataclass
class Run:
    """A CLI process whose output lines are kept with the second each arrived (from `t0`)."""

    argv: list[str]
    log: Path
    t0: float
    env: dict[str, str] = field(default_factory=dict)
    lines: list[tuple[float, str]] = field(default_factory=list)

    def start(self) -> Run:
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1"} | self.env,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter() - self.t0, line))

    def wait(self, check: bool = True) -> float:
        rc = self.proc.wait()
        self.reader.join()
        end = time.perf_counter() - self.t0
        env = "".join(f"{k}={v} " for k, v in self.env.items())
        self.log.write_text(
            f"$ {env}{shlex.join(self.argv)}\n" + "".join(f"[{t:7.1f}] {s}" for t, s in self.lines) + f"exit {rc}\n"
        )
        if check and rc != 0:
            tail = "".join(s for _, s in self.lines[-5:])
            raise SystemExit(f"{self.log.stem} failed (exit {rc}); see {self.log}:\n{tail}")
        return end

    def first(self, prefix: str) -> float | None:
        return next((t for t, s in self.lines if s.startswith(prefix)), None)

    def last(self, prefix: str) -> float | None:
        return next((t for t, s in reversed(self.lines) if s.startswith(prefix)), None)


def save_target(folder: Path, config, device: str) -> int:
    """The parameter count; the weights are random (seed 0)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="4GB")
    word_tokenizer(config.vocab_size).save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return params


def extraction_rate(run: Run, wall_s: float) -> dict:
    """Summed over the ranks: each rank's tokens over its own compute seconds, as its line prints them."""
    ranks = RANK_LINE.findall("".join(s for _, s in run.lines))
    if not ranks:
        raise SystemExit(f"extract printed no `rank R: N tokens, X tokens/s` line ({run.log}): update RANK_LINE")
    tokens = sum(int(n.replace(",", "")) for _, n, _ in ranks)
    return {
        "ranks": len(ranks),
        "tokens": tokens,
        "tok_s": sum(float(r.replace(",", "")) for _, _, r in ranks),
        "wall_tok_s": tokens / wall_s,
    }


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


def losses(folder: Path) -> dict[int, float]:
    records = map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "tokens_per_s" in r}


def gpu_list(text: str) -> list[int]:
    return INT_LIST.convert(text, None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/follow"))
    parser.add_argument("--shape", choices=[*SHAPES, CUT], default="qwen3-0.6b")
    parser.add_argument("--layers-cut", type=int, default=None, help=f"{CUT}: its layers (default: all 64)")
    parser.add_argument("--tokens", type=int, default=3_000_000)
    parser.add_argument("--token-budget", type=int, default=49152, help="train --token-budget (its default on a GPU)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--extract-gpus", type=gpu_list, default=[0], help="extract --gpus (e.g. 0-4)")
    parser.add_argument("--train-gpus", type=gpu_list, default=[0], help="train --gpus (e.g. 5-7)")
    parser.add_argument(
        "--train-launch",
        choices=["gpus", "torchrun"],
        default="gpus",
        help="train --gpus T (README's form), or CUDA_VISIBLE_DEVICES=T torchrun --nproc-per-node len(T) "
        "(on the CPU: len(T) processes)",
    )
    parser.add_argument("--command", default="dflash-cache", help="how to call the CLI")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    target, data, cache, logs = args.work / "target", args.work / "data.parquet", args.work / "cache", args.work
    config = shape_config(args.shape, args.layers_cut)
    params = save_target(target, config, args.device)
    rows = write_data(data, args.tokens, config.vocab_size)
    tokens = sum(map(len, rows))
    ranks = len(args.train_gpus) if args.device == "cuda" or args.train_launch == "torchrun" else 1
    steps = max(4, int(0.9 * tokens / (args.token_budget * ranks)))
    print(
        f"target {args.shape} ({config.num_hidden_layers} layers), {params / 1e6:.0f}M parameters; "
        f"{len(rows)} records, {tokens} tokens; {steps} steps over {ranks} training rank(s)",
        flush=True,
    )

    cli = shlex.split(args.command)
    on_gpu = args.device == "cuda"
    extract = [*cli, "extract", "--target", str(target), "--data", str(data), "--out", str(cache)]
    extract += ["--gpus", ",".join(map(str, args.extract_gpus))] if on_gpu else []
    train_env: dict[str, str] = {}
    if args.train_launch == "torchrun":
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        trainer = [*torchrun, "--master-addr", "127.0.0.1", "--master-port", "PORT", "-m", "dflash_cache_cli.main"]
        train_env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, args.train_gpus))} if on_gpu else {}
        gpus = []
    else:
        trainer = cli
        gpus = ["--gpus", ",".join(map(str, args.train_gpus))] if on_gpu else []

    def train(out: Path, *extra: str, save_every: int = steps) -> list[str]:
        launcher = [str(free_port()) if a == "PORT" else a for a in trainer]
        return [
            *launcher,
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
            str(save_every),
            "--log-every",
            "1",
            *gpus,
            *extra,
        ]

    t0 = time.perf_counter()
    run = Run(extract, logs / "extract-alone.log", t0).start()
    wall = run.wait()
    alone = {"extract": {"wall_s": wall} | extraction_rate(run, wall)}
    t0 = time.perf_counter()
    run = Run(train(args.work / "run-alone"), logs / "train-alone.log", t0, train_env).start()
    alone["train"] = {"wall_s": run.wait()} | training_rate(run, args.work / "run-alone")
    shutil.rmtree(cache)

    t0 = time.perf_counter()
    training = Run(train(args.work / "run-follow", "--follow"), logs / "train-follow.log", t0, train_env).start()
    extraction = Run(extract, logs / "extract-beside.log", t0).start()
    extract_end = extraction.wait()
    train_end = training.wait()
    together = {
        "extract": {"wall_s": extract_end} | extraction_rate(extraction, extract_end),
        "train": {"wall_s": train_end} | training_rate(training, args.work / "run-follow"),
    }
    first_step = together["train"]["first_step_s"]
    checks = {"verify": verify(cli, cache, logs), "resume": resume(train, steps, train_env, logs, args.work)}
    result = {
        "shape": args.shape,
        "layers": config.num_hidden_layers,
        "params": params,
        "tokens": tokens,
        "steps": steps,
        "token_budget": args.token_budget,
        "extract_gpus": args.extract_gpus if on_gpu else "cpu",
        "train_gpus": args.train_gpus if on_gpu else "cpu",
        "train_launch": args.train_launch,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "alone": alone,
        "together": together,
        "first_step_before_extract_end_s": extract_end - first_step,
        "checks": checks,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(
        f"\n| side | alone tok/s | together tok/s | wall alone / together (s) |\n| --- | ---: | ---: | ---: |\n"
        f"| extract (ranks / wall) | {alone['extract']['tok_s']:,.0f} / {alone['extract']['wall_tok_s']:,.0f} | "
        f"{together['extract']['tok_s']:,.0f} / {together['extract']['wall_tok_s']:,.0f} | "
        f"{alone['extract']['wall_s']:.1f} / {extract_end:.1f} |\n"
        f"| train (step / wall) | {alone['train']['tok_s']:,.0f} / {alone['train']['wall_tok_s']:,.0f} | "
        f"{together['train']['tok_s']:,.0f} / {together['train']['wall_tok_s']:,.0f} | "
        f"{alone['train']['wall_s']:.1f} / {train_end:.1f} |\n\n"
        f"first drafter step {first_step:.1f} s after both started, {extract_end - first_step:.1f} s before "
        f"the extraction ended ({extract_end:.1f} s); one after the other: "
        f"{alone['extract']['wall_s'] + alone['train']['wall_s']:.1f} s, at once: {max(extract_end, train_end):.1f} s\n"
        f"verify: {checks['verify']['line']}; resume: {checks['resume']['line']}"
    )
    if not (checks["verify"]["ok"] and checks["resume"]["ok"]):
        raise SystemExit("the finished cache did not verify or the run did not resume: see the logs in --work")


def verify(cli: list[str], cache: Path, logs: Path) -> dict:
    run = Run([*cli, "verify", str(cache)], logs / "verify.log", time.perf_counter()).start()
    wall = run.wait(check=False)
    last = run.lines[-1][1].strip() if run.lines else ""
    return {"ok": run.proc.returncode == 0, "wall_s": wall, "line": last}


def resume(train, steps: int, env: dict[str, str], logs: Path, work: Path) -> dict:
    """A followed run on the finished cache, killed after 3/4 of its steps, then resumed from its checkpoint at half."""
    half, killed_at = steps // 2, 3 * steps // 4
    out = work / "run-resume"
    command = train(out, "--follow", save_every=half)
    kill = {"DFLASH_CACHE_KILL_AT": f"train.step:{killed_at}"}
    killed = Run(command, logs / "train-killed.log", time.perf_counter(), env | kill).start()
    killed.wait(check=False)
    before = losses(out)
    resumed = Run(
        train(out, "--follow", "--resume", save_every=half), logs / "train-resumed.log", time.perf_counter(), env
    ).start()
    resumed.wait(check=False)
    after = losses(out)
    again = [s for s in before if half < s <= killed_at]
    same = [s for s in again if after.get(s) == before[s]]
    ok = killed.proc.returncode != 0 and resumed.proc.returncode == 0 and max(after, default=0) == steps
    ok = ok and len(same) == len(again) > 0
    return {
        "ok": ok,
        "killed_exit": killed.proc.returncode,
        "killed_after_step": max(before, default=0),
        "resumed_exit": resumed.proc.returncode,
        "last_step": max(after, default=0),
        "steps_trained_again": len(again),
        "same_loss": len(same),
        "line": f"killed after step {max(before, default=0)} (exit {killed.proc.returncode}), resumed from step "
        f"{half} to {max(after, default=0)}/{steps} (exit {resumed.proc.returncode}), "
        f"{len(same)}/{len(again)} steps trained again with the same loss",
    }


if __name__ == "__main__":
    main()
