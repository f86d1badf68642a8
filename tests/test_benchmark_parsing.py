"""benchmarks/extract_cold.py reads the figures of a GPU run from the CLI's own output: its patterns
must match what the CLI prints, large numbers included (a mismatch costs a whole device call)."""

from benchmarks.extract_cold import RANK_LINE
from dflash_cache.extract.worker import RankSummary
from dflash_cache_cli.extract_cmd import rank_line


def test_rank_line_is_read_back_with_thousands_separators():
    line = rank_line(RankSummary(rank=0, tokens=1_004_184, compute_s=34.0, wait_s=10.4, compile_s=2.1))
    match = RANK_LINE.search(line)
    assert match, line
    assert match.group(1) == "1,004,184" and match.group(2) == "29,535" and match.group(3) == "2.1"
