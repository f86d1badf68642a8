"""Bad input through the real commands: each is one line on stderr starting with 'error:', a
non-zero exit, no traceback (unless --debug), and nothing created or overwritten."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from transformers import T5Config

from dflash_cache import DFlashCacheError
from dflash_cache_cli.main import main
from tests.support.cli import cli, one_line_error
from tests.support.extract import run_extract
from tests.support.tiny import build_target, write_conversations
from tests.support.train import drafter_json, make_cache


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_faults")
    target = build_target(root / "target", "qwen3")
    data = write_conversations(root / "data.jsonl", count=4)
    cache = root / "cache"
    run_extract(target, data, cache)
    return root, target, data, cache


@pytest.mark.parametrize(
    "options, message, exit_code",
    [
        (["--layers", "1,4", "--token-budget", -5], "--token-budget must be positive", 1),
        (["--layers", "1,4", "--gpus", ""], "--gpus is empty", 1),
        (["--layers", "1,4", "--gpus", "99"], "GPU 99 is not visible", 1),
        (["--layers", "1,4", "--max-length", 1], "--max-length must be at least 2", 1),
        (["--layers", "1,4", "--topk", -1], "--topk must be 0 or more", 1),
        (["--layers", "1,99"], "out of range", 1),
        (["--layers", ""], "--layers is empty", 1),
        (["--num-draft-layers", -2], "--num-draft-layers -2 does not fit", 1),
        (["--layers", "1,4", "--shard-size", 0], "Invalid value for --shard-size: must be positive", 2),
        (["--layers", "1,4", "--tokenize-workers", -1], "'--tokenize-workers': -1 is not in the range x>=0", 2),
        (["--layers", "1,4", "--codec", "zip"], "'--codec': 'zip' is not one of", 2),
        (["--layers", "1,4", "--staging", "staged"], "--staging applies only with a URL --out", 1),  # was ignored
    ],
)
def test_extract_options_out_of_range(setup, tmp_path, options, message, exit_code):
    _, target, data, _ = setup
    code, err = cli("extract", "--target", target, "--data", data, "--out", tmp_path / "out", *options)
    one_line_error(code, err, message, exit_code=exit_code)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "options, message",
    [
        (["--token-budget", -1], "--token-budget must be at least 1"),
        (["--max-anchors", 0], "--max-anchors must be at least 1"),
        (["--anchors-per-batch", 0], "--anchors-per-batch must be at least 1"),
        (["--lr", 0], "--lr must be positive"),
        (["--grad-clip", -1], "--grad-clip must be positive"),
        (["--weight-decay", -0.1], "--weight-decay must be at least 0"),
        (["--min-lr-ratio", 1.5], "--min-lr-ratio must be in [0, 1]"),
        (["--collective-timeout", 0], "--collective-timeout must be positive"),
        (["--gpus", ""], "--gpus is empty"),
        (["--steps", -3], "--steps must be at least 1"),
        (["--local-cache", "fetched"], "--local-cache applies only with a remote --cache"),  # was ignored
    ],
)
def test_train_options_out_of_range(tmp_path, options, message):
    cache, drafter = make_cache(tmp_path / "cache"), drafter_json(tmp_path / "drafter.json")
    one_line_error(*cli("train", "--cache", cache, "--drafter", drafter, "--out", tmp_path / "run", *options), message)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("block_size", [1, 0, -4])
def test_a_drafter_block_size_below_two(tmp_path, block_size):
    cache, drafter = make_cache(tmp_path / "cache"), drafter_json(tmp_path / "drafter.json", block_size=block_size)
    one_line_error(
        *cli("train", "--cache", cache, "--drafter", drafter, "--out", tmp_path / "run"),
        "block_size must be an integer from 2 to 256",
    )
    assert not (tmp_path / "run").exists()


def test_inspect_and_verify_arguments(setup, tmp_path):
    cache = setup[3]
    one_line_error(
        *cli("inspect", cache, "--token-budget", 0), "'--token-budget': 0 is not in the range x>=1", exit_code=2
    )
    one_line_error(*cli("verify"), "Missing argument 'CACHE'", exit_code=2)
    one_line_error(*cli("verify", tmp_path / "nope"), "no such cache directory")


def without_tokenizer(target, dest):
    dest.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(target / name, dest)
    return dest


def other_architecture(target, dest):
    shutil.copytree(target, dest)
    T5Config(d_model=32, num_layers=1).save_pretrained(dest)
    return dest


def without_chat_template(target, dest):
    shutil.copytree(target, dest)
    (dest / "chat_template.jinja").unlink()
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda target, dest: dest, "does not exist"),
        (lambda target, dest: dest.mkdir() or dest, "no config.json"),
        (without_tokenizer, "has no tokenizer files"),
        (other_architecture, "'t5' is not a causal LM"),
        (without_chat_template, "data.jsonl:1: the tokenizer has no chat template"),
    ],
)
def test_bad_target_directories(setup, tmp_path, make, message):
    _, target, data, _ = setup
    bad = make(target, tmp_path / "target")
    one_line_error(
        *cli("extract", "--target", bad, "--data", data, "--out", tmp_path / "out", "--layers", "1,4"), message
    )


def bad_data_files(directory):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    files = {
        "malformed.jsonl": (json.dumps(good) + "\n" + '{"messages": [\n', "malformed.jsonl:2: not valid JSON"),
        "unknown_role.jsonl": (
            json.dumps({"messages": [{"role": "wizard", "content": "x"}]}) + "\n",
            "unknown_role.jsonl:1: messages[0] has unknown role 'wizard'",
        ),
        "no_assistant.jsonl": (
            json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n",
            "no_assistant.jsonl:1: the conversation has no assistant turn",
        ),
        "empty.jsonl": ("", "empty.jsonl is empty"),
        "vocab.jsonl": (json.dumps({"input_ids": [1, 2, 99999]}) + "\n", "vocab.jsonl:1"),
    }
    paths = {}
    for name, (text, message) in files.items():
        (directory / name).write_text(text)
        paths[directory / name] = message
    pq.write_table(pa.table({"input_ids": pa.array([["a", "b"]])}), directory / "types.parquet")
    paths[directory / "types.parquet"] = "types.parquet: column 'input_ids' must be a list of integers"
    return paths


def test_bad_data_leaves_an_existing_cache_untouched(setup, tmp_path):
    _, target, _, cache = setup
    before = {p: p.read_bytes() for p in cache.rglob("*") if p.is_file() and "locks" not in p.parts}
    for path, message in bad_data_files(tmp_path).items():
        code, err = cli("extract", "--target", target, "--data", path, "--out", cache, "--layers", "1,4")
        one_line_error(code, err, message)
    assert {p: p.read_bytes() for p in cache.rglob("*") if p.is_file() and "locks" not in p.parts} == before


def test_extract_into_a_folder_that_holds_something_else_is_refused(setup, tmp_path):
    """A mistyped --out (a folder of notes, a training run) must not get a cache mixed into it."""
    _, target, data, _ = setup
    notes, run = tmp_path / "notes", tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    notes.mkdir()
    (notes / "todo.txt").write_text("mine\n")
    for folder, first in ((notes, "todo.txt"), (run, "checkpoints")):
        before = sorted(p.name for p in folder.iterdir())
        code, err = cli("extract", "--target", target, "--data", data, "--out", folder, "--layers", "1,4")
        one_line_error(
            code,
            err,
            f"--out {folder} holds files that are not part of a cache ({first}",
            "choose a new or empty folder",
        )
        assert sorted(p.name for p in folder.iterdir()) == before  # no locks/, nothing written


def test_a_data_file_given_twice_is_refused(setup, tmp_path, monkeypatch):
    """`--data d.jsonl --data ./d.jsonl` extracted every record twice (as regenerate refuses)."""
    _, target, data, _ = setup
    monkeypatch.chdir(data.parent)
    code, err = cli(
        "extract", "--target", target, "--data", data, "--data", f"./{data.name}", "--out", tmp_path / "out"
    )
    one_line_error(code, err, f"--data {data.name} is given twice (it is {data}); give each file once")
    assert not (tmp_path / "out").exists()


def test_debug_raises_with_the_traceback(setup, tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_CACHE_DEBUG", raising=False)  # --debug sets it; gone after this test
    _, target, data, _ = setup
    result = CliRunner().invoke(
        main,
        [
            "--debug",
            "extract",
            "--target",
            str(target),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "out"),
            "--layers",
            "1,4",
            "--token-budget",
            "-5",
        ],
    )
    assert result.exit_code == 1 and isinstance(result.exception, DFlashCacheError)
    assert result.exc_info[2] is not None and "error:" not in result.stderr


def test_debug_after_the_command_name_works_too(tmp_path, monkeypatch):
    """Each error ends "(run with --debug for a traceback)", and people append it to the command they
    ran: that was "No such option '--debug'" (exit 2)."""
    monkeypatch.delenv("DFLASH_CACHE_DEBUG", raising=False)
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "nope"), "--debug"])
    assert result.exit_code == 1 and isinstance(result.exception, DFlashCacheError), result.output
    assert "no such cache directory" in str(result.exception) and "error:" not in result.stderr
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "nope")])  # without it: the one line
    assert result.exit_code == 1 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_debug_reaches_the_spawned_extraction_ranks(monkeypatch, capsys):
    """--debug sets what a spawned rank reads, and a rank that fails then prints its traceback."""
    import queue

    from dflash_cache.extract import pipeline

    monkeypatch.delenv("DFLASH_CACHE_DEBUG", raising=False)
    CliRunner().invoke(main, ["--debug", "inspect", "--help"])

    def fail(job, on_progress):
        raise RuntimeError("boom in the rank")

    monkeypatch.setattr(pipeline, "run_rank", fail)
    events = queue.Queue()
    pipeline._child(type("Job", (), {"rank": 1, "device": "cuda:1"})(), events)
    assert events.get_nowait() == ("error", "rank 1 on cuda:1: RuntimeError: boom in the rank")
    err = capsys.readouterr().err
    assert "Traceback" in err and "boom in the rank" in err
