"""transformers' "Loading weights" bar is silenced where we load a model, and only there: our own
progress lines are the tool's progress, and a library caller's own bars are left as they were."""

from click.testing import CliRunner
from transformers.utils import logging as hf_logging

from dflash_cache.target.target import load_target
from dflash_cache_cli.main import main
from tests.test_eval import random_drafter


def test_extract_and_eval_show_no_weight_loading_bar(qwen3_target_dir, conversations, tmp_path):
    runner = CliRunner()
    extracted = runner.invoke(
        main,
        [
            "extract",
            "--target",
            str(qwen3_target_dir),
            "--data",
            str(conversations),
            "--out",
            str(tmp_path / "cache"),
            "--layers",
            "1,4",
            "--token-budget",
            "300",
        ],
    )
    assert extracted.exit_code == 0, extracted.output
    assert "done: " in extracted.output and "Loading weights" not in extracted.output, extracted.output
    drafter = random_drafter(tmp_path / "drafter", qwen3_target_dir)
    evaluated = runner.invoke(
        main,
        [
            "eval",
            "--drafter",
            str(drafter),
            "--target",
            str(qwen3_target_dir),
            "--data",
            str(conversations),
            "--num-prompts",
            "1",
            "--max-new-tokens",
            "4",
        ],
    )
    assert evaluated.exit_code == 0, evaluated.output
    assert "tau" in evaluated.output and "Loading weights" not in evaluated.output, evaluated.output


def test_a_library_load_leaves_the_callers_progress_bars_as_they_were(qwen3_target_dir, capsys):
    assert hf_logging.is_progress_bar_enabled()
    load_target(qwen3_target_dir, "cpu")
    assert hf_logging.is_progress_bar_enabled()
    assert "Loading weights" not in capsys.readouterr().err
    hf_logging.disable_progress_bar()
    try:
        load_target(qwen3_target_dir, "cpu")
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
