"""The `dflash-cache` command as tests run it: in this process through click's runner, or as a real
process; and the check that a failure is the CLI's one line."""

import os
import shlex
import subprocess
import sys
import time

from click.testing import CliRunner, Result

from dflash_cache_cli.main import main


def invoke(*args) -> Result:
    """`dflash-cache ARGS` in this process."""
    return CliRunner().invoke(main, [str(a) for a in args])


def cli(*args) -> tuple[int, str]:
    """`dflash-cache ARGS` in this process: the exit code, and stdout on success or stderr on failure."""
    result = invoke(*args)
    return result.exit_code, result.stdout if result.exit_code == 0 else result.stderr


def spawn(*args, env: dict | None = None, **kw) -> subprocess.Popen:
    """`dflash-cache ARGS` as a process of its own, with pipes for stdout and stderr."""
    return subprocess.Popen(
        command(*args),
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def command(*args) -> list[str]:
    return [sys.executable, "-m", "dflash_cache_cli.main", *map(str, args)]


def shell_command(*args) -> str:
    """`dflash-cache ARGS` as a line for sh."""
    return shlex.join(command(*args))


def one_line_error(code: int, err: str, *needles: str, exit_code: int = 1) -> None:
    """The CLI's failure: exit code `exit_code`, one line on stderr starting with 'error: ', no
    traceback, and each needle in it."""
    assert code == exit_code, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def wait_until_stopped(proc: subprocess.Popen, timeout: float = 240) -> None:
    """Waits until `proc` is stopped (SIGSTOP, as `DFLASH_CACHE_KILL_AT=NAME:N:STOP` stops it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.2)
    raise TimeoutError(f"pid {proc.pid} never reached its stop point")
