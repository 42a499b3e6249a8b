"""What every ``trtkv`` command shares: option types, the defaults, and the one error handler.

The core CLI (``trtkv.cli``) and each stage's commands (``calibration/cli.py``, ``builder/cli.py``,
``triton_repo/cli.py``) import it; it imports no stage.
"""

from __future__ import annotations

import functools
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import typer
import typer.core
from rich.console import Console
from rich.markup import escape

from trtkv.errors import TrtkvError

console = Console()
err_console = Console(stderr=True)


def _no_type_for_flags() -> None:
    """Typer's rich help prints a type column for every option, ``<bool>`` for a flag (``--force``, ``--help``), which
    takes no value; show the type of options that take one only. Done once, here, for every command."""
    shown = typer.core.TyperOption.display_type_rich
    if getattr(shown, "flags_without_type", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.flags_without_type = True
    typer.core.TyperOption.display_type_rich = display_type_rich


_no_type_for_flags()
_state = {"debug": False}

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_DATASET = "builtin:pydoc"

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="HF model dir, .gguf file, or the builtin alias smollm2-135m")]
DatasetOpt = Annotated[str, typer.Option("--dataset", "-d", help="builtin:pydoc, .txt/.jsonl/.parquet file or folder, save_to_disk folder, hf:NAME[:CONFIG][:SPLIT]")]
DeviceOpt = Annotated[str, typer.Option(help="auto | cpu | cuda")]
DtypeOpt = Annotated[str, typer.Option(help="auto | float32 | float16 | bfloat16")]
StreamOpt = Annotated[str, typer.Option("--stream", help="layer streaming (one decoder layer in memory at a time): auto (when the resident model does not fit) | always | never")]
TextFieldOpt = Annotated[str, typer.Option(help="field holding the text in .jsonl / parquet / datasets sources")]


_FIELD_DEFAULT = object()


def field_option(model, name: str, default: Any = _FIELD_DEFAULT) -> tuple[Any, Any]:
    """``(annotation, default)`` of a typer option generated from pydantic ``model``'s field ``name``: its flag
    (``json_schema_extra["flag"]``), its description as the help, and typer shows the parameter's own default, so no
    help text restates one. ``default``: a command's own, named override of the field's;
    a ``None`` default is shown as the field's ``json_schema_extra["unset"]``. The model validates the values."""
    info = model.model_fields[name]
    extra = info.json_schema_extra or {}
    value = info.default if default is _FIELD_DEFAULT else default
    base = info.annotation
    if typing.get_origin(base) in (typing.Union, types.UnionType):
        base = next(a for a in typing.get_args(base) if a is not type(None))
    if typing.get_origin(base) is Literal:
        base = str  # the model names the allowed values in its error and the description lists them
    shown = True if value is not None else extra.get("unset", "unset")  # typer shows the parameter's default itself
    ann = Annotated[Optional[base] if value is None else base, typer.Option(extra["flag"], help=info.description, show_default=shown)]
    return ann, value


def handle_errors(fn):
    """Turn TrtkvError (and any unexpected error) into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except TrtkvError as exc:
            if _state["debug"]:
                raise
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True, highlight=False)  # hints hold [extras]
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]")
            raise typer.Exit(130) from None
        except Exception as exc:  # a bug, not a user error: one line unless --debug
            if _state["debug"]:
                raise
            err_console.print(
                f"[bold red]internal error:[/] {type(exc).__name__}: {escape(str(exc))} (rerun with --debug for the traceback)",
                soft_wrap=True,
                highlight=False,
            )
            raise typer.Exit(1) from None

    return wrapper


def _set_debug(value: bool) -> bool:
    if value:
        _state["debug"] = True
    return value


def _show_version(value: bool) -> None:
    if value:
        from trtkv import __version__

        console.print(f"trtkv {__version__}", highlight=False)
        raise typer.Exit()


# accepted before the subcommand (trtkv --debug plan ...) and after it (trtkv plan ... --debug)
DebugOpt = Annotated[bool, typer.Option("--debug", help="show tracebacks instead of one-line errors", callback=_set_debug, is_eager=True)]
TokenizerOpt = Annotated[Optional[Path], typer.Option("--tokenizer", help="directory with the tokenizer files, for a model directory that has none")]


