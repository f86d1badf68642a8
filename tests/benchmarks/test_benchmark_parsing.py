"""The benchmarks' parsing of other processes' output, checked on the CPU (a mismatch costs a whole
device call): benchmarks/extract_cold.py and benchmarks/follow.py read the CLI's own lines, large numbers
and several ranks included;
benchmarks/drafter.py --peer reads the JSON line of speculators' step script; benchmarks/quality.py reads
`eval --target`'s report."""

import os
import sys

import pytest

from benchmarks.drafter import run_peer
from benchmarks.extract_cold import RANK_LINE
from benchmarks.follow import Run, extraction_rate
from dflash_cache.extract.worker import RankSummary
from dflash_cache_cli.extract_cmd import rank_line


def test_rank_line_is_read_back_with_thousands_separators():
    line = rank_line(RankSummary(rank=0, tokens=1_004_184, compute_s=34.0, wait_s=10.4, compile_s=2.1))
    match = RANK_LINE.search(line)
    assert match, line
    assert match.group(1) == "1,004,184" and match.group(2) == "29,535" and match.group(3) == "2.1"


def test_the_cpu_rank_line_is_read_back_too():
    line = rank_line(RankSummary(rank=0, tokens=6_305, compute_s=2.0, compile_s=0.3, on_gpu=False))
    match = RANK_LINE.search(line)
    assert match, line
    assert (match.group(1), match.group(2), match.group(3)) == ("6,305", "3,152", "0.3")


def test_follow_sums_the_rank_lines_of_a_five_gpu_extraction(tmp_path):
    """Five ranks of 1,000,000 tokens in 40, 50, 40, 50 and 80 s: 25,000 + 20,000 + 25,000 + 20,000 + 12,500."""
    run = Run([], tmp_path / "log", 0.0)
    run.lines = [(0.0, "done: 5,000,000 tokens\n")] + [
        (0.0, rank_line(RankSummary(rank=r, tokens=1_000_000, compute_s=s)) + "\n")
        for r, s in enumerate([40.0, 50.0, 40.0, 50.0, 80.0])
    ]
    rate = extraction_rate(run, wall_s=100.0)
    assert rate == {"ranks": 5, "tokens": 5_000_000, "tok_s": 102_500.0, "wall_tok_s": 50_000.0}


PEER_STANDIN = """
import json, os, sys, time
print("compiling...", flush=True)
if os.environ["T"] != "0":
    print(json.dumps({"real_tokens_per_s": 1000.0, "T": int(os.environ["T"]), "max_anchors": int(os.environ["MAX_ANCHORS"]),
                      "pid": os.getpid()}), flush=True)
    time.sleep(600)  # the real script was seen to linger after its line
"""


def test_the_speculators_step_runs_with_our_shape_and_is_stopped_once_it_has_printed_its_line(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(PEER_STANDIN)
    result = run_peer(f"{sys.executable} {script}", tokens=4096, anchors=64)
    assert (result["real_tokens_per_s"], result["T"], result["max_anchors"]) == (1000.0, 4096, 64)
    with pytest.raises(ProcessLookupError):
        os.kill(result["pid"], 0)
    with pytest.raises(SystemExit, match="no result line"):
        run_peer(f"{sys.executable} {script}", tokens=0, anchors=64)


def test_quality_reads_eval_target_lines():
    """Four cycles accepting 0, 1, 3 and 0 drafts of a block of 4, 10 new tokens in 8 target forwards."""
    from benchmarks.quality import parse_eval
    from dflash_cache.eval.speculative import SpeculativeReport

    report = SpeculativeReport(
        drafter="d",
        block_size=4,
        prompts=1,
        new_tokens=10,
        target_forwards=8,
        accepted=[0, 1, 3, 0],
        speculative_s=1.0,
        greedy_s=2.0,
    )
    parsed = parse_eval("\n".join(["drafter d", *report.lines()]))
    assert parsed.tau == 2.0 and parsed.tokens_per_forward == 1.25
    assert parsed.acceptance == [0.5, 0.25, 0.25]
