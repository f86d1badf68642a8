"""`dflash-cache`: the command group. Each command lives in its own module and only parses options,
calls the library and shows progress."""

from __future__ import annotations

import os
import sys

import click

from dflash_cache.console.terminate import Terminated
from dflash_cache.errors import DFlashCacheError


# Command modules import only click and light option values at the top; each command imports the
# library it runs (torch, transformers) in its body, so `--help` and `inspect` start in well under 3 s.
class Group(click.Group):
    """Prints one line per error (a traceback only with --debug) and exits non-zero."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # Errors end "(run with --debug ...)" and people append it to their command: it counts there too.
        if "--debug" in args and "--" not in args[: (i := args.index("--debug"))]:
            args = ["--debug", *args[:i], *args[i + 1 :]]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # a missing or invalid option: one line too, with click's exit code
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            click.echo(f"error: {e.format_message()}{hint}", err=True)
            sys.exit(e.exit_code)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        except Terminated:
            click.echo("error: terminated", err=True)
            sys.exit(143)
        except Exception as e:  # noqa: BLE001 - every failure must end as one readable line
            if ctx.obj and ctx.obj.get("debug"):
                raise
            kind = "" if isinstance(e, DFlashCacheError) else f"{type(e).__name__}: "
            click.echo(f"error: {kind}{e} (run with --debug for a traceback)", err=True)
            sys.exit(1)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Extract a target model's hidden states once; train DFlash drafters from the cache."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    if debug:  # spawned extraction ranks print their tracebacks too (extract/pipeline.py)
        os.environ["DFLASH_CACHE_DEBUG"] = "1"


def _register() -> None:
    from dflash_cache_cli import (
        demo_cmd,
        eval_cmd,
        export_cmd,
        extract_cmd,
        inspect_cmd,
        regenerate_cmd,
        train_cmd,
        verify_cmd,
    )

    for module in (regenerate_cmd, extract_cmd, train_cmd, inspect_cmd, verify_cmd, export_cmd, eval_cmd, demo_cmd):
        main.add_command(module.command)


_register()


if __name__ == "__main__":
    main()
