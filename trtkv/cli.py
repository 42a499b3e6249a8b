"""The ``trtkv`` command line: eval and plan here; calibrate, export, build-engine, inspect, serve, triton-repo and
generate come from the stages (``register_stage_commands``).

Every user mistake surfaces as a ``TrtkvError`` and is printed as one line (problem — fix) with exit
code 2; ``--debug`` shows the traceback instead. Heavy imports happen inside the commands so that
``trtkv --help`` and ``trtkv plan`` stay fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from trtkv.cli_options import (
    DEFAULT_DATASET,
    DatasetOpt,
    DebugOpt,
    DeviceOpt,
    DtypeOpt,
    StreamOpt,
    TextFieldOpt,
    TokenizerOpt,
    _show_version,
    _state,
    console,
    err_console,
    handle_errors,
)
from trtkv.errors import TrtkvError
from trtkv.gpu import DEFAULT_RESERVE
from trtkv.preset_names import KV_HELP

app = typer.Typer(
    name="trtkv",
    help="Quantize an LLM's KV cache (fp8, int8, int4, int3, int2), measure what that costs, and serve the model with it "
    "through Triton Inference Server.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def main(
    debug: DebugOpt = False,
    version: Annotated[bool, typer.Option("--version", help="print the version and exit", callback=_show_version, is_eager=True)] = False,
) -> None:
    _state["debug"] = debug


@app.command("eval")
@handle_errors
def eval_(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="HF model dir, .gguf file, or smollm2-135m; default: the --calibration's model, else smollm2-135m")] = None,
    dataset: DatasetOpt = DEFAULT_DATASET,
    kv: Annotated[Optional[list[str]], typer.Option("--kv", help="KV formats to compare with fp16 (repeatable): " + KV_HELP + "; default: fp16, int8, int4")] = None,
    calibration: Annotated[Optional[Path], typer.Option(help="calibration directory from `trtkv calibrate`")] = None,
    task: Annotated[Optional[list[str]], typer.Option("--task", help="ppl (perplexity, KL by position; the default), recall (a passage repeated after filler), passkey (repeatable)")] = None,
    windows: Annotated[Optional[int], typer.Option(help="ppl: evaluation windows (default 64); recall / passkey: items per --context (default 8)")] = None,
    seq_len: Annotated[int, typer.Option(help="ppl: tokens per window")] = 512,
    context: Annotated[Optional[list[int]], typer.Option("--context", help="recall / passkey: tokens per window (repeatable; default 1024, 2048, 4096)")] = None,
    passage_tokens: Annotated[Optional[int], typer.Option(help="recall: tokens of the repeated passage (default 256)")] = None,
    seed: int = 0,
    generate: Annotated[int, typer.Option(help="prompts for the greedy-generation check (0: skip)")] = 4,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the results (and what identifies the run) as JSON here")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="draw recall by distance, pass-key by context and KL by position, one line per format, to this PNG")] = None,
    text_field: TextFieldOpt = "text",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    stream: StreamOpt = "auto",
    tokenizer: TokenizerOpt = None,
    allow_other_model: Annotated[bool, typer.Option("--allow-other-model", help="use a calibration made for another model of the same shape")] = False,
    debug: DebugOpt = False,
) -> None:
    """Accuracy of each KV format against the unquantized model: perplexity, KL and top-1 agreement; retrieval at long context.

    --task ppl (the default) scores windows of --seq-len tokens, with KL by position; --task recall / passkey score
    retrieval from --context tokens back."""
    from trtkv.evaluate import EvalResult, position_table_rows, run_eval, table_rows, write_json
    from trtkv.long_context import passkey_table_rows, recall_table_rows
    from trtkv.long_context import plot as draw
    from trtkv.tables import print_table

    for path, flag in ((json_out, "--json"), (plot, "--plot")):
        if path is not None:
            _check_writable_file(path, flag)
    meta: dict = {}
    results = run_eval(
        model,
        dataset,
        kv or None,
        calibration=calibration,
        tasks=task,
        contexts=context,
        passage_tokens=passage_tokens,
        windows=windows,
        seq_len=seq_len,
        seed=seed,
        device=device,
        dtype=dtype,
        text_field=text_field,
        generate_prompts=generate,
        tokenizer=tokenizer,
        allow_other_model=allow_other_model,
        meta=meta,
        stream=stream,
    )
    ppl = [r for r in results if isinstance(r, EvalResult)]
    tables = [table_rows(ppl)] if ppl else []
    if any(len(r.kld_by_position) > 1 for r in ppl):  # a window long enough for several position buckets
        tables.append(position_table_rows(ppl))
    tables += [t for t in (recall_table_rows(results), passkey_table_rows(results)) if t[2]]
    for title, columns, rows in tables:
        print_table(console, columns, rows, title)
    if plot is not None:
        draw(results, plot, title=f"{meta.get('model', '')}, {meta.get('dataset', '')}")
        err_console.print(f"plot written to [bold]{plot}[/]")
    if json_out is not None:
        write_json(results, json_out, meta)
        err_console.print(f"results written to [bold]{json_out}[/]")


def _check_writable_file(path: Path, flag: str) -> None:
    """A file output must not be a directory: checked before the long run."""
    if Path(path).is_dir():
        raise TrtkvError(f"{flag} {path} is a directory", f"pass a file path to {flag}, e.g. {Path(path) / 'out.json'}")


@app.command()
@handle_errors
def plan(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="model to plan for (or give --layers/--kv-heads/--head-dim)")] = None,
    layers: Annotated[Optional[int], typer.Option(help="number of layers")] = None,
    kv_heads: Annotated[Optional[int], typer.Option(help="number of KV heads")] = None,
    head_dim: Annotated[Optional[int], typer.Option(help="head dimension")] = None,
    weights_gib: Annotated[Optional[float], typer.Option(help="weight memory in GiB (default: from the model, fp16)")] = None,
    kv: Annotated[Optional[list[str]], typer.Option("--kv", help="KV formats to plan (repeatable): " + KV_HELP + "; default: fp16, int8, fp8, int4")] = None,
    gpu: Annotated[Optional[str], typer.Option(help="A100-40GB, A100-80GB, H100-80GB, H200-141GB, L4-24GB, RTX4090-24GB, or auto (this machine's GPU via pynvml)")] = None,
    gpu_mem: Annotated[Optional[float], typer.Option(help="GPU memory in GiB (instead of --gpu)")] = None,
    context: Annotated[int, typer.Option(help="context length per sequence")] = 4096,
    reserve: Annotated[float, typer.Option(help="fraction of the GPU's memory kept for activations and workspace; the KV cache "
                                           "takes the rest after the weights (the rule of `trtkv serve --reserve`)")] = DEFAULT_RESERVE,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the plan as JSON here")] = None,
    debug: DebugOpt = False,
) -> None:
    """KV bytes per token for each format and the largest batch x context that fits a GPU."""
    from trtkv.formats import fit_formats, get_format
    from trtkv.plan import DEFAULT_GPU, GIB, gpu_memory_bytes
    from trtkv.plan import plan as make_plan
    from trtkv.tables import Column, print_table

    for f in kv or []:
        get_format(f)  # a bad spec is reported before the model is read
    shape = _plan_shape(model, layers, kv_heads, head_dim, weights_gib)
    formats, notes = fit_formats(kv or ["fp16", "int8", "fp8", "int4"], shape.head_dim, optional=not kv)
    gpu_bytes = gpu_memory_bytes(gpu, gpu_mem)
    gpu_name = f"{gpu} " if gpu else ("" if gpu_mem is not None else f"{DEFAULT_GPU} (assumed; pass --gpu or --gpu-mem) ")
    budget, rows = make_plan(shape, formats, context_len=context, gpu_bytes=gpu_bytes, reserve_fraction=reserve)
    for note in notes:
        err_console.print(f"note: {note}", highlight=False, soft_wrap=True)
    title = (
        f"{shape.name}: {shape.num_layers} layers x {shape.num_kv_heads} KV heads x head_dim {shape.head_dim}; "
        f"GPU {gpu_name}{gpu_bytes / GIB:.1f} GiB, weights {shape.weight_bytes / GIB:.2f} GiB, KV budget {budget / GIB:.2f} GiB, context {context}"
    )
    columns = [Column("format", numeric=False), Column("pool bits"), Column("open KiB/seq"), Column(f"bits@{context}"), Column("KiB/tok"), Column("max tokens"),
               Column(f"batch @{context}"), Column("vs fp16"), Column("cached KiB/tok")]
    table_rows = [
        [r.format, f"{r.pool_bits_per_element:.3f}", f"{r.tail_bytes_per_slot / 1024:,.0f}", f"{r.bits_per_element:.3f}", f"{r.kv_bytes_per_token / 1024:.2f}", f"{r.max_tokens:,}",
         f"{r.max_batch:,}", f"{r.capacity_vs_fp16:.2f}x", f"{r.cached_bytes_per_token / 1024:.2f}"]
        for r in rows
    ]
    print_table(console, columns, table_rows, title)
    for r in rows:
        if r.constant_bytes:  # codebooks (nuq): a per-layer constant, taken from the budget once (docs/kv-formats.md §6)
            console.print(f"{r.format}: codebooks {r.constant_bytes / 1024:,.1f} KiB for all layers, taken from the KV budget before the tokens")
    if shape.sliding_window and any(len(r.by_layer_type) > 1 or r.window_saving != 1.0 for r in rows):
        by_type = [
            [r.format, t.layer_type, f"{t.layers}", f"{t.tokens_held:,}", f"{t.bytes_per_sequence / 2**20:,.2f}"]
            for r in rows for t in r.by_layer_type
        ] + [[r.format, "all (freed window blocks)", f"{shape.num_layers}", "", f"{r.kv_bytes_per_token * context / 2**20:,.2f}  ({r.window_saving:.2f}x less than all-global)"] for r in rows]
        print_table(console, [Column("format", numeric=False), Column("layer type", numeric=False), Column("layers"), Column("tokens held/layer"), Column("MiB per sequence", numeric=False)],
                    by_type, f"per layer type at context {context}: sliding layers keep the blocks in their window of {shape.sliding_window} (+ the open block)")
    if json_out is not None:
        payload = {
            "model": shape.__dict__,
            "gpu": gpu or (None if gpu_mem is not None else DEFAULT_GPU),
            "gpu_bytes": gpu_bytes,
            "kv_budget_bytes": budget,
            "context": context,
            "rows": [{**r.__dict__, "by_layer_type": [t.__dict__ for t in r.by_layer_type]} for r in rows],
            "formats": {f.name: f.spec() for f in formats},
            "notes": notes,
        }
        _atomic_write_text(json_out, json.dumps(payload, indent=2))


def _plan_shape(model, layers, kv_heads, head_dim, weights_gib):
    from trtkv.plan import GIB, ModelShape

    flags = (layers, kv_heads, head_dim)
    if model is None and None in flags:
        raise TrtkvError("plan needs a model or all of --layers, --kv-heads, --head-dim", "pass --model smollm2-135m or the three flags")
    if model is not None:
        from trtkv.models import model_info

        info = model_info(model)
        shape = ModelShape.from_info(info, weight_bytes=info.num_params * 2)
    else:
        shape = ModelShape("custom", layers, kv_heads, head_dim, 0)
    overrides = {k: v for k, v in zip(("num_layers", "num_kv_heads", "head_dim"), flags) if v is not None}
    for key, value in overrides.items():
        if value <= 0:
            raise TrtkvError(f"--{key.replace('num_', '').replace('_', '-')} must be positive, got {value}", "pass a positive integer")
    if weights_gib is not None:
        overrides["weight_bytes"] = int(weights_gib * GIB)
    if "num_layers" in overrides and overrides["num_layers"] != shape.num_layers:  # the model's layer types no longer apply
        overrides.update(layer_types=(), sliding_window=None)
    return ModelShape(**{**shape.__dict__, **overrides})


def _atomic_write_text(path: Path, text: str) -> None:
    """Write next to the target and rename, so a failed write never leaves a half file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:
        raise TrtkvError(f"cannot write {path}: {exc.strerror}", "choose a writable output path") from None


def register_stage_commands(target: typer.Typer = app) -> list[str]:
    """Add each stage's commands (calibrate/export, build-engine/inspect, serve/triton-repo/generate).

    Stages announce them through the ``trtkv.commands`` entry points in pyproject.toml, so this core module
    imports no stage; entry points are taken in name order, which is the pipeline's.
    """
    from importlib.metadata import entry_points

    names = []
    for ep in sorted(entry_points(group=STAGE_COMMANDS), key=lambda e: e.name):
        ep.load()(target, handle_errors)
        names.append(ep.name)
    return names


STAGE_COMMANDS = "trtkv.commands"
register_stage_commands()


if __name__ == "__main__":
    sys.exit(app())
