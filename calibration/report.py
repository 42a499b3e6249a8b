"""The calibration report: report.md plus PNG plots, returned as ``{relative path: bytes}``.

Plots (matplotlib, Agg backend):

* ``plots/absmax.png``      -- per-layer absmax of K (cached, post-RoPE), K pre-RoPE and V;
* ``plots/key_channels.png`` -- per-channel key absmax (pre-RoPE vs post-RoPE) for a few layers and
  a layers x channels heatmap: outliers sit in RoPE pairs (channel i and i + head_dim/2);
* ``plots/clipping.png``    -- the chosen clipping per layer for each calibrated format
  (range / max-calibration range; 1.0 means plain max calibration), one colour per format.

Layer axes have integer ticks; a value axis is logarithmic only when its values span a decade or more.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import torch

from trtkv.artifacts import CalibrationRecipe
from trtkv.calibration.stats import KVStats


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _layer_axis(axis) -> None:
    """Layers are integers: no fractional ticks (a 2-layer model would get 0, 0.2, ... 1)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _value_scale(ax, values: list[float]) -> None:
    """Log y axis only when the values span at least a decade; a narrow range stays linear and readable."""
    pos = [v for v in values if v > 0]
    if pos and max(pos) / min(pos) >= 10:
        ax.set_yscale("log")


def _colours(n: int) -> list:
    """``n`` distinct colours: tab10 up to 10, tab20 up to 20, then evenly spaced hues."""
    import matplotlib

    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [matplotlib.colormaps["tab20"](i) for i in range(n)]
    return [matplotlib.colormaps["hsv"](i / n) for i in range(n)]


def figure_absmax(stats: KVStats):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    x = list(range(stats.num_layers))
    values = []
    for kind, label, style in (("k", "K (cached, post-RoPE)", "-o"), ("k_pre", "K pre-RoPE", "--"), ("v", "V", "-s")):
        y = stats.absmax(kind, "per_tensor").tolist()
        values += y
        ax.plot(x, y, style, label=label, markersize=3)
    _value_scale(ax, values)
    _layer_axis(ax.xaxis)
    ax.set_xlabel("layer")
    ax.set_ylabel("absmax")
    ax.set_title("K / V absmax per layer")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def plot_absmax(stats: KVStats) -> bytes:
    return _png(figure_absmax(stats))


def _sample_layers(n: int, k: int = 4) -> list[int]:
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}) if n > 1 else [0]


def figure_key_channels(stats: KVStats):
    plt = _plt()
    layers = _sample_layers(stats.num_layers)
    D = stats.head_dim
    pre = stats.absmax("k_pre", "per_channel").amax(1)  # [L, D], max over heads
    post = stats.absmax("k", "per_channel").amax(1)
    fig = plt.figure(figsize=(11, 3.2 * (1 + (len(layers) + 1) // 2)))
    gs = fig.add_gridspec(1 + (len(layers) + 1) // 2, 2)
    for j, layer in enumerate(layers):
        ax = fig.add_subplot(gs[j // 2, j % 2])
        ax.plot(range(D), pre[layer].tolist(), label="pre-RoPE", lw=1)
        ax.plot(range(D), post[layer].tolist(), label="post-RoPE (cached)", lw=1)
        ax.axvline(D / 2 - 0.5, color="grey", ls=":", lw=0.8)
        ax.set_title(f"layer {layer}: key channel absmax (max over heads)")
        ax.set_xlabel("channel (i pairs with i + head_dim/2 in RoPE)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    row = 1 + (len(layers) - 1) // 2 if len(layers) > 1 else 1
    for col, (data, title) in enumerate(((pre, "pre-RoPE"), (post, "post-RoPE"))):
        ax = fig.add_subplot(gs[row, col])
        im = ax.imshow(torch.log10(data.clamp_min(1e-6)).numpy(), aspect="auto", cmap="magma", interpolation="nearest")
        ax.set_title(f"log10 key channel absmax, {title}")
        ax.set_xlabel("channel")
        ax.set_ylabel("layer")
        _layer_axis(ax.yaxis)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig


def plot_key_channels(stats: KVStats) -> bytes:
    return _png(figure_key_channels(stats))


def figure_clipping(ratios: dict[str, dict[str, list[float | None]]], num_layers: int):
    """One colour per format (K solid, V dashed)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    x = list(range(num_layers))
    colours = _colours(len(ratios))
    for colour, (name, r) in zip(colours, ratios.items()):
        for kv, style in (("k", "-"), ("v", "--")):
            vals = r.get(kv) or []
            if vals and all(v is not None for v in vals):
                ax.plot(x, vals, style, marker=".", color=colour, label=f"{name} {kv.upper()}")
    ax.set_ylim(top=max(1.05, ax.get_ylim()[1]))
    _layer_axis(ax.xaxis)
    ax.set_xlabel("layer")
    ax.set_ylabel("range / absmax range")
    ax.set_title("chosen clipping per layer (1.0 = max calibration)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # below the axes: many formats must not hide the lines
        ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    return fig


def plot_clipping(ratios: dict[str, dict[str, list[float | None]]], num_layers: int) -> bytes:
    return _png(figure_clipping(ratios, num_layers))


def rope_outliers(stats: KVStats, top: int = 4) -> list[dict[str, Any]]:
    """Per layer, the pre-RoPE key channels with the largest absmax relative to the layer median.

    ``pair`` is the RoPE frequency index (channel mod head_dim/2): in the rotate_half layout,
    higher indices rotate more slowly (lower frequency).
    """
    pre = stats.absmax("k_pre", "per_channel").amax(1)
    half = stats.head_dim // 2
    out = []
    for layer in range(stats.num_layers):
        row = pre[layer]
        med = row.median().clamp_min(1e-12)
        vals, idx = row.topk(min(top, row.numel()))
        out.append({
            "layer": layer,
            "channels": idx.tolist(),
            "pairs": [i % half for i in idx.tolist()],
            "ratio_to_median": [round(float(v / med), 2) for v in vals],
        })
    return out


def _fmt(v: float | None, digits: int = 4) -> str:
    return "—" if v is None else f"{v:.{digits}g}"


def _layer_list(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 8 else f"{len(layers)} layers ({layers[0]}, {layers[1]}, …, {layers[-1]})"


def render_report(
    recipe: CalibrationRecipe,
    stats: KVStats,
    ratios: dict[str, dict[str, list[float | None]]],
    errors: dict[str, dict[str, list[float]]],
    exports: dict[str, Sequence[str]],
) -> dict[str, bytes]:
    """report.md and its plots."""
    files = {
        "plots/absmax.png": plot_absmax(stats),
        "plots/key_channels.png": plot_key_channels(stats),
        "plots/clipping.png": plot_clipping(ratios, stats.num_layers),
    }
    m = recipe.model
    tp = recipe.throughput
    lines = [
        f"# KV calibration report: {m.name}",
        "",
        f"- model: `{m.name}` ({m.architecture}), {m.shape()}, sha256 `{m.sha256[:16]}…`",
        f"- dataset: `{recipe.dataset.get('spec', '?')}` (calib split), {recipe.samples} windows x {recipe.seq_len} tokens, seed {recipe.seed}",
        f"- tokens: {recipe.tokens:,}; forward throughput {tp.get('tokens_per_s', 0):,.0f} tokens/s over {tp.get('seconds', 0):.1f} s",
        f"- method: `{recipe.method}` {recipe.options}",
        f"- trtkv {recipe.trtkv_version}, created {recipe.created}",
        "",
        "## K / V ranges",
        "",
        "![absmax](plots/absmax.png)",
        "",
        "| layer | K absmax | K p99.9 | K pre-RoPE absmax | V absmax | V p99.9 | K mean std | V mean std |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ka, kp, va = (stats.absmax(k, "per_tensor") for k in ("k", "k_pre", "v"))
    k99, v99 = stats.percentile("k", 99.9, "per_tensor"), stats.percentile("v", 99.9, "per_tensor")
    kstd, vstd = stats.std("k").flatten(1).mean(1), stats.std("v").flatten(1).mean(1)
    for i in range(stats.num_layers):
        lines.append(
            f"| {i} | {_fmt(float(ka[i]))} | {_fmt(float(k99[i]))} | {_fmt(float(kp[i]))} | {_fmt(float(va[i]))} | "
            f"{_fmt(float(v99[i]))} | {_fmt(float(kstd[i]))} | {_fmt(float(vstd[i]))} |"
        )
    if m.has_sliding_layers:  # local (sliding-window) and global layers see different ranges: one row per type
        lines += [
            "",
            f"### By layer type (sliding window {m.sliding_window})",
            "",
            "| layer type | layers | K absmax (max) | K p99.9 (median) | V absmax (max) | V p99.9 (median) |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for kind, layers in m.layer_groups().items():
            idx = torch.tensor(layers)
            lines.append(
                f"| {kind} | {_layer_list(layers)} | {_fmt(float(ka[idx].max()))} | {_fmt(float(k99[idx].median()))} | "
                f"{_fmt(float(va[idx].max()))} | {_fmt(float(v99[idx].median()))} |"
            )
    lines += [
        "",
        "## Key channel outliers",
        "",
        "Pre-RoPE key outliers concentrate in a few channels; RoPE rotates channel i together with",
        "channel i + head_dim/2, so after RoPE the outlier energy is spread over the pair (compare the",
        "two curves). `pair` is the RoPE frequency index; larger indices rotate more slowly.",
        "",
        "![key channels](plots/key_channels.png)",
        "",
        "| layer | top pre-RoPE channels | RoPE pair | absmax / median |",
        "|---:|---|---|---|",
    ]
    for row in rope_outliers(stats):
        lines.append(f"| {row['layer']} | {row['channels']} | {row['pairs']} | {row['ratio_to_median']} |")
    lines += ["", "## Chosen parameters", "", "![clipping](plots/clipping.png)", ""]
    for name, fc in recipe.formats.items():
        d = fc.definition
        lines += [f"### {name}", "", f"`{d.spec()}` — {d.description or ''}", ""]
        err = errors.get(name, {})
        r = ratios.get(name, {})
        lines += ["| layer | K scale | V scale | K clip | V clip | K range ratio | V range ratio | K MSE | V MSE |", "|---:|---|---|---|---|---:|---:|---:|---:|"]
        for i, lc in enumerate(fc.layers):
            def cell(v):
                if v is None:
                    return "—"
                if isinstance(v, list):
                    return "[" + ", ".join(_fmt(x, 3) for x in v[:4]) + (", …]" if len(v) > 4 else "]")
                return _fmt(v)
            lines.append(
                f"| {i} | {cell(lc.k_scale)} | {cell(lc.v_scale)} | {cell(lc.k_clip)} | {cell(lc.v_clip)} | "
                f"{_fmt((r.get('k') or [None] * (i + 1))[i], 3)} | {_fmt((r.get('v') or [None] * (i + 1))[i], 3)} | "
                f"{_fmt((err.get('k') or [None] * (i + 1))[i], 3)} | {_fmt((err.get('v') or [None] * (i + 1))[i], 3)} |"
            )
        if exports.get(name):
            lines += ["", "Exports: " + ", ".join(f"`{p}`" for p in exports[name])]
        lines.append("")
    files["report.md"] = ("\n".join(lines) + "\n").encode()
    return files
