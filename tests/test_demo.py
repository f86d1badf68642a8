"""The demo pipeline runs end to end on the bundled assets (with a few steps), and says so when the
assets are missing."""

import pytest
from click.testing import CliRunner

from dflash_cache.demo import ASSETS, DemoOptions, find_assets, run_demo
from dflash_cache.errors import DFlashCacheError
from dflash_cache_cli.main import main

needs_assets = pytest.mark.skipif(not (ASSETS / "target" / "config.json").is_file(), reason="examples/assets not built")


@needs_assets
def test_demo_runs_end_to_end(tmp_path):
    lines = []
    options = DemoOptions(
        workdir=tmp_path / "demo", train_samples=12, steps=2, token_budget=1024, eval_prompts=2, max_new_tokens=8
    )
    result = run_demo(options, echo=lines.append)
    assert (result.cache / "manifest.json").is_file() and result.extracted.samples == 12
    assert result.checkpoint == result.run / "checkpoints" / "step-2"
    assert result.report.prompts == 2 and result.report.new_tokens > 0 and result.report.tau >= 1
    assert any(line.startswith("extract: 12 conversations") for line in lines)
    assert any(line.startswith("train: 2 steps") for line in lines)
    with pytest.raises(DFlashCacheError, match="already holds a demo run"):
        run_demo(options, echo=lines.append)


def test_missing_assets_are_one_line(tmp_path):
    with pytest.raises(DFlashCacheError, match="demo assets not found"):
        find_assets(tmp_path)
    result = CliRunner().invoke(main, ["demo", "--assets", str(tmp_path), "--workdir", str(tmp_path / "w")])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and "demo assets not found" in result.output
