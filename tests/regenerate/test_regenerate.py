"""`dflash-cache regenerate`: conversations answered again by the target, through a real
OpenAI-compatible server (`transformers serve`) or in-process, resumable after kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from dflash_cache.data.readers import read_records
from dflash_cache.errors import DFlashCacheError
from dflash_cache.regenerate.client import RetryPolicy
from dflash_cache.regenerate.conversations import Completion, regenerate_conversation
from dflash_cache.regenerate.output import ResponsesFile
from dflash_cache.regenerate.run import RegenerateOptions, regenerate
from dflash_cache.regenerate.settings import GenerationSettings
from dflash_cache.target.precision import generation_dtype
from dflash_cache.train.distributed import free_port
from dflash_cache_cli.main import main
from tests.support.chatservers import TARGET, ScriptedServer, read_jsonl, write_jsonl

FAST = RetryPolicy(attempts=3, first_delay_s=0.01, max_delay_s=0.02)
BUNDLED = TARGET.parent / "data" / "train.jsonl"


def conversation(*turns: str, system: str | None = None) -> dict:
    roles = ["user", "assistant"] * len(turns)
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": messages + [{"role": r, "content": t} for r, t in zip(roles, turns)]}


def completion(content: str, reasoning: str | None = None) -> Completion:
    return Completion(content, reasoning, None, "stop", 2, "m")


@pytest.fixture
def servers():
    started: list[ScriptedServer] = []

    def start(**kwargs) -> ScriptedServer:
        started.append(ScriptedServer(**kwargs))
        return started[-1]

    yield start
    for server in started:
        server.close()


# ---- conversations and the output file --------------------------------------------------------------


def test_turns_all_sees_new_earlier_turns_and_last_keeps_them():
    messages = conversation("q1", "old a1", "q2", "old a2", system="sys")["messages"]
    seen = []

    def complete(history):
        seen.append(history)
        return completion(f"new {len(seen)}", reasoning=f"why {len(seen)}")

    out, completions = regenerate_conversation(messages, "all", complete)
    assert [m.get("content") for m in out] == ["sys", "q1", "new 1", "q2", "new 2"]
    assert out[2] == {"role": "assistant", "content": "new 1", "reasoning_content": "why 1"}
    # the second request sees the first new answer, without its reasoning
    assert seen[1] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "new 1"},
        {"role": "user", "content": "q2"},
    ]
    assert len(completions) == 2

    seen.clear()
    out, _ = regenerate_conversation(messages, "last", complete)
    assert [m["content"] for m in out] == ["sys", "q1", "old a1", "q2", "new 1"]
    assert seen[0][-2:] == [{"role": "assistant", "content": "old a1"}, {"role": "user", "content": "q2"}]


def _record(source: str, settings: GenerationSettings, model: str = "m") -> dict:
    return {"messages": [], "source": source, "generation": {**settings.to_dict(), "model": model}}


def test_output_cuts_a_torn_line_and_refuses_other_settings(tmp_path):
    settings = GenerationSettings(max_tokens=64)
    path = tmp_path / "out.jsonl"
    with ResponsesFile(path, settings) as out:
        out.append(_record("a.jsonl:1", settings))
        out.append(_record("a.jsonl:2", settings))
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"messages": [], "sour')  # a write cut short by kill -9
    with ResponsesFile(path, settings) as out:
        assert out.done == {"a.jsonl:1", "a.jsonl:2"} and out.model == "m" and out.cut_bytes == 22
    assert path.read_bytes() == whole

    with pytest.raises(DFlashCacheError, match=r"other settings \(max_tokens: 64 -> 32; turns: 'all' -> 'last'\)"):
        ResponsesFile(path, GenerationSettings(max_tokens=32, turns="last"))
    path.write_bytes(whole + b"not json\n")
    with pytest.raises(DFlashCacheError, match=r"out.jsonl:3 is not a record written by regenerate"):
        ResponsesFile(path, settings)


def test_a_second_run_into_one_output_is_refused_while_the_first_writes(tmp_path):
    """Two runs into one --out both asked for every record and wrote each one twice, which the
    next rerun then refused ("repeats source")."""
    settings = GenerationSettings(max_tokens=8)
    data = write_jsonl(tmp_path / "data.jsonl", [conversation("q", "old")])
    path = tmp_path / "out.jsonl"
    with ResponsesFile(path, settings) as first:
        first.append(_record("elsewhere.jsonl:1", settings))
        result = CliRunner().invoke(
            main,
            [
                "regenerate",
                "--data",
                str(data),
                "--out",
                str(path),
                "--max-tokens",
                "8",
                "--server",
                f"http://127.0.0.1:{free_port()}",
            ],
        )
        assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
        assert (
            f"error: {path} is being written by another regenerate run; wait for it or stop it first" in result.stderr
        )
    assert path.read_text().count("\n") == 1
    with ResponsesFile(path, settings) as again:  # free once the first is closed
        assert again.done == {"elsewhere.jsonl:1"}


def test_a_run_that_fails_before_writing_leaves_no_output_file(tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", [conversation("q", "old")])
    dead = f"http://127.0.0.1:{free_port()}"
    for target in (["--server", dead], ["--target", str(tmp_path / "no-such-model")]):
        result = CliRunner().invoke(
            main, ["regenerate", "--data", str(data), "--out", str(tmp_path / "o.jsonl"), *target]
        )
        assert result.exit_code == 1 and not (tmp_path / "o.jsonl").exists(), result.output
    settings = GenerationSettings()
    with ResponsesFile(tmp_path / "kept.jsonl", settings) as out:
        out.append(_record("elsewhere.jsonl:1", settings))
    before = (tmp_path / "kept.jsonl").read_bytes()
    result = CliRunner().invoke(
        main, ["regenerate", "--data", str(data), "--out", str(tmp_path / "kept.jsonl"), "--server", dead]
    )
    assert result.exit_code == 1 and (tmp_path / "kept.jsonl").read_bytes() == before


def test_settings_are_checked():
    with pytest.raises(DFlashCacheError, match="contradicts enable_thinking=True"):
        GenerationSettings(reasoning="off", chat_template_kwargs={"enable_thinking": True})
    assert GenerationSettings(reasoning="off", chat_template_kwargs={"x": 1}).template_kwargs() == {
        "x": 1,
        "enable_thinking": False,
    }
    with pytest.raises(DFlashCacheError, match="--max-tokens must be at least 1"):
        GenerationSettings(max_tokens=0)


# ---- scripted servers: splitting, concurrency, retries, failures ------------------------------------


def test_servers_split_the_work_with_requests_in_flight(tmp_path, servers):
    a, b = servers(delay_s=0.05), servers(delay_s=0.05)
    records = [conversation(f"question {i}", "old") for i in range(12)] + [conversation("q1", "x", "q2", "y")]
    records[0]["id"] = 40  # a record's own id is written with its answer
    data = write_jsonl(tmp_path / "data.jsonl", records)
    out = tmp_path / "out.jsonl"
    reported = []  # a server's tokens are known with each answer: one report an answer
    summary = regenerate(
        RegenerateOptions(
            data=[data],
            out=out,
            servers=[a.url, b.url + "/v1/"],
            concurrency=4,
            settings=GenerationSettings(max_tokens=16),
            retry=FAST,
        ),
        on_tokens=reported.append,
    )
    assert (summary.records, summary.turns, summary.tokens, summary.finish_reasons) == (13, 14, 42, {"stop": 14})
    assert sorted(reported) == [3] * 14
    assert a.requests and b.requests and len(a.requests) + len(b.requests) == 14
    assert max(a.max_in_flight, b.max_in_flight) >= 2
    assert a.requests[0]["model"] == "scripted" and a.requests[0]["max_tokens"] == 16
    assert "chat_template_kwargs" not in a.requests[0]
    written = {r["source"]: r for r in read_jsonl(out)}
    assert set(written) == {f"{data}:{i}" for i in range(1, 14)}
    first = written[f"{data}:1"]
    assert first["messages"] == [
        {"role": "user", "content": "question 0"},
        {"role": "assistant", "content": "re: question 0", "reasoning_content": "thinking about question 0"},
    ]
    assert first["generation"] == {
        "max_tokens": 16,
        "temperature": 0.0,
        "reasoning": "auto",
        "turns": "all",
        "chat_template_kwargs": {},
        "model": "scripted",
    }
    assert first["regenerated"] == [{"turn": 1, "finish_reason": "stop", "completion_tokens": 3}]
    assert [m["content"] for m in written[f"{data}:13"]["messages"]] == ["q1", "re: q1", "q2", "re: q2"]
    assert first["id"] == "40" and "id" not in written[f"{data}:2"]
    # extract reads the output as it is
    read = {r.where.rsplit(":", 1)[1]: r.messages for r in read_records(out)}
    assert read["1"][1]["role"] == "assistant" and read["1"][1]["content"].startswith("re: question ")
    assert {r.record_id for r in read_records(out)} == {"40", None}

    again = regenerate(
        RegenerateOptions(data=[data], out=out, servers=[a.url], retry=FAST, settings=GenerationSettings(max_tokens=16))
    )
    assert (again.records, again.already_done) == (0, 13) and len(a.requests) + len(b.requests) == 14


def test_a_failed_request_is_retried_with_backoff(tmp_path, servers):
    server = servers(fail_first=2, fail_status=503)
    data = write_jsonl(tmp_path / "data.jsonl", [conversation("hello", "old")])
    summary = regenerate(RegenerateOptions(data=[data], out=tmp_path / "out.jsonl", servers=[server.url], retry=FAST))
    assert summary.records == 1 and len(server.requests) == 3


def test_no_lane_sends_another_request_after_one_that_stops_the_run(tmp_path, servers, monkeypatch):
    """The run stops on a failed request (--on-error error), so the lane that got it takes no further
    job, however late the main thread raises (slowed here; under load it was late by itself, and
    the lane had sent the next conversation: two requests where one was expected)."""
    from dflash_cache.regenerate import run

    hint = run._resume_hint
    monkeypatch.setattr(run, "_resume_hint", lambda summary: (time.sleep(0.5), hint(summary))[1])
    data = write_jsonl(tmp_path / "data.jsonl", [conversation(f"q{i}", "old") for i in range(3)])
    refusing = servers(fail_first=1, fail_status=400)
    with pytest.raises(DFlashCacheError, match="HTTP 400"):
        regenerate(
            RegenerateOptions(
                data=[data], out=tmp_path / "out.jsonl", servers=[refusing.url], concurrency=1, retry=FAST
            )
        )
    assert len(refusing.requests) == 1


def test_a_request_that_keeps_failing_stops_the_run_or_is_skipped_and_listed(tmp_path, servers):
    data = write_jsonl(tmp_path / "data.jsonl", [conversation(f"q{i}", "old") for i in range(3)])
    out = tmp_path / "out.jsonl"
    refusing = servers(fail_first=1, fail_status=400)  # a client error: not retried
    with pytest.raises(DFlashCacheError, match=rf"data.jsonl:1: {refusing.url}/v1 refused the request: HTTP 400"):
        regenerate(RegenerateOptions(data=[data], out=out, servers=[refusing.url], concurrency=1, retry=FAST))
    assert len(refusing.requests) == 1

    down = servers(fail_first=99, fail_status=503)
    summary = regenerate(
        RegenerateOptions(data=[data], out=out, servers=[down.url], concurrency=1, retry=FAST, on_error="skip")
    )
    assert summary.records == 0 and len(summary.skipped) == 3 and len(down.requests) == 9
    assert summary.skipped[0] == (
        f"{data}:1",
        f"failed after 3 attempt(s): {down.url}/v1: HTTP 503 "
        '({"error": "scripted failure 1"}); '
        f'{down.url}/v1: HTTP 503 ({{"error": "scripted failure 2"}}); '
        f'{down.url}/v1: HTTP 503 ({{"error": "scripted failure 3"}})',
    )
    good = servers()
    summary = regenerate(RegenerateOptions(data=[data], out=out, servers=[good.url], retry=FAST, on_error="skip"))
    assert summary.records == 3 and not summary.skipped


def test_servers_of_different_models_are_refused(tmp_path, servers):
    a, b = servers(model="one"), servers(model="two")
    data = write_jsonl(tmp_path / "data.jsonl", [conversation(f"q{i}", "old") for i in range(6)])
    with pytest.raises(DFlashCacheError, match="every --server must serve the same model"):
        regenerate(RegenerateOptions(data=[data], out=tmp_path / "out.jsonl", servers=[a.url, b.url], concurrency=2))


def test_progress_counts_tokens_as_they_come_and_estimates_the_time_left(monkeypatch):
    """Tokens move the line before any record is done; the ETA is the records left at the mean
    tokens of those done, at the rate so far."""
    from dflash_cache.regenerate.run import RecordDone
    from dflash_cache_cli import regenerate_cmd

    now = [100.0]
    monkeypatch.setattr(regenerate_cmd.time, "perf_counter", lambda: now[0])
    progress = regenerate_cmd.Progress(todo=4, done=0)
    try:
        progress.generated(50)
        now[0] = 110.0
        assert progress.line() == "regenerate: 0/4 records, 50 tokens, 5 tokens/s, 0:00:10 elapsed, ETA unknown"
        progress.update(RecordDone("a:1", 40, ["stop"]))
        progress.generated(30)
        now[0] = 120.0  # 80 tokens in 20 s; 3 records left at 40 tokens: 120 tokens, 30 s
        assert progress.line() == "regenerate: 1/4 records, 80 tokens, 4 tokens/s, 0:00:20 elapsed, ETA 0:00:30"
        progress.generated(100)
        progress.update(RecordDone("a:2", 100, ["length"]))
        now[0] = 130.0  # 180 tokens in 30 s; 2 records left at 70 tokens: 140 tokens, 23 s
        assert progress.line() == "regenerate: 2/4 records, 180 tokens, 6 tokens/s, 0:00:30 elapsed, ETA 0:00:23"
    finally:
        progress.close()


def test_cli_names_a_server_that_is_down_and_prints_a_summary(tmp_path, servers):
    data = write_jsonl(tmp_path / "data.jsonl", [conversation("q", "old")])
    runner = CliRunner()
    dead = f"http://127.0.0.1:{free_port()}"
    result = runner.invoke(
        main, ["regenerate", "--data", str(data), "--out", str(tmp_path / "o.jsonl"), "--server", dead]
    )
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1].startswith(f"error: server {dead}/v1 is not reachable (connection refused")
    result = runner.invoke(
        main,
        [
            "regenerate",
            "--data",
            str(data),
            "--out",
            str(tmp_path / "o.jsonl"),
            "--server",
            servers().url,
            "--max-tokens",
            "8",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "done: 1 records written (0 were already there), 1 turns, 3 tokens" in result.stdout
    assert "finish reasons: stop 1; 0 turn(s) hit --max-tokens 8" in result.stdout
    assert "failures: 0 record(s) skipped" in result.stdout
    result = runner.invoke(
        main,
        [
            "regenerate",
            "--data",
            str(data),
            "--out",
            str(tmp_path / "o.jsonl"),
            "--server",
            servers().url,
            "--turns",
            "last",
        ],
    )
    assert result.exit_code == 1 and "other settings (max_tokens: 8 -> 4096; turns: 'all' -> 'last')" in result.stderr


# ---- the real thing: transformers serve and the in-process target ------------------------------------


def _greedy_reference(records: list[dict], max_new_tokens: int, dtype=None) -> list[list[dict]]:
    """Each assistant turn answered by the target's own greedy `generate` in `dtype` (default: the one
    the in-process target generates in), in order."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=dtype or generation_dtype("cpu")).eval()
    out = []
    for record in records:
        messages = [dict(m) for m in record["messages"]]
        if not any(m["role"] == "assistant" for m in messages):  # a prompt: its answer is appended
            messages.append({"role": "assistant"})
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(
                messages[:i], add_generation_prompt=True, return_dict=True, return_tensors="pt"
            )
            ids = model.generate(**prompt, do_sample=False, max_new_tokens=max_new_tokens)[
                0, prompt["input_ids"].shape[1] :
            ]
            messages[i] = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        out.append(messages)
    return out


def _bundled(lines: list[int]) -> list[dict]:
    with open(BUNDLED) as f:
        chosen = {i: json.loads(line) for i, line in enumerate(f, start=1) if i in lines}
    return [chosen[i] for i in lines]


@pytest.mark.slow
def test_transformers_serve_and_in_process_target_answer_like_greedy_generate(tmp_path, transformers_serve):
    records = _bundled([1, 2, 3, 4, 49, 313])  # 49 and 313: three assistant turns each, 313 with a system turn
    data = write_jsonl(tmp_path / "data.jsonl", records)
    settings = GenerationSettings(max_tokens=40)

    served = tmp_path / "served.jsonl"
    summary = regenerate(
        RegenerateOptions(data=[data], out=served, servers=[transformers_serve], concurrency=3, settings=settings)
    )
    assert summary.records == 6 and summary.turns == 10
    by_source = {r["source"]: r for r in read_jsonl(served)}
    # the fixture's server runs the target in fp32
    assert [by_source[f"{data}:{i}"]["messages"] for i in range(1, 7)] == _greedy_reference(records, 40, "float32")
    assert summary.finish_reasons["length"] == sum(
        r["regenerated"][k]["completion_tokens"] == 40 for r in by_source.values() for k in range(len(r["regenerated"]))
    )

    local = tmp_path / "local.jsonl"
    regenerate(RegenerateOptions(data=[data], out=local, target=TARGET, settings=settings))
    assert [
        r["messages"] for r in sorted(read_jsonl(local), key=lambda r: int(r["source"].rsplit(":", 1)[1]))
    ] == _greedy_reference(records, 40)


def test_in_process_target_batches_prompts_and_answers_like_greedy_generate(tmp_path, monkeypatch):
    """Conversations waiting together are generated as one left-padded batch, each row's answer the
    target's own greedy `generate` of that conversation alone; a prompt-only record gets its answer
    appended; --limit takes the first N records."""
    from dflash_cache.regenerate import local

    batches = []
    cohort = local._Replica.cohort
    monkeypatch.setattr(
        local._Replica,
        "cohort",
        lambda self, prompts, *a: batches.append(len(prompts)) or cohort(self, prompts, *a),
    )
    records = [{"messages": r["messages"][:2]} for r in _bundled([1, 2, 3, 4, 5, 6, 7])]
    records[2] = {"messages": records[2]["messages"][:1]}  # prompt only
    data = write_jsonl(tmp_path / "data.jsonl", records)
    out = tmp_path / "out.jsonl"
    summary = regenerate(
        RegenerateOptions(data=[data], out=out, target=TARGET, limit=6, settings=GenerationSettings(max_tokens=12))
    )
    assert summary.records == 6 and max(batches) > 1
    expected = _greedy_reference(records[:6], max_new_tokens=12)
    written = sorted(read_jsonl(out), key=lambda r: int(r["source"].rsplit(":", 1)[1]))
    assert [r["messages"] for r in written] == expected


def test_rows_that_finish_leave_the_batch_and_the_others_answer_as_alone():
    """Greedy decoding of a batch whose rows end at different steps (an end token each row meets at
    its own time): every row's answer is the target's own `generate` of it alone, end token included."""
    import threading

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_cache.regenerate.local import _Replica

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(
        TARGET, dtype=generation_dtype("cpu")
    ).eval()  # as the in-process target
    prompts = [
        tokenizer.apply_chat_template(r["messages"][:1], add_generation_prompt=True, return_dict=True)["input_ids"]
        for r in _bundled([1, 2, 3, 4, 5])
    ]

    def alone(prompt, eos):
        ids = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=16, eos_token_id=eos, pad_token_id=0
        )
        return ids[0, len(prompt) :].tolist()

    first = [alone(p, tokenizer.eos_token_id) for p in prompts]
    ends = sorted({row[2 + 3 * i] for i, row in enumerate(first)} | {tokenizer.eos_token_id})  # rows end early, apart
    replica = _Replica(TARGET, "cpu", threading.Event())
    replica.model.generation_config.eos_token_id = ends
    answers = replica.generate(prompts, GenerationSettings(max_tokens=16), "m")
    expected = [alone(p, ends) for p in prompts]
    assert [a.completion_tokens for a in answers] == [len(e) for e in expected]
    assert len(set(map(len, expected))) > 1  # the rows did finish at different steps
    assert [a.content for a in answers] == [tokenizer.decode(e, skip_special_tokens=True) for e in expected]

    # A generation config that adjusts the logits (a repetition penalty) is honoured, as `generate` does it.
    replica.model.generation_config.repetition_penalty = model.generation_config.repetition_penalty = 1.5
    penalised = [alone(p, ends) for p in prompts]
    assert penalised != expected
    assert [a.content for a in replica.generate(prompts, GenerationSettings(max_tokens=16), "m")] == [
        tokenizer.decode(e, skip_special_tokens=True) for e in penalised
    ]


def test_requests_arriving_while_a_long_answer_runs_start_at_once_and_answer_as_alone():
    """Continuous batching: prompts sent while a long answer is being generated are answered before
    it ends (they no longer wait for the whole batch), each answer the target's own greedy `generate`
    of that prompt alone; the tokens are reported as they are generated, not only with the answers."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_cache.regenerate.local import LocalTarget

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(
        TARGET, dtype=generation_dtype("cpu")
    ).eval()  # as the in-process target
    records = _bundled([1, 2, 3])
    prompts = [r["messages"][:1] for r in records]

    def alone(messages, max_new_tokens):
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        ids = model.generate(**prompt, do_sample=False, max_new_tokens=max_new_tokens)
        return ids[0, prompt["input_ids"].shape[1] :].tolist()

    reports: list[int] = []
    long, short = GenerationSettings(max_tokens=300), GenerationSettings(max_tokens=6)
    pool = ThreadPoolExecutor(3)
    later: list = []
    sent = threading.Event()

    def on_tokens(n: int) -> None:  # on the replica's thread, between two steps of the long answer
        reports.append(n)
        if not later:  # the later prompts sent, and waiting, before the long answer's next step
            later.extend(pool.submit(target.complete, p, short, lane) for lane, p in enumerate(prompts[1:], start=1))
            deadline = time.monotonic() + 30
            while target._queue.qsize() < len(later) and time.monotonic() < deadline:
                time.sleep(0.01)
            sent.set()

    target = LocalTarget(TARGET, ["cpu"], max_batch=4, on_tokens=on_tokens)
    try:
        first = pool.submit(target.complete, prompts[0], long, 0)
        assert sent.wait(60)
        answers = [f.result(timeout=120) for f in [first, *later]]
    finally:
        target.close()
        pool.shutdown()
    expected = [alone(prompts[0], 300)] + [alone(p, 6) for p in prompts[1:]]
    assert len(expected[0]) > 12 and all(len(e) == 6 for e in expected[1:])
    assert [a.completion_tokens for a in answers] == [len(e) for e in expected]
    assert [a.content for a in answers] == [tokenizer.decode(e, skip_special_tokens=True) for e in expected]
    # One report per cohort and step: 1 for the long answer's cohort, 2 for the later pair's.
    last_pair = max(i for i, n in enumerate(reports) if n == 2)
    assert sum(reports[last_pair + 1 :]) > 0  # the long answer was still being generated when the pair ended
    assert sum(reports) == sum(map(len, expected))


@pytest.mark.slow
def test_kill_9_part_way_then_rerun_gives_the_uninterrupted_file(tmp_path, transformers_serve):
    data = write_jsonl(tmp_path / "data.jsonl", _bundled(list(range(5, 17))))
    command = [
        sys.executable,
        "-m",
        "dflash_cache_cli.main",
        "regenerate",
        "--data",
        str(data),
        "--server",
        transformers_serve,
        "--max-tokens",
        "48",
        "--concurrency",
        "2",
    ]
    whole = tmp_path / "whole.jsonl"
    subprocess.run(command + ["--out", str(whole)], check=True, capture_output=True)

    killed = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(command + ["--out", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (killed.exists() and killed.read_bytes().count(b"\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written_at_kill = killed.read_bytes().count(b"\n")
    assert written_at_kill < 12
    rerun = subprocess.run(command + ["--out", str(killed)], check=True, capture_output=True, text=True)
    assert f"to regenerate: {12 - written_at_kill} records ({written_at_kill} already" in rerun.stderr
    lines = killed.read_text().splitlines()
    assert len(lines) == len(set(lines)) == 12
    assert set(lines) == set(whole.read_text().splitlines())


@pytest.mark.slow
def test_ctrl_c_of_the_in_process_target_is_one_line_and_exit_130(tmp_path):
    """SIGINT while a replica thread is generating: `error: interrupted`, exit 130 (it aborted with
    "terminate called without an active exception", exit 134); the rerun does the rest."""
    data = write_jsonl(tmp_path / "data.jsonl", _bundled(list(range(1, 17))))
    out = tmp_path / "out.jsonl"
    command = [
        sys.executable,
        "-m",
        "dflash_cache_cli.main",
        "regenerate",
        "--data",
        str(data),
        "--out",
        str(out),
        "--target",
        str(TARGET),
        "--max-tokens",
        "64",
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # a shell's & ignores it
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be interrupted"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.endswith("error: interrupted\n"), (proc.returncode, err)
    written = out.read_bytes().count(b"\n")
    assert 2 <= written < 16
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and f"({written} already in the output)" in rerun.stderr, rerun.stderr
    assert len({json.loads(line)["source"] for line in out.read_text().splitlines()}) == 16


def test_requests_carry_tool_call_arguments_as_json_text(tmp_path):
    """The OpenAI API takes arguments as a string; the reader hands templates an object."""
    import json as _json

    from dflash_cache.regenerate.conversations import read_jobs, request_messages

    path = tmp_path / "calls.jsonl"
    path.write_text(
        _json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "add"},
                    {
                        "role": "assistant",
                        "content": None,
                        "reasoning_content": "r",
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "1"},
                    {"role": "assistant", "content": "1"},
                ]
            }
        )
        + "\n"
    )
    (job,) = read_jobs([path])
    sent = _json.loads(_json.dumps(request_messages(job.messages[:3])))
    assert sent[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}],
    }
