import re
import time

from dflash_cache.console.progress import ProgressLog, duration


def test_lines_come_on_a_timer_even_without_updates_and_once_at_close():
    lines = []
    log = ProgressLog("extract", total_samples=10, total_tokens=1000, echo=lines.append, every_s=0.05).start()
    time.sleep(0.18)  # nothing done yet (a target loading): the run still says it is alive
    assert len(lines) >= 2 and all(" 0/10 samples" in line and "ETA unknown" in line for line in lines)
    log.update(samples=4, tokens=400, bytes=2_500_000_000)
    log.close()
    last = lines[-1]
    assert re.fullmatch(
        r"extract: 4/10 samples, [\d,]+ tokens/s, 2\.50 GB written, 0:00:00 elapsed, ETA 0:00:0\d", last
    ), last
    count = len(lines)
    time.sleep(0.12)
    assert len(lines) == count  # stopped


def test_duration():
    assert duration(0) == "0:00:00" and duration(3725.9) == "1:02:05" and duration(90000) == "25:00:00"


def test_without_totals_there_is_no_eta_and_without_writes_no_bytes():
    lines = []
    log = ProgressLog("tokenize", None, None, echo=lines.append, writes=False).start()
    log.update(samples=1234, tokens=56789)
    log.close()
    assert re.fullmatch(r"tokenize: 1,234 samples, [\d,]+ tokens/s, 0:00:00 elapsed", lines[-1]), lines[-1]
