"""Every command's --help, and `inspect`, start without importing torch or transformers."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cachegen import write_random_cache

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["regenerate", "extract", "train", "inspect", "verify", "export", "eval", "demo"]


def heavy_modules_after(args: list[str]) -> list[str]:
    script = (
        "import sys\n"
        "from dflash_cache_cli.main import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('HEAVY:' + ','.join(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return [m for m in result.stdout.strip().splitlines()[-1].removeprefix("HEAVY:").split(",") if m]


@pytest.mark.parametrize("args", [["--help"], *([c, "--help"] for c in COMMANDS)])
def test_help_imports_neither_torch_nor_transformers(args):
    assert heavy_modules_after(args) == []


def test_inspect_imports_neither_torch_nor_transformers(tmp_path):
    write_random_cache(tmp_path, [5, 9, 3], rows_per_shard=2)
    assert heavy_modules_after(["inspect", str(tmp_path)]) == []
