"""`train` and `extract` take every default and every help text from their config dataclass: the
command run with only its required options builds the dataclass's own defaults, each field's help is
what `--help` prints, and the options given in other units reach the field converted."""

import dataclasses

import pytest
from click.testing import CliRunner

from dflash_cache.console.options import OPTION
from dflash_cache.extract import pipeline
from dflash_cache.extract.options import ExtractOptions
from dflash_cache.train import train as train_module
from dflash_cache.train.config import TrainConfig
from dflash_cache_cli.main import main


def run(args: list[str], monkeypatch) -> object:
    """The config the command builds from `args`, caught before anything runs."""
    caught = []

    def fake_extract(opts, events=None):
        caught.append(opts)
        return pipeline.ExtractSummary(0, 0, 0, 0.0, 0, 0, already_complete=True)

    monkeypatch.setattr(pipeline, "extract", fake_extract)
    monkeypatch.setattr(train_module, "train", lambda cfg, echo: caught.append(cfg))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    [config] = caught
    return config


def test_train_without_options_is_the_dataclass_defaults(monkeypatch, tmp_path):
    built = run(["train", "--out", str(tmp_path / "run"), "--cache", "a", "--cache", "b"], monkeypatch)
    assert built == TrainConfig(out=str(tmp_path / "run"), caches=["a", "b"])


def test_extract_without_options_is_the_dataclass_defaults(monkeypatch, tmp_path):
    args = ["extract", "--target", str(tmp_path), "--data", str(tmp_path / "d.jsonl"), "--out", "s3://b/p"]
    built = run(args, monkeypatch)
    assert built == ExtractOptions(target=tmp_path, data=[tmp_path / "d.jsonl"], out="s3://b/p")


def test_options_in_other_units_reach_their_fields(monkeypatch, tmp_path):
    args = ["extract", "--target", str(tmp_path), "--data", "d.jsonl", "--out", "o", "--shard-size", "0.5"]
    built = run([*args, "--skip-weights-hash", "--chat-template-kwargs", '{"enable_thinking": false}'], monkeypatch)
    assert built.max_shard_bytes == 512 * 1024 and built.hash_weights is False
    assert built.chat_template_kwargs == {"enable_thinking": False}
    built = run(["train", "--out", "r", "--cache", "c", "--local-cache-size", "2", "--compile"], monkeypatch)
    assert built.local_cache_bytes == 2 * 1024**3 and built.compile is True
    built = run(["train", "--out", "r", "--cache", "c", "--collective-timeout", "5", "--gpus", "0-2"], monkeypatch)
    assert built.collective_timeout_s == 5.0 and built.gpus == [0, 1, 2]


def entries(command: str) -> dict[str, str]:
    """Each option's entry in `--help`, by its flag, in the order printed."""
    printed = CliRunner().invoke(main, [command, "--help"], terminal_width=1000).output
    found: dict[str, str] = {}
    for line in printed.split("Options:")[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            found[flag] = line
        elif found:
            found[flag] += line
    return {flag: " ".join(text.split()) for flag, text in found.items()}


@pytest.mark.parametrize(("command", "config"), [("train", TrainConfig), ("extract", ExtractOptions)])
def test_each_fields_help_and_default_is_what_help_prints(command, config):
    printed = entries(command)
    options = [f for f in dataclasses.fields(config) if OPTION in f.metadata]
    flags = [f.metadata[OPTION].flag or "--" + f.name.replace("_", "-") for f in options]
    assert list(printed) == [*flags, "-h"]  # every option a field's, in the order of the fields
    for f, flag in zip(options, flags):
        how, said = f.metadata[OPTION], printed[flag]
        assert " ".join(how.help.split()) in said, f.name
        if f.default not in (dataclasses.MISSING, None) and not isinstance(f.default, bool):
            default = f.default // how.unit if how.unit else f.default
            assert f"[default: {default}]" in said, f.name
        else:
            assert "[default:" not in said, f.name
