import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.data.tokenize import tokenize_conversation
from dflash_cache.extract.pipeline import ExtractEvents, ExtractOptions, extract
from dflash_cache.store.verify import verify_cache
from dflash_cache.target.runner import TargetRunner
from tests.tiny import write_conversations

LAYERS = [1, 4]


def run_extract(target, data, out, **kw):
    opts = ExtractOptions(
        target=target, data=[data], out=out, layers=LAYERS, token_budget=kw.pop("token_budget", 300), **kw
    )
    return extract(opts)


def test_cache_matches_hf_reference(target_dir, conversations, tmp_path):
    """Stored hidden states equal HF's hidden states of those layers, target_ids its argmax,
    loss masks the assistant tokens; for a dense qwen3 and a hybrid qwen3_5 target."""
    run_extract(target_dir, conversations, tmp_path / "cache", topk=3)
    cache = open_cache(tmp_path / "cache")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    import json

    convs = [json.loads(line)["messages"] for line in open(conversations)]
    assert sorted(cache) == list(range(len(convs)))
    for sid in sorted(cache):
        sample = cache[sid]
        ids, mask = tokenize_conversation(tokenizer, convs[sid])
        assert sample.input_ids.tolist() == ids and sample.loss_mask.tolist() == [bool(m) for m in mask]
        with torch.no_grad():
            out = model(sample.input_ids[None], output_hidden_states=True)
        ref = torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)
        # Packed with other samples vs alone: same math, but bf16 kernels of other shapes round
        # differently, so an argmax may flip between logits a rounding step apart, never further.
        torch.testing.assert_close(sample.hidden.float(), ref.float(), atol=2e-2, rtol=2e-2)
        logits = out.logits[0].float()
        step = 2 * torch.finfo(torch.bfloat16).eps * logits.abs().amax(-1)
        for ids in (sample.target_ids, sample.topk_ids[:, 0]):
            gap = logits.amax(-1) - logits.gather(1, ids[:, None])[:, 0]
            assert (gap <= step).all() and (gap == 0).float().mean() >= 0.9
    masked = tokenizer.decode(cache[0].input_ids[cache[0].loss_mask])
    assert convs[0][-1]["content"] in masked and "user" not in masked.split(convs[0][-1]["content"])[-1]


def test_spec_mismatch_and_bad_input(qwen3_target_dir, conversations, tmp_path):
    out = tmp_path / "cache"
    run_extract(qwen3_target_dir, conversations, out)
    before = (out / "manifest.json").read_bytes()
    with pytest.raises(DFlashCacheError, match="codec: bf16-zstd -> fp8-zstd"):
        run_extract(qwen3_target_dir, conversations, out, codec="fp8-zstd")
    with pytest.raises(DFlashCacheError, match="out of range"):
        extract(ExtractOptions(target=qwen3_target_dir, data=[conversations], out=tmp_path / "x", layers=[1, 99]))
    with pytest.raises(DFlashCacheError, match="unknown codec"):
        run_extract(qwen3_target_dir, conversations, tmp_path / "y", codec="zip")
    with pytest.raises(DFlashCacheError, match="does not exist"):
        run_extract(qwen3_target_dir, tmp_path / "missing.jsonl", tmp_path / "z")
    with pytest.raises(DFlashCacheError, match="GPU 3 is not visible"):
        run_extract(qwen3_target_dir, conversations, tmp_path / "w", gpus=[3])
    with pytest.raises(DFlashCacheError, match="token budget|token-budget"):
        run_extract(qwen3_target_dir, conversations, tmp_path / "v", token_budget=-5)
    assert (out / "manifest.json").read_bytes() == before


def test_second_run_on_same_out_is_refused(qwen3_target_dir, conversations, tmp_path):
    from dflash_cache.files.lock import FolderLock

    out = tmp_path / "cache"
    holder = FolderLock(out, "cache").acquire()
    try:
        with pytest.raises(DFlashCacheError, match=f"being written by pid {os.getpid()}"):
            run_extract(qwen3_target_dir, conversations, out)
    finally:
        holder.release()


def cli(*args, env=None, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_cache_cli.main", *map(str, args)],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def extract_args(target, data, out):
    return [
        "extract",
        "--target",
        target,
        "--data",
        data,
        "--out",
        out,
        "--layers",
        ",".join(map(str, LAYERS)),
        "--token-budget",
        300,
        "--shard-size",
        0.02,
    ]


def extract_killed_at(target, data, out, kill_at: str) -> None:
    """The CLI run killed by SIGKILL at the fault point `kill_at` (DFLASH_CACHE_KILL_AT)."""
    proc = cli(*extract_args(target, data, out), env={"DFLASH_CACHE_KILL_AT": kill_at})
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL


def assert_same_cache(a: Path, b: Path):
    """Bit for bit: a sample is computed in the same batch, in the same shape, whichever run computes
    it. That holds across processes only while they run the same CPU kernels (docs/FAULTS.md, "Not
    covered"); a failure says how far apart the samples are, to tell kernel rounding from a bug."""
    ca, cb = open_cache(a), open_cache(b)
    assert sorted(ca) == sorted(cb)
    for sid in ca:
        x, y = ca[sid], cb[sid]
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        same = torch.equal(x.target_ids, y.target_ids) and torch.equal(
            x.hidden.view(torch.int16), y.hidden.view(torch.int16)
        )
        assert same, describe_difference(sid, x, y)
    verify_cache(cb)


def describe_difference(sid: int, x, y) -> str:
    """Where two versions of one sample differ: the argmax positions and how many hidden values, how far."""
    flips = (x.target_ids != y.target_ids).nonzero().flatten().tolist()
    differ = x.hidden.view(torch.int16) != y.hidden.view(torch.int16)
    tokens = differ.any(-1).nonzero().flatten().tolist()
    gap = float((x.hidden.float() - y.hidden.float()).abs().max())
    return (
        f"sample {sid} ({len(x.input_ids)} tokens): target_ids differ at {flips[:8]} "
        f"({[(int(x.target_ids[i]), int(y.target_ids[i])) for i in flips[:3]]}); {int(differ.sum())} of "
        f"{differ.numel()} hidden values differ, from token {tokens[:1]}, by up to {gap:.3g} "
        f"(values up to {float(x.hidden.float().abs().max()):.3g})"
    )


@pytest.fixture(scope="module")
def crash_setup(tmp_path_factory):
    from tests.tiny import build_target

    root = tmp_path_factory.mktemp("crash")
    target = build_target(root / "target", "qwen3")
    data = write_conversations(root / "data.jsonl", count=16, seed=3)
    reference = root / "reference"
    run_extract(target, data, reference, max_shard_bytes=int(0.02 * (1 << 20)))
    return target, data, reference


@pytest.mark.parametrize(
    "kill_at",
    ["extract.forward:3", "extract.compress:7", "shard.before_rename:2", "shard.before_journal:1", "manifest.write:1"],
)
def test_sigkill_then_resume_equals_uninterrupted(crash_setup, tmp_path, kill_at):
    target, data, reference = crash_setup
    out = tmp_path / "cache"
    extract_killed_at(target, data, out, kill_at)
    assert not (out / "manifest.json").exists() or kill_at == "manifest.write:1"
    run_extract(target, data, out, max_shard_bytes=int(0.02 * (1 << 20)))
    assert_same_cache(reference, out)


def test_resume_with_another_process_count(crash_setup, tmp_path):
    """Killed with one process, finished by two (torchrun-style ranks), equal to one uninterrupted run."""
    target, data, reference = crash_setup
    out = tmp_path / "cache"
    extract_killed_at(target, data, out, "shard.committed:3")
    done_before = sum(1 for p in (out / "shards").iterdir())
    assert done_before >= 3
    ranks = [
        cli(*extract_args(target, data, out), env={"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)})
        for r in range(2)
    ]
    for p in ranks:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        # stderr is a pipe, not a terminal: plain progress lines instead of tqdm's (which shows none there)
        assert re.search(
            r"^extract: [\d,]+/[\d,]+ samples, [\d,]+ tokens/s, [\d.,]+ [MG]B written, .* ETA ", err, re.M
        ), err
    assert {p.name.split("-")[0] for p in (out / "shards").iterdir()} == {"r0", "r1"}
    assert_same_cache(reference, out)


def test_the_summary_after_a_resume_gives_the_caches_totals_and_this_runs_share(crash_setup, tmp_path):
    import json

    from click.testing import CliRunner

    from dflash_cache_cli.main import main

    target, data, _ = crash_setup
    out = tmp_path / "cache"
    extract_killed_at(target, data, out, "shard.committed:3")
    entries = [json.loads(line) for line in (out / "journal" / "r0.jsonl").read_text().splitlines()]
    committed = [e["shard"] for e in entries if "shard" in e]
    before_samples, before_tokens = sum(s["rows"] for s in committed), sum(s["tokens"] for s in committed)
    assert len(committed) == 3 and before_samples > 0
    result = CliRunner().invoke(main, list(map(str, extract_args(target, data, out))))
    assert result.exit_code == 0, result.output
    totals = json.loads((out / "manifest.json").read_text())["totals"]
    assert totals["samples"] == 16 and before_samples < 16
    line = next(line for line in result.output.splitlines() if line.startswith("done: "))
    assert line.startswith(
        f"done: {totals['samples']:,} samples ({totals['samples'] - before_samples:,} this run), "
        f"{totals['tokens']:,} tokens ({totals['tokens'] - before_tokens:,} this run), "
        f"{totals['bytes'] / totals['tokens']:,.0f} bytes/token, "
    ), line


def test_a_complete_cache_reruns_without_loading_the_target(qwen3_target_dir, conversations, tmp_path, monkeypatch):
    from dflash_cache.extract import worker

    out = tmp_path / "cache"
    run_extract(qwen3_target_dir, conversations, out)
    manifest = (out / "manifest.json").read_bytes()

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded for a complete cache")

    monkeypatch.setattr(worker, "load_target", refuse)
    summary = run_extract(qwen3_target_dir, conversations, out)
    assert summary.already_complete and summary.samples == 0
    assert (out / "manifest.json").read_bytes() == manifest


def test_the_cpu_takes_a_token_budget_it_can_run_and_reports_progress_row_by_row(
    qwen3_target_dir, tmp_path, monkeypatch
):
    """No --token-budget on the CPU: 4,096 tokens per forward (not a GPU's 49,152, which put a
    small dataset in one row and showed no progress until the end): rows of at most 4,096 tokens,
    each reporting its samples as it is written."""
    data = write_conversations(tmp_path / "many.jsonl", count=160)
    reports, rows = [], []
    real = TargetRunner.run_batch
    monkeypatch.setattr(
        TargetRunner, "run_batch", lambda self, fb, *a: rows.append(fb.input_ids.numel()) or real(self, fb, *a)
    )

    class Reports(ExtractEvents):
        def progress(self, progress) -> None:
            if progress.samples:
                reports.append(progress.samples)

    summary = extract(
        ExtractOptions(target=qwen3_target_dir, data=[data], out=tmp_path / "cache", layers=LAYERS),
        Reports(),
    )
    assert summary.manifest["spec"]["token_budget"] == 4096
    assert max(rows) == 4096 and len(rows) > 2 and summary.tokens > 2 * 4096  # the warm-up row included
    assert sum(reports) == summary.samples == 160
