"""`demo --workdir` is refused when it holds files that no demo wrote, before anything is written
into it; an earlier demo's folder gets on to the demo's own check."""

import pytest
from click.testing import CliRunner

from dflash_cache.demo import DemoOptions, run_demo
from dflash_cache.errors import DFlashCacheError
from dflash_cache_cli.main import main


def test_a_workdir_of_other_files_is_refused_untouched(tmp_path):
    workdir = tmp_path / "notes"
    workdir.mkdir()
    (workdir / "todo.txt").write_text("mine\n")
    (workdir / "cache").mkdir()  # a demo's name beside the foreign file does not make it a demo's folder
    result = CliRunner().invoke(main, ["demo", "--workdir", str(workdir), "--assets", str(tmp_path / "no-assets")])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(
        f"error: --workdir {workdir} holds files that are not a demo's (todo.txt); choose a new or empty folder"
    ), result.output
    assert sorted(p.name for p in workdir.iterdir()) == ["cache", "todo.txt"] and not any((workdir / "cache").iterdir())


def test_an_earlier_demos_workdir_is_not_taken_for_a_foreign_one(tmp_path):
    workdir = tmp_path / "demo"
    for name in ("cache", "run", "data"):
        (workdir / name).mkdir(parents=True)
    (workdir / "drafter.json").write_text("{}\n")
    with pytest.raises(DFlashCacheError, match="already holds a demo run"):
        run_demo(DemoOptions(workdir=workdir, assets=tmp_path / "no-assets"))
