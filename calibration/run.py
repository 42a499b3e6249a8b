"""``trtkv calibrate``: model + calibration text -> K/V statistics -> scales -> artifact directory."""

from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path
from typing import Any, Sequence

from trtkv import __version__
from trtkv.artifacts import CalibrationRecipe, FormatCalibration, LayerChoice, LayerParams, ModelIdentity, json_floats, save_calibration
from trtkv.calibration import DEFAULT_BUDGET_FORMATS, DEFAULT_BUDGET_MARGIN, DEFAULT_BUDGET_WINDOWS, DEFAULT_FIT_WINDOWS
from trtkv.calibration.budget import Budget, Scorer, align_candidates, check_candidates, choose_layer_bits, render_choice
from trtkv.calibration.export import export_all
from trtkv.calibration.report import render_report
from trtkv.calibration.scales import METHODS, choose_params, clip_ratio, default_clip_grid, default_static_grid, reservoir_error
from trtkv.calibration.stats import DEFAULT_RESERVOIR, KVStats, collect_stats
from trtkv.errors import TrtkvError
from trtkv.formats import KVFormat, fit_formats, get_format
from trtkv.preset_names import BUDGET_NAME

DEFAULT_FORMATS = ("int8-static", "fp8", "int4")  # calibrated when no --kv is given
CODEBOOK_SCOPES = ("head", "layer")  # a nuq format's levels: one table per KV head, or one per layer (heads pooled)


def wants_params(fmt: KVFormat, method: str) -> bool:
    """Calibrate a format when it needs static scales / smoothing, or (mse) when it has dynamic scales to clip."""
    return fmt.needs_calibration or (method == "mse" and any(t.is_quantized and t.is_dynamic and not t.is_block_wise for t in (fmt.k, fmt.v)))


def resolve_formats(formats: Sequence[str | KVFormat] | None, head_dim: int | None = None) -> tuple[list[KVFormat], list[str]]:
    """The formats to calibrate and one-line notes: the requested ones, or ``DEFAULT_FORMATS`` when none are.

    With ``head_dim`` every format is fitted to the model (``trtkv.formats.fit_formats``): presets get
    group sizes that divide ``head_dim`` (said in a note); a default that cannot fit is skipped with a
    note; a requested format that cannot fit is an error. De-duplicated by name, in order.
    """
    specs = list(formats) if formats else list(DEFAULT_FORMATS)
    if head_dim is None:
        fmts, notes = [get_format(s) for s in specs], []
    else:
        fmts, notes = fit_formats(specs, head_dim, optional=not formats)
    out: dict[str, KVFormat] = {}
    for f in fmts:
        out.setdefault(f.name, f)
    return list(out.values()), notes


def _summary(t) -> list[float] | float | None:
    """Scale / clip tensor for recipe.json: per_channel [H, D] is summarised as the per-head max."""
    if t is None:
        return None
    if t.dim() == 2:
        t = t.amax(-1)
    return json_floats(t)


def layer_choices(params: Sequence[LayerParams], ratios: dict[str, list[float | None]]) -> list[LayerChoice]:
    import torch

    out = []
    for i, lp in enumerate(params):
        out.append(LayerChoice(
            layer=i,
            k_scale=_summary(lp.k.scale), v_scale=_summary(lp.v.scale),
            k_clip=_summary(lp.k.clip), v_clip=_summary(lp.v.clip),
            k_smooth_max=None if lp.k.smooth is None else float(lp.k.smooth.max()),
            v_smooth_max=None if lp.v.smooth is None else float(lp.v.smooth.max()),
            k_clip_ratio=(ratios.get("k") or [None] * len(params))[i],
            v_clip_ratio=(ratios.get("v") or [None] * len(params))[i],
            k_codebook=None if lp.k.codebook is None else [json_floats(row, 5) for row in lp.k.codebook.reshape(-1, lp.k.codebook.shape[-1])],
            v_codebook=None if lp.v.codebook is None else [json_floats(row, 5) for row in lp.v.codebook.reshape(-1, lp.v.codebook.shape[-1])],
            k_channels_at_bits=None if lp.k.bits is None else torch.bincount(lp.k.bits.long().flatten()).tolist(),
            v_channels_at_bits=None if lp.v.bits is None else torch.bincount(lp.v.bits.long().flatten()).tolist(),
        ))
    return out


def calibrate_formats(
    stats: KVStats,
    formats: Sequence[KVFormat],
    method: str = "mse",
    progress: Any = None,
    rope: Any = None,
    **knobs: Any,
) -> tuple[dict[str, list[LayerParams]], dict[str, FormatCalibration], dict[str, dict], dict[str, dict]]:
    """Choose params for every format that wants them. Returns (params, recipe entries, ratios, errors).

    ``progress(line)``, when given, gets one line per format as its search ends (it takes minutes on an 8B model);
    ``rope`` (each layer's ``trtkv.rope.RopeTable``): for formats that allocate bits to keys stored before RoPE."""
    params: dict[str, list[LayerParams]] = {}
    entries: dict[str, FormatCalibration] = {}
    ratios: dict[str, dict] = {}
    errors: dict[str, dict] = {}
    for fmt in formats:
        if not wants_params(fmt, method):
            continue
        t0 = time.perf_counter()
        p = choose_params(stats, fmt, method, rope=rope, **knobs)
        params[fmt.name] = p
        ratios[fmt.name] = clip_ratio(stats, fmt, p)
        err = reservoir_error(stats, fmt, p)
        if method != "max":
            base = reservoir_error(stats, fmt, choose_params(stats, fmt, "max", smooth_alpha=knobs.get("smooth_alpha", 0.5), rope=rope))
            err.update({"k_max": base["k"], "v_max": base["v"]})
        errors[fmt.name] = err
        entries[fmt.name] = FormatCalibration(definition=fmt, method=method, layers=layer_choices(p, ratios[fmt.name]), mse=err)
        if progress is not None:
            progress(f"  scales of {fmt.name} ({method}) in {time.perf_counter() - t0:.1f} s")
    return params, entries, ratios, errors


def _load(model: str, info: Any, tok: Any, windows: Any, *, device: str, dtype: str, batch_size: int, reservoir: int,
          stream: str, can_stream: bool, console: Any) -> Any:
    """The model as the memory plan says (``trtkv.streaming.load_planned``) for calibration's working set: the windows'
    hidden states and the reservoir. ``--budget`` scores every layer's choice on the whole model: no streaming."""
    import torch

    from trtkv.memory import activation_bytes
    from trtkv.streaming import load_planned

    n, seq_len = windows.shape
    f32 = 4
    held = n * seq_len * info.hidden_size * f32  # every window's hidden states, between two streamed layers
    res = 2 * info.num_layers * reservoir * info.num_kv_heads * info.head_dim * f32  # the reservoir sample of K and V
    acts = activation_bytes(info, batch=min(batch_size, n), seq_len=seq_len, dtype=torch.float32, logits=False) + held + res
    if stream == "always" and not can_stream:
        raise TrtkvError("--budget measures each layer's choice on the whole model, which a layer-streamed run does not hold",
                         "drop --stream always (or --budget), or give the process memory for the resident model")
    return load_planned(model, info, tok, command="calibrate", windows=(n, seq_len), activations=acts, device=device, dtype=dtype,
                        stream=stream, can_stream=can_stream, console=console)


DEFAULT_MAX_SAMPLES = 64  # windows used when --samples is not given (fewer if the calib split is smaller)


def run_calibration(
    model: str,
    dataset: str,
    out: Path,
    *,
    formats: Sequence[str] | None = None,
    method: str = "mse",
    samples: int | None = None,
    seq_len: int = 512,
    seed: int = 0,
    device: str = "auto",
    dtype: str = "auto",
    text_field: str = "text",
    batch_size: int = 4,
    progress: bool = True,
    percentile: float = 99.9,
    smooth_alpha: float = 0.5,
    codebooks: str = "head",
    reservoir: int = DEFAULT_RESERVOIR,
    loaded: Any = None,
    tokenizer: str | Path | None = None,
    budget: str | None = None,
    budget_formats: Sequence[str] = DEFAULT_BUDGET_FORMATS,
    budget_windows: int = DEFAULT_BUDGET_WINDOWS,
    budget_name: str = BUDGET_NAME,
    budget_margin: float = DEFAULT_BUDGET_MARGIN,
    stream: str = "auto",
    fit_windows: int = DEFAULT_FIT_WINDOWS,
) -> Path:
    """Calibrate ``model`` on the calib split of ``dataset`` and write the artifact to ``out``.

    Calibrates ``formats`` (default: ``DEFAULT_FORMATS``), fitted to the model's head_dim; returns the
    artifact path. ``loaded`` (a ``trtkv.models.LoadedModel`` of ``model``) skips loading the model
    again; ``tokenizer`` is a directory with tokenizer files for a model that has none. ``budget`` (``kl=...`` or
    ``ppl=...%``) also chooses per-layer K / V storage among ``budget_formats`` on ``budget_windows`` of the calibration
    windows, aiming ``budget_margin`` (a fraction) below the budget (calibration/budget.py), and saves it as format
    ``budget_name``. ``stream`` (auto | always | never): the layers are streamed from the checkpoint one at a time
    (trtkv.streaming; the same statistics) when the memory plan says the resident model does not fit, always, or never.
    ``codebooks`` (head | layer): a ``nuq`` format's levels are fitted per KV head or once per layer (heads pooled).
    ``fit_windows``: whole calibration windows kept in the statistics, which ``nuq`` codebooks and ``allocB`` bits are
    fitted on.

    Everything knowable without the weights (formats vs head_dim, ``out``, the tokenizer, the number
    of windows) is checked before the weights are loaded.
    """
    from rich.console import Console

    from trtkv.data import adds_bos, describe_dataset, token_windows, window_count
    from trtkv.models import load_tokenizer, model_info, resolve_device, resolve_dtype

    if method not in METHODS:
        raise TrtkvError(f"unknown calibration method {method!r}", f"use --method {' | '.join(METHODS)}")
    if batch_size < 1:
        raise TrtkvError(f"--batch-size must be at least 1, got {batch_size}", "pass e.g. --batch-size 4")
    out_path = Path(out).expanduser()
    if out_path.exists() and not out_path.is_dir():
        raise TrtkvError(f"--out {out} exists and is not a directory", "pass a directory path for the artifact (an existing artifact directory is replaced)")
    if fit_windows < 1:
        raise TrtkvError(f"--fit-windows must be at least 1, got {fit_windows}", f"pass e.g. --fit-windows {DEFAULT_FIT_WINDOWS}")
    if codebooks not in CODEBOOK_SCOPES:
        raise TrtkvError(f"unknown --codebooks {codebooks!r}", f"use one of: {', '.join(CODEBOOK_SCOPES)}")
    info = loaded.info if loaded is not None else model_info(model)
    fmts, notes = resolve_formats(formats, info.head_dim)
    want_budget = Budget.parse(budget, budget_margin) if budget is not None else None
    candidates: list[KVFormat] = []
    if want_budget is not None:
        if budget_windows < 1:
            raise TrtkvError(f"--budget-windows must be at least 1, got {budget_windows}", "pass e.g. --budget-windows 4")
        aligned, budget_notes = align_candidates(resolve_formats(budget_formats, info.head_dim)[0])
        candidates = check_candidates(aligned)
        notes += budget_notes
        fmts += [c for c in candidates if c.name not in {f.name for f in fmts}]
    console = Console(stderr=True, quiet=not progress, soft_wrap=True)
    if loaded is None:
        resolve_dtype(dtype, resolve_device(device))
    tok = loaded.tokenizer if loaded is not None and tokenizer is None else load_tokenizer(model, tokenizer)
    if samples is None:  # every calib window, capped so a large corpus does not calibrate for hours
        samples = min(window_count(tok, dataset, seq_len=seq_len, split="calib", text_field=text_field), DEFAULT_MAX_SAMPLES) or None
    windows = token_windows(tok, dataset, seq_len=seq_len, samples=samples, seed=seed, split="calib", text_field=text_field)
    for note in notes:
        console.print(f"note: {note}", highlight=False)

    if loaded is None:
        loaded = _load(model, info, tok, windows, device=device, dtype=dtype, batch_size=batch_size, reservoir=reservoir,
                       stream=stream, can_stream=want_budget is None, console=console)
    how = ", streamed layer by layer" if loaded.streamer is not None else ""
    console.print(f"[bold]calibrating[/] {loaded.info.name} on {windows.shape[0]} x {seq_len} tokens ({loaded.device}, {loaded.dtype}{how})")

    stats = collect_stats(loaded, windows, batch_size=batch_size, progress=progress, reservoir=reservoir, seed=seed, sample_windows=fit_windows)
    tokens_per_s = stats.count / stats.seconds if stats.seconds else 0.0

    t0 = time.perf_counter()
    knobs = dict(percentile=percentile, smooth_alpha=smooth_alpha, codebook_per_head=codebooks == "head")
    console.print(f"{stats.count:,} tokens through the model in {stats.seconds:.1f} s; choosing scales ({method}, "
                  f"{stats.reservoir_size} sampled rows per layer)", highlight=False)
    rope = None
    if any(t.allocated_bits is not None and t.pre_rope for f in fmts for lf in f.layer_formats() for t in (lf.k, lf.v)):
        from trtkv.rope import RopeTable

        rope = RopeTable.per_layer(loaded.model)
    params, entries, ratios, errors = calibrate_formats(stats, fmts, method, progress=lambda line: console.print(line, highlight=False),
                                                        rope=rope, **knobs)
    search_s = time.perf_counter() - t0
    choice = None
    if want_budget is not None:
        t0 = time.perf_counter()
        per_layer = [c for c in candidates if not c.token_aged]
        console.print(f"[bold]budget[/] {want_budget}: measuring {loaded.info.num_layers} layers x K/V x up to {len(per_layer) - 1} narrower formats "
                      f"on {min(budget_windows, windows.shape[0])} windows" + (f", then {len(candidates) - len(per_layer)} with recent=" if len(per_layer) < len(candidates) else ""))
        scorer = Scorer(loaded.model, windows[:budget_windows].to(loaded.device), batch_size)
        others = windows[budget_windows : 2 * budget_windows]  # the check's windows: not the search's, when there are enough
        checker = Scorer(loaded.model, others.to(loaded.device), batch_size) if len(others) else None
        choice = choose_layer_bits(scorer, candidates, params, want_budget, num_layers=loaded.info.num_layers, head_dim=loaded.info.head_dim,
                                   name=budget_name, check=checker, context_len=seq_len)
        if any(tp.tensors() for lp in choice.params for tp in (lp.k, lp.v)):  # every field: codebooks and bits too
            params[budget_name] = choice.params
        entries[budget_name] = FormatCalibration(definition=choice.fmt, method="budget", layers=layer_choices(choice.params, {}),
                                                 **choice.recipe_fields(), search_windows=min(budget_windows, len(windows)), check_windows=len(others))
        console.print(f"  {budget_name}: {choice.chosen if choice.mix else 'per-layer mix'}, {choice.bits(loaded.info.head_dim):.3f} bits at {seq_len} tokens (start "
                      f"{choice.start_bits:.3f}); measured KL {choice.measured.kl:.5f}, Δppl {choice.measured.ppl_delta_pct:+.3f} % "
                      f"({time.perf_counter() - t0:.0f} s)")

    exports: dict[str, list[str]] = {}
    files: dict[str, bytes] = {}
    for f in fmts:
        if f.name in params:
            ex = export_all(f, params[f.name], loaded.info)
            if ex:
                exports[f.name] = sorted(ex)
                files.update(ex)

    recipe = CalibrationRecipe(
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        trtkv_version=__version__,
        model=ModelIdentity.of(loaded.info),
        dataset=describe_dataset(dataset, text_field),
        samples=int(windows.shape[0]),
        seq_len=seq_len,
        windows_start_with_bos=adds_bos(tok),
        seed=seed,
        tokens=stats.count,
        method=method,
        options={**knobs, "reservoir": stats.reservoir_size, "fit_windows": stats.sample_windows, "batch_size": batch_size, "device": str(loaded.device),
                 "streamed": loaded.streamer is not None,
                 "dtype": str(loaded.dtype).replace("torch.", ""),
                 "static_grid": [round(x, 4) for x in default_static_grid().tolist()],
                 "clip_grid": [round(x, 4) for x in default_clip_grid().tolist()]},
        formats=entries,
        requested_formats=[f.name for f in fmts] + ([budget_name] if choice is not None else []),
        throughput={"tokens": float(stats.count), "seconds": round(stats.seconds, 3), "tokens_per_s": round(tokens_per_s, 1),
                    "search_seconds": round(search_s, 3)},
        exports=exports,
    )
    t0 = time.perf_counter()
    files.update(render_report(recipe, stats, ratios, errors, exports))
    console.print(f"  report in {time.perf_counter() - t0:.1f} s", highlight=False)
    if choice is not None:
        files["report.md"] = files["report.md"] + b"\n" + render_choice(choice, loaded.info.head_dim).encode()
    path = save_calibration(out, recipe, params, stats.to_tensors(), files)

    console.print(f"{stats.count:,} tokens in {stats.seconds:.1f} s ({tokens_per_s:,.0f} tokens/s); scale search {search_s:.1f} s")
    mean = lambda xs: f"{sum(xs) / len(xs):.3g}" if xs else "n/a"  # none: keys before RoPE (no positions in the reservoir)
    for name, err in errors.items():
        line = f"  {name:<14} K MSE {mean(err['k'])}  V MSE {mean(err['v'])}"
        if "k_max" in err:
            line += f"  (max calibration: {mean(err['k_max'])} / {mean(err['v_max'])})"
        console.print(line)
    skipped = [f.name for f in fmts if f.name not in params]
    if skipped:
        console.print(f"  no parameters needed: {', '.join(skipped)}")
    return path
