"""``trtkv build-engine`` and ``trtkv inspect`` (registered on the main app by trtkv/cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from trtkv.errors import TrtkvError
from trtkv.preset_names import KV_HELP

console = Console()


def _caps(text: str) -> list[int]:
    try:
        caps = [int(c.strip().lower().removeprefix("sm").replace(".", "")) for c in text.split(",") if c.strip()]
    except ValueError:
        raise TrtkvError(f"invalid --compute-capability {text!r}", "give numbers like 80,86,89,120") from None
    if not caps:
        raise TrtkvError("--compute-capability is empty", "give numbers like 80,86,89,120")
    return caps


def register(app: typer.Typer, handle_errors) -> None:
    @app.command("build-engine")
    @handle_errors
    def build_engine_cmd(
        model: Annotated[str, typer.Option("--model", "-m", help="HF model dir, .gguf file, or the builtin alias smollm2-135m")] = "smollm2-135m",
        calibration: Annotated[Optional[Path], typer.Option(help="calibration directory from `trtkv calibrate` (formats with static scales / smoothing need it)")] = None,
        kv: Annotated[str, typer.Option("--kv", help="KV format of the engine's paged cache: " + KV_HELP)] = "int4",
        out: Annotated[Path, typer.Option("--out", "-o", help="engine directory (written atomically)")] = Path("trtkv-out/engine"),
        backend: Annotated[str, typer.Option(help="auto | onnxruntime | tensorrt-rtx | tensorrt | torch (the torch engine: no network, the model by "
                                                  "reference, runs on CPU or CUDA); auto: tensorrt on a GPU with TensorRT installed, else torch")] = "auto",
        attention: Annotated[str, typer.Option(help="native | plugin")] = "native",
        max_batch: Annotated[int, typer.Option(help="most sequences the engine runs at once: the batch limit `serve --max-seqs` defaults to and cannot exceed")] = 16,
        max_seq_len: Annotated[Optional[int], typer.Option(help="longest sequence (prompt + generated)", show_default="the model's context, bounded by the memory plan")] = None,
        block_size: Annotated[Optional[int], typer.Option(help="tokens per sealed block (default: the format's own, else 64)")] = None,
        compute_capability: Annotated[str, typer.Option("--compute-capability", help="TensorRT-RTX targets, e.g. 80,86,89,120")] = "80,86,89,120",
        dtype: Annotated[Optional[str], typer.Option(help="fp16 | fp32 compute (default: fp32 on onnxruntime, fp16 on TensorRT)")] = None,
        force: Annotated[bool, typer.Option("--force", help="replace an existing --out")] = False,
    ) -> None:
        """Build an engine directory for one KV format: the torch engine (CPU or CUDA), or an ONNX step network for ONNX Runtime, TensorRT-RTX or TensorRT."""
        from trtkv.builder.build import build_engine

        build_engine(
            model, calibration, kv, out, backend=backend, attention=attention, max_batch=max_batch, max_seq_len=max_seq_len,
            block_size=block_size, compute_capabilities=_caps(compute_capability), dtype=dtype, force=force, console=console,
        )

    @app.command("inspect")
    @handle_errors
    def inspect_cmd(engine_dir: Annotated[Path, typer.Argument(help="engine directory from `trtkv build-engine`")]) -> None:
        """Print and validate an engine directory's manifest."""
        from trtkv.manifest import load_manifest

        m = load_manifest(engine_dir)
        print_manifest(m, engine_dir)


def _runs(items: list[str]) -> list[tuple[int, int, str]]:
    """(first, last, item) for each run of equal consecutive items."""
    out: list[tuple[int, int, str]] = []
    for i, it in enumerate(items):
        if out and out[-1][2] == it:
            out[-1] = (out[-1][0], i, it)
        else:
            out.append((i, i, it))
    return out


def print_manifest(m, engine_dir: Path) -> None:
    from trtkv.cache_layout import WindowRing

    md = m.model
    lim = m.limits
    console.print(f"[bold]engine[/] {engine_dir}  (schema {m.schema_version}, trtkv {m.trtkv_version}, built {m.created})  [green]valid[/]")
    console.print(f"model      {md.name} ({md.architecture}) sha256 {md.sha256[:16]}  {md.num_layers} layers, {md.num_heads} heads / {md.num_kv_heads} KV heads x {md.head_dim}, vocab {md.vocab_size}")
    fmt = m.kv_format
    console.print(f"kv format  {fmt.spec() if not fmt.is_per_layer else fmt.name + ' (per layer, below)'}  ({fmt.name})")
    if fmt.is_per_layer:
        for which in ("k", "v"):
            runs = _runs([getattr(f, which).short() for f in fmt.layer_formats()])
            console.print(f"  {which.upper()} per layer  " + "; ".join(f"layers {a}-{b}: {s}" if a != b else f"layer {a}: {s}" for a, b, s in runs))
        console.print(f"  pool bits  {fmt.pool_bits_per_element(md.head_dim):.3f} per element (mean over layers); the K / V pool tables below are layer 0's")
    console.print(f"backend    {m.backend} · {m.attention} attention · {m.dtype} · opset {m.opset}")
    console.print(f"limits     batch <= {lim.max_batch}, seq <= {lim.max_seq_len}, block {lim.block_size}, <= {lim.max_blocks_per_seq} blocks/seq, "
                  f"<= {lim.max_new_tokens_per_step} new tokens/step, pool <= {lim.max_num_blocks} blocks (TensorRT profile)")
    console.print(f"bytes      {m.bytes_per_token:,.1f} B/token in the pool (K+V, all layers, scales included); {m.bytes_per_block:,} B/block; "
                  f"{m.tail_bytes_per_slot:,} B per sequence slot (fp16 open blocks{' and the ring of recent blocks' if m.kv_format.token_aged else ''})")
    ring = WindowRing.of(md, lim.block_size)
    if ring is not None:
        lay, n_global = m.layout(1, 1), md.num_layers - len(ring.layers)
        console.print(f"layers     {len(ring.layers)} sliding (window {ring.window}) + {n_global} global; with the torch engine the sliding layers "
                      f"free passed blocks: a ring of {ring.ring_blocks} blocks per slot ({ring.bytes_per_slot(lay):,} B), and pool blocks hold "
                      f"the global layers only ({lay.block_bytes(i for i in range(md.num_layers) if i not in ring.layers):,} B/block; "
                      "--keep-window-blocks keeps every layer's)")
    cal = m.calibration
    console.print(f"calibration {cal.path or 'none'}" + (f" sha256 {cal.sha256[:16]} format {cal.format_name}" if cal.sha256 else ""))
    t = Table(title="pool layout (per layer; tensors stacked over layers)")
    for col in ("", "format", "data", "scale", "zero"):
        t.add_column(col, overflow="fold")
    bs, H = lim.block_size, md.num_kv_heads
    for which, p in (("K", m.k_pool), ("V", m.v_pool)):
        scale = {"none": "—", "per_token": f"[blocks, {H}, {bs}, {p.groups}] fp16", "per_block": f"[blocks, {H}, {md.head_dim}] fp16"}[p.scale]
        t.add_row(which, p.tensor_format, f"[blocks, {H}, {bs}, {p.packed_dim}] {p.data_dtype}", scale, scale if p.zero else "—")
    t.add_row("tail", "fp16", f"[slots, {H}, {bs}, {md.head_dim}] float16", "—", "—")
    console.print(t)
    io = Table(title="step network")
    for col in ("", "name", "shape", "dtype"):
        io.add_column(col)
    for kind, specs in (("in", m.inputs), ("out", m.outputs)):
        for s in specs:
            io.add_row(kind, s.name, str(s.shape), s.dtype + (f" (holds {s.storage_dtype})" if s.storage_dtype else ""))
    console.print(io)
    for p in m.plans:
        console.print(f"plan       SM{p.compute_capability}: {p.path} {p.bytes / 2**20:.1f} MiB, built in {p.build_seconds:.1f} s")
    versions = ", ".join(f"{k} {v}" for k, v in m.build.get("versions", {}).items() if v)
    console.print(f"built with {versions}; stages {m.build.get('stage_seconds', {})}")
    for name, need in m.runtime_needs.items():
        console.print(f"run with   {name}: {need}")
