"""``trtkv calibrate`` and ``trtkv export``: the calibration stage's commands (registered on the main app through the
``trtkv.commands`` entry point, so the core CLI imports no stage)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from trtkv.calibration import DEFAULT_BUDGET_FORMATS, DEFAULT_BUDGET_MARGIN, DEFAULT_BUDGET_WINDOWS, DEFAULT_FIT_WINDOWS
from trtkv.cli_options import DEFAULT_DATASET, DEFAULT_MODEL, DatasetOpt, DebugOpt, DeviceOpt, DtypeOpt, ModelOpt, StreamOpt, TextFieldOpt, TokenizerOpt
from trtkv.errors import TrtkvError
from trtkv.preset_names import BUDGET_NAME, KV_HELP

console = Console()


def register(app: typer.Typer, handle_errors) -> None:
    @app.command()
    @handle_errors
    def calibrate(
        model: ModelOpt = DEFAULT_MODEL,
        dataset: DatasetOpt = DEFAULT_DATASET,
        out: Annotated[Path, typer.Option("--out", "-o", help="output directory (written atomically)")] = Path("trtkv-out/calibration"),
        kv: Annotated[Optional[list[str]], typer.Option("--kv", help="KV formats to calibrate (repeatable): " + KV_HELP + "; default: int8-static, fp8, int4")] = None,
        method: Annotated[str, typer.Option(help="max | percentile | mse")] = "mse",
        samples: Annotated[Optional[int], typer.Option(help="calibration windows (default: every window of the calib split, at most 64)")] = None,
        seq_len: Annotated[int, typer.Option(help="tokens per window")] = 512,
        seed: int = 0,
        batch_size: int = 4,
        text_field: TextFieldOpt = "text",
        device: DeviceOpt = "auto",
        dtype: DtypeOpt = "auto",
        stream: StreamOpt = "auto",
        tokenizer: TokenizerOpt = None,
        budget: Annotated[Optional[str], typer.Option(help="also choose per-layer K / V bits within this budget: kl=NATS or ppl=PERCENT "
                                                      "(accuracy, e.g. kl=0.01), or bits=POOL_BITS (size: the least-KL mix, e.g. bits=2.5)")] = None,
        budget_formats: Annotated[str, typer.Option(help="the formats --budget chooses among, comma-separated presets or spec strings; "
                                                             "they are brought to the largest block size and the most sink tokens among them; a token-age one "
                                                             "(e.g. int2,recent=3:int4) competes whole with the per-layer mix, its bits counted at --seq-len")] = ",".join(DEFAULT_BUDGET_FORMATS),
        budget_windows: Annotated[int, typer.Option(help="calibration windows --budget measures on")] = DEFAULT_BUDGET_WINDOWS,
        budget_margin: Annotated[float, typer.Option(help="how far below the budget --budget aims, a fraction (held-out text costs more than calibration windows)")] = DEFAULT_BUDGET_MARGIN,
        budget_name: Annotated[str, typer.Option(help="name of the format --budget saves (use it as --kv NAME)")] = BUDGET_NAME,
        codebooks: Annotated[str, typer.Option(help="nuq formats: fit the levels per KV head (head) or once per layer, heads pooled (layer)")] = "head",
        fit_windows: Annotated[int, typer.Option(help="whole calibration windows kept (in the artifact's statistics) to fit codebooks and "
                                                     "per-channel bits on (the int3 / int2 presets)")] = DEFAULT_FIT_WINDOWS,
        debug: DebugOpt = False,
    ) -> None:
        """Collect K/V statistics on calibration text and choose scales for each KV format (and, with --budget, per-layer bits)."""
        from trtkv.calibration.run import run_calibration
        from trtkv.formats import split_specs

        if method not in ("max", "percentile", "mse"):
            raise TrtkvError(f"unknown calibration method {method!r}", "use --method max, percentile or mse")
        path = run_calibration(
            model,
            dataset,
            out,
            formats=kv or None,
            method=method,
            samples=samples,
            seq_len=seq_len,
            seed=seed,
            device=device,
            dtype=dtype,
            text_field=text_field,
            batch_size=batch_size,
            tokenizer=tokenizer,
            budget=budget,
            budget_formats=split_specs(budget_formats),
            budget_windows=budget_windows,
            budget_name=budget_name,
            budget_margin=budget_margin,
            stream=stream,
            codebooks=codebooks,
            fit_windows=fit_windows,
        )
        console.print(f"calibration written to [bold]{path}[/]")

    @app.command()
    @handle_errors
    def export(
        calibration: Annotated[Path, typer.Option(help="calibration directory from `trtkv calibrate`")],
        to: Annotated[str, typer.Option("--to", help="vllm (Hugging Face checkpoint + compressed-tensors KV scheme) | trtllm (TensorRT-LLM checkpoint)")],
        out: Annotated[Path, typer.Option("--out", "-o", help="output directory (written atomically)")],
        model: ModelOpt = DEFAULT_MODEL,
        kv: Annotated[str, typer.Option("--kv", help="KV format to export: fp8 (vllm, trtllm), int8-static (trtllm)")] = "fp8",
        tp_size: Annotated[int, typer.Option(help="tensor-parallel ranks (trtllm: one rank file each; vllm: echoed in the serve command)")] = 1,
        force: Annotated[bool, typer.Option("--force", help="replace an existing --out")] = False,
        dtype: Annotated[str, typer.Option(help="weights dtype: auto (the source's fp16/bf16, else float16) | float16 | bfloat16 | float32")] = "auto",
        max_shard_size: Annotated[str, typer.Option(help="vllm: largest safetensors shard (e.g. 5GB, 500MB)")] = "5GB",
        q_windows: Annotated[Optional[int], typer.Option(help="trtllm fp8: calibration windows run to measure the query range (default all; 0 skips)")] = None,
    ) -> None:
        """Write a complete vLLM or TensorRT-LLM checkpoint of the model with the calibrated KV scales."""
        from rich.console import Console

        from trtkv.calibration.checkpoint import export_checkpoint

        err = Console(stderr=True, soft_wrap=True)
        res = export_checkpoint(calibration, model, to, out, kv=kv, tp_size=tp_size, force=force, dtype=dtype,
                                max_shard_size=max_shard_size, q_windows=q_windows,
                                progress=lambda line: err.print(line, highlight=False))
        console.print(f"{res.target} checkpoint ({res.format} KV, {res.dtype} weights, {len(res.files)} files) written to [bold]{res.out}[/]", soft_wrap=True)
        for note in res.notes:
            console.print(f"  {note}", soft_wrap=True)
        console.print(f"next: {res.next_step()}", soft_wrap=True, highlight=False)
