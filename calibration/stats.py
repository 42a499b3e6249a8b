"""Streamed K/V statistics: what the model caches, collected over calibration windows.

For every layer, KV head and head_dim channel, and for three tensors

* ``k``     -- K as cached (post-RoPE), seen by a ``transformers`` Cache whose ``update()`` gets it,
* ``k_pre`` -- K before RoPE (forward hook on ``self_attn.k_proj``; on ``k_norm`` for a family whose row says ``qk_norm``, the
  K rows of ``qkv_proj`` for one that says ``fused_projections``: ``trtkv.families``),
* ``v``     -- V as cached,

``KVStats`` keeps running min/max (so absmax) per channel, per-channel sums and sums of squares
(float64 moments), a histogram of ``|x|`` per (layer, head) on fixed log2-spaced bins, and a
fixed-size reservoir sample of token rows (``k`` and ``v``, the same tokens in every layer) for
MSE searches. Memory does not grow with the number of samples, and two ``KVStats`` merge.

Beside the K/V statistics:

* ``query`` -- the second-moment matrix ``sum q q^T`` [L, H, D, D] (float64) of the queries as attention receives them
  (post-RoPE), the query heads of each KV head pooled: what a key's error costs in the attention logits
  (``E[(q . e)^2] = e^T E[q q^T] e``), for key codebooks and query-aware smoothing;
* ``windows`` -- the K and V of the first ``sample_windows`` calibration windows, whole and in order (fp16
  [L, W, seq_len, H, D]): the sealed blocks a codebook is fitted to (a reservoir's scattered rows are no block).

Histogram bins (fixed, so histograms from different runs merge by addition): bin 0 holds
``|x| < 2**HIST_LOG2_MIN`` (zeros included), bins ``1..HIST_BINS-2`` split
``[2**HIST_LOG2_MIN, 2**HIST_LOG2_MAX)`` into ``HIST_BINS_PER_OCTAVE`` equal steps of log2 per
octave (relative bin width 2**(1/32) - 1 = 2.2%), and the last bin holds everything larger.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from trtkv.calibration import DEFAULT_FIT_WINDOWS
from trtkv.errors import TrtkvError
from trtkv.families import Family, require

KINDS = ("k", "k_pre", "v")
RESERVOIR_KINDS = ("k", "v")
HIST_LOG2_MIN = -20
HIST_LOG2_MAX = 16
HIST_BINS_PER_OCTAVE = 32
HIST_BINS = (HIST_LOG2_MAX - HIST_LOG2_MIN) * HIST_BINS_PER_OCTAVE + 2
DEFAULT_RESERVOIR = 512
DEFAULT_SAMPLE_WINDOWS = DEFAULT_FIT_WINDOWS  # whole calibration windows kept for fitting codebooks and alloc bits (trtkv.calibration)


def hist_edges() -> torch.Tensor:
    """Upper edges of the histogram bins (float64, length HIST_BINS; the last is +inf)."""
    inner = torch.arange(1, HIST_BINS - 1, dtype=torch.float64)
    upper = torch.pow(2.0, HIST_LOG2_MIN + inner / HIST_BINS_PER_OCTAVE)
    return torch.cat([torch.tensor([2.0**HIST_LOG2_MIN], dtype=torch.float64), upper, torch.tensor([math.inf], dtype=torch.float64)])


def hist_lower_edges() -> torch.Tensor:
    """Lower edges of the bins (bin 0 starts at 0)."""
    up = hist_edges()
    return torch.cat([torch.zeros(1, dtype=torch.float64), up[:-1]])


def hist_bin_index(absx: torch.Tensor) -> torch.Tensor:
    """Histogram bin of each ``|x|`` (int64, same shape)."""
    # log2(|x|) * bins_per_octave shifted so that bin 1 starts at 2**HIST_LOG2_MIN; values below
    # clamp to 0.5 before truncation, so truncation toward zero equals floor for every kept value
    lg = torch.log2(absx.float()).mul_(HIST_BINS_PER_OCTAVE).add_(1 - HIST_LOG2_MIN * HIST_BINS_PER_OCTAVE)
    return torch.nan_to_num_(lg, nan=HIST_BINS - 1.0).clamp_(0.5, HIST_BINS - 0.5).long()


def hist_percentile(hist: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q``-th percentile (0..100) of |x| from histograms ``[..., HIST_BINS]``.

    Interpolates geometrically inside the bin that crosses the target rank, so the result is
    within one bin (2.2% relative) of the exact value. The overflow bin returns its lower edge.
    """
    h = hist.double()
    total = h.sum(-1, keepdim=True)
    cdf = h.cumsum(-1)
    target = total * (q / 100.0)
    b = torch.searchsorted(cdf.contiguous(), target.contiguous()).clamp_(0, HIST_BINS - 1)  # first bin with cdf >= target
    lo_e, up_e = hist_lower_edges().to(h.device), hist_edges().to(h.device)
    before = torch.where(b > 0, cdf.gather(-1, (b - 1).clamp_min(0)), torch.zeros_like(target))
    in_bin = h.gather(-1, b).clamp_min(1e-30)
    frac = ((target - before) / in_bin).clamp(0, 1)
    lo, up = lo_e[b], up_e[b]
    geo = lo * torch.pow(up / lo.clamp_min(1e-300), frac)
    val = torch.where(b == 0, up * frac, torch.where(b == HIST_BINS - 1, lo, geo))
    val = torch.where(total > 0, val, torch.zeros_like(val))
    return val.squeeze(-1).float()


@dataclass
class TensorStats:
    """Streamed statistics of one of k / k_pre / v: shapes [L, H, D] (hist: [L, H, HIST_BINS])."""

    amin: torch.Tensor
    amax: torch.Tensor
    sum: torch.Tensor  # float64
    sumsq: torch.Tensor  # float64
    hist: torch.Tensor  # int64

    @classmethod
    def empty(cls, layers: int, heads: int, dim: int, device: Any = "cpu") -> "TensorStats":
        f = dict(device=device)
        return cls(
            amin=torch.full((layers, heads, dim), math.inf, **f),
            amax=torch.full((layers, heads, dim), -math.inf, **f),
            sum=torch.zeros(layers, heads, dim, dtype=torch.float64, **f),
            sumsq=torch.zeros(layers, heads, dim, dtype=torch.float64, **f),
            hist=torch.zeros(layers, heads, HIST_BINS, dtype=torch.int64, **f),
        )

    @property
    def absmax(self) -> torch.Tensor:
        """Per (layer, head, channel) max |x| [L, H, D]."""
        return torch.maximum(self.amax.abs(), self.amin.abs()).where(torch.isfinite(self.amax), torch.zeros_like(self.amax))

    def update(self, layer: int, x: torch.Tensor) -> None:
        """Add rows ``x`` of shape [N, H, D] (tokens, heads, channels) to layer ``layer``."""
        x = x.float()
        self.amin[layer] = torch.minimum(self.amin[layer], x.amin(0))
        self.amax[layer] = torch.maximum(self.amax[layer], x.amax(0))
        self.sum[layer] += x.sum(0, dtype=torch.float64)
        self.sumsq[layer] += x.square().sum(0, dtype=torch.float64)
        heads = x.shape[1]
        idx = hist_bin_index(x.abs()) + (torch.arange(heads, device=x.device) * HIST_BINS).view(1, heads, 1)
        self.hist[layer] += torch.bincount(idx.flatten(), minlength=heads * HIST_BINS).view(heads, HIST_BINS)

    def merge(self, other: "TensorStats") -> None:
        self.amin = torch.minimum(self.amin, other.amin)
        self.amax = torch.maximum(self.amax, other.amax)
        self.sum = self.sum + other.sum
        self.sumsq = self.sumsq + other.sumsq
        self.hist = self.hist + other.hist

    def to(self, device: Any) -> "TensorStats":
        return TensorStats(*(getattr(self, f).to(device) for f in ("amin", "amax", "sum", "sumsq", "hist")))


@dataclass
class KVStats:
    """Statistics of a model's K/V cache over a calibration set (see module docstring)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensors: dict[str, TensorStats]
    count: int = 0  # tokens seen per layer (each token contributes H*D values per tensor)
    reservoir: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> [L, R, H, D] float32
    reservoir_capacity: int = DEFAULT_RESERVOIR
    seconds: float = 0.0  # time spent in forward passes
    query: torch.Tensor | None = None  # sum of q q^T per (layer, KV head) [L, H, D, D] float64; None: not collected
    query_count: int = 0  # query rows in ``query`` per layer and KV head (tokens x query heads per KV head)
    windows: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> [L, W, seq_len, H, D] fp16, whole windows
    sample_windows: int = DEFAULT_SAMPLE_WINDOWS  # capacity of ``windows``

    @classmethod
    def empty(cls, num_layers: int, num_kv_heads: int, head_dim: int, reservoir: int = DEFAULT_RESERVOIR, device: Any = "cpu",
              sample_windows: int = DEFAULT_SAMPLE_WINDOWS) -> "KVStats":
        return cls(
            num_layers, num_kv_heads, head_dim,
            tensors={k: TensorStats.empty(num_layers, num_kv_heads, head_dim, device) for k in KINDS},
            reservoir={k: torch.zeros(num_layers, 0, num_kv_heads, head_dim, device=device) for k in RESERVOIR_KINDS},
            reservoir_capacity=reservoir,
            sample_windows=sample_windows,
        )

    # ---------------------------------------------------------------- derived statistics

    def absmax(self, kind: str = "k", granularity: str = "per_channel") -> torch.Tensor:
        """max |x| per layer at a granularity: per_tensor [L], per_head [L, H], per_channel [L, H, D]."""
        a = self.tensors[kind].absmax
        if granularity == "per_channel":
            return a
        if granularity == "per_head":
            return a.amax(-1)
        if granularity == "per_tensor":
            return a.flatten(1).amax(-1)
        raise ValueError(f"unknown granularity {granularity}")

    def mean(self, kind: str = "k") -> torch.Tensor:
        return (self.tensors[kind].sum / max(self.count, 1)).float()

    def std(self, kind: str = "k") -> torch.Tensor:
        n = max(self.count, 1)
        m = self.tensors[kind].sum / n
        var = (self.tensors[kind].sumsq / n - m * m).clamp_min(0)
        return var.sqrt().float()

    def percentile(self, kind: str = "k", q: float = 99.9, granularity: str = "per_head") -> torch.Tensor:
        """Percentile of |x| from the histograms: per_tensor [L] or per_head [L, H]."""
        h = self.tensors[kind].hist
        if granularity == "per_tensor":
            return hist_percentile(h.sum(1), q)
        if granularity == "per_head":
            return hist_percentile(h, q)
        raise ValueError(f"histogram percentiles are per_tensor or per_head, not {granularity}")

    def samples(self, kind: str, layer: int) -> torch.Tensor:
        """Reservoir rows of one layer: [R, H, D] float32 (kind: k or v)."""
        if kind not in self.reservoir:
            raise TrtkvError(f"the statistics hold no reservoir sample of {kind}", "recollect statistics with a reservoir")
        return self.reservoir[kind][layer].float()

    @property
    def reservoir_size(self) -> int:
        return int(self.reservoir["k"].shape[1]) if "k" in self.reservoir else 0

    def query_moment(self) -> torch.Tensor:
        """``E[q q^T]`` per (layer, KV head) [L, H, D, D] float64, the post-RoPE queries of each KV head's query heads."""
        if self.query is None or self.query_count == 0:
            raise TrtkvError("the statistics hold no query second moments", "recollect the statistics (trtkv calibrate collects them)")
        return self.query / self.query_count

    def window_sample(self, kind: str, layer: int) -> torch.Tensor:
        """The whole calibration windows kept of one layer: [W, seq_len, H, D] float32 (kind: k or v)."""
        if kind not in self.windows or self.windows[kind].shape[1] == 0:
            raise TrtkvError("the statistics hold no whole calibration windows", "recollect the statistics with sample_windows >= 1")
        return self.windows[kind][layer].float()

    # ---------------------------------------------------------------- combining

    def merge(self, other: "KVStats", generator: torch.Generator | None = None) -> "KVStats":
        """Fold ``other`` into ``self`` (in place; also returned).

        Min/max, moments and histograms combine exactly. The reservoirs combine into a sample of
        the union: each slot is drawn from one side with probability proportional to its token count.
        """
        if (self.num_layers, self.num_kv_heads, self.head_dim) != (other.num_layers, other.num_kv_heads, other.head_dim):
            raise ValueError("cannot merge statistics of differently shaped models")
        for k in KINDS:
            self.tensors[k].merge(other.tensors[k].to(self.tensors[k].amin.device))
        ra, rb = self.reservoir_size, other.reservoir_size
        cap = self.reservoir_capacity
        if ra + rb <= cap:
            for k in RESERVOIR_KINDS:
                self.reservoir[k] = torch.cat([self.reservoir[k], other.reservoir[k].to(self.reservoir[k].device)], 1)
        else:
            na, nb = max(self.count, 1), max(other.count, 1)
            g = generator or torch.Generator().manual_seed(0)
            take_a = torch.rand(cap, generator=g) < na / (na + nb)
            ia = torch.randperm(ra, generator=g)[: min(int(take_a.sum()), ra)]
            ib = torch.randperm(rb, generator=g)[: min(cap - len(ia), rb)]
            for k in RESERVOIR_KINDS:
                self.reservoir[k] = torch.cat([self.reservoir[k][:, ia], other.reservoir[k][:, ib].to(self.reservoir[k].device)], 1)
        if other.query is not None:
            self.query = other.query.clone() if self.query is None else self.query + other.query.to(self.query.device)
            self.query_count += other.query_count
        for k, w in other.windows.items():
            mine = self.windows.get(k)
            joined = w if mine is None or mine.shape[1] == 0 else torch.cat([mine, w.to(mine.device)], 1)
            self.windows[k] = joined[:, : self.sample_windows]
        self.count += other.count
        self.seconds += other.seconds
        return self

    # ---------------------------------------------------------------- serialization

    def to_tensors(self, reservoir_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
        """Flat tensors for stats.safetensors (the reservoir is stored in ``reservoir_dtype``)."""
        out: dict[str, torch.Tensor] = {
            "meta.shape": torch.tensor([self.num_layers, self.num_kv_heads, self.head_dim], dtype=torch.int64),
            "meta.count": torch.tensor([self.count], dtype=torch.int64),
            "meta.reservoir_capacity": torch.tensor([self.reservoir_capacity], dtype=torch.int64),
            "meta.seconds": torch.tensor([self.seconds], dtype=torch.float64),
            "meta.hist": torch.tensor([HIST_LOG2_MIN, HIST_LOG2_MAX, HIST_BINS_PER_OCTAVE], dtype=torch.int64),
        }
        for k, ts in self.tensors.items():
            for f in ("amin", "amax", "sum", "sumsq", "hist"):
                out[f"{k}.{f}"] = getattr(ts, f).cpu().contiguous()
        for k, r in self.reservoir.items():
            lim = torch.finfo(reservoir_dtype).max if reservoir_dtype.is_floating_point else None
            rr = r.clamp(-lim, lim) if lim is not None else r
            out[f"reservoir.{k}"] = rr.to(reservoir_dtype).cpu().contiguous()
        if self.query is not None:
            out["query.moment_sum"] = self.query.cpu().contiguous()
            out["meta.query_count"] = torch.tensor([self.query_count], dtype=torch.int64)
        for k, w in self.windows.items():
            out[f"windows.{k}"] = w.cpu().contiguous()
        out["meta.sample_windows"] = torch.tensor([self.sample_windows], dtype=torch.int64)
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "KVStats":
        hist_meta = t["meta.hist"].tolist()
        if hist_meta != [HIST_LOG2_MIN, HIST_LOG2_MAX, HIST_BINS_PER_OCTAVE]:
            raise TrtkvError(f"statistics use histogram bins {hist_meta}, this trtkv uses others", "recollect the statistics")
        L, H, D = (int(v) for v in t["meta.shape"].tolist())
        tensors = {k: TensorStats(*(t[f"{k}.{f}"] for f in ("amin", "amax", "sum", "sumsq", "hist"))) for k in KINDS}
        res = {k: t[f"reservoir.{k}"].float() for k in RESERVOIR_KINDS if f"reservoir.{k}" in t}
        return cls(  # statistics written before query moments and windows were collected load without them
            L, H, D, tensors, count=int(t["meta.count"].item()), reservoir=res,
            reservoir_capacity=int(t["meta.reservoir_capacity"].item()), seconds=float(t["meta.seconds"].item()),
            query=t.get("query.moment_sum"), query_count=int(t["meta.query_count"].item()) if "meta.query_count" in t else 0,
            windows={k: t[f"windows.{k}"] for k in RESERVOIR_KINDS if f"windows.{k}" in t},
            sample_windows=int(t["meta.sample_windows"].item()) if "meta.sample_windows" in t else 0,
        )

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        save_file(self.to_tensors(), str(path))

    @classmethod
    def load(cls, path: str) -> "KVStats":
        from safetensors.torch import load_file

        return cls.from_tensors(load_file(str(path)))


# --------------------------------------------------------------------------- streaming collector


@dataclass
class ReservoirDraw:
    """Which rows of one batch enter the reservoir: the same for every layer and tensor.

    Rows ``[0, grow)`` append at slots ``[start, start + grow)``; rows ``rows`` replace slots ``slots``.
    """

    start: int
    grow: int
    slots: torch.Tensor
    rows: torch.Tensor
    first_window: int = 0  # the batch's first window (whole windows of ``seq_len`` rows, batch-major)


class StatsCollector:
    """Feeds K/V of each forward pass into a ``KVStats`` and keeps the reservoir sample.

    ``begin_batch(n_tokens)`` draws which of the next ``n_tokens`` rows (flattened batch x seq)
    enter the reservoir (algorithm R, the same rows for every layer and tensor); ``add(kind,
    layer, x)`` takes ``x`` as [N, H, D] rows in that order. A layer-streamed run draws every batch first
    (``draw``) and sets each batch's draw before that batch's rows of a layer arrive (``use``): every layer
    then sees the same draws in the same batch order as in the resident pass, so the sample is identical.
    """

    def __init__(self, stats: KVStats, seed: int = 0, seq_len: int | None = None):
        self.stats = stats
        self.gen = torch.Generator().manual_seed(seed)
        self.seen = 0  # tokens offered to the reservoir so far
        self.filled = stats.reservoir_size  # slots the draws so far have filled
        self.seq_len = seq_len  # tokens per window: rows of the first ``stats.sample_windows`` windows are kept whole
        self._draw = ReservoirDraw(self.filled, 0, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))

    def draw(self, n_tokens: int) -> ReservoirDraw:
        """The reservoir draw of the next ``n_tokens`` rows (advances the sampler)."""
        cap = self.stats.reservoir_capacity
        t = torch.arange(self.seen, self.seen + n_tokens, dtype=torch.float64)
        fill = int(torch.clamp(torch.tensor(cap - self.filled), 0, n_tokens).item())
        # the first `fill` rows append; the rest replace a random slot with probability cap / (t + 1)
        j = torch.floor(torch.rand(n_tokens, generator=self.gen, dtype=torch.float64) * (t + 1)).long()
        replace = (j < cap) & (torch.arange(n_tokens) >= fill)
        slots: dict[int, int] = {}
        for row in torch.nonzero(replace).flatten().tolist():  # few rows: expected cap * ln(growth)
            slots[int(j[row])] = row  # a later row overwrites an earlier one in the same slot
        out = ReservoirDraw(self.filled, fill, torch.tensor(list(slots.keys()), dtype=torch.long),
                            torch.tensor(list(slots.values()), dtype=torch.long), self.seen // self.seq_len if self.seq_len else 0)
        self.filled += fill
        self.seen += n_tokens
        return out

    def use(self, draw: ReservoirDraw) -> None:
        self._draw = draw

    def begin_batch(self, n_tokens: int) -> None:
        self.use(self.draw(n_tokens))

    def add(self, kind: str, layer: int, x: torch.Tensor) -> None:
        self.stats.tensors[kind].update(layer, x)
        if kind not in self.stats.reservoir:
            return
        self._keep_windows(kind, layer, x)
        d = self._draw
        res = self.stats.reservoir[kind]
        xc = x.detach().float().to(res.device)
        if res.shape[1] < d.start + d.grow:  # grow the reservoir tensor (for all layers) to this batch's rows
            pad = torch.zeros(res.shape[0], d.start + d.grow - res.shape[1], *res.shape[2:], device=res.device)
            res = self.stats.reservoir[kind] = torch.cat([res, pad], 1)
        if d.grow:
            res[layer, d.start : d.start + d.grow] = xc[: d.grow]
        if len(d.slots):
            res[layer, d.slots.to(res.device)] = xc[d.rows.to(xc.device)]

    def end_batch(self) -> None:
        self.use(ReservoirDraw(self.filled, 0, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)))

    def _keep_windows(self, kind: str, layer: int, x: torch.Tensor) -> None:
        """Rows [B * seq_len, H, D] of the batch's windows below ``sample_windows`` into ``stats.windows`` (fp16)."""
        st, S, w0 = self.stats, self.seq_len, self._draw.first_window
        if not S or w0 >= st.sample_windows or x.shape[0] % S:
            return
        take = min(x.shape[0] // S, st.sample_windows - w0)
        rows = x.detach()[: take * S].reshape(take, S, *x.shape[1:]).to("cpu", torch.float16)
        have = st.windows.get(kind)
        if have is None or have.shape[1] < w0 + take:
            grown = torch.zeros(st.num_layers, w0 + take, S, *x.shape[1:], dtype=torch.float16)
            if have is not None:
                grown[:, : have.shape[1]] = have
            have = st.windows[kind] = grown
        have[layer, w0 : w0 + take] = rows

    def add_queries(self, layer: int, query: torch.Tensor) -> None:
        """Queries [B, query_heads, S, D] as attention receives them: ``sum q q^T`` per KV head (its query heads pooled)."""
        st = self.stats
        b, hq, s, d = query.shape
        q = query.detach().double().reshape(b, st.num_kv_heads, hq // st.num_kv_heads, s, d)
        if st.query is None:
            st.query = torch.zeros(st.num_layers, st.num_kv_heads, d, d, dtype=torch.float64)
        st.query[layer] += torch.einsum("bhgsd,bhgse->hde", q, q).cpu()
        if layer == 0:
            st.query_count += b * (hq // st.num_kv_heads) * s


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] (transformers cache layout) -> [B*S, H, D] token rows, batch-major."""
    return x.detach().permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = None
    for name in ("model.layers", "model.model.layers", "transformer.h"):
        obj: Any = model
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        layers = obj
        break
    if layers is None:
        raise TrtkvError(f"cannot find the decoder layers of {type(model).__name__}", "use a model of a supported architecture")
    return [layer.self_attn for layer in layers]


def _pre_rope_keys(attn: torch.nn.Module, family: Family, num_heads: int, H: int, D: int):
    """The module whose output is K before RoPE, and how to cut its output into [tokens, H, D] rows, as the family's
    row says: each head's k normalized before RoPE (``qk_norm``: ``k_norm``), q, k, v projected in one ``qkv_proj``
    (``fused_projections``), else ``k_proj``."""
    if family.qk_norm:
        return attn.k_norm, lambda out: out.reshape(-1, H, D)
    if family.fused_projections:
        return attn.qkv_proj, lambda out: out[..., num_heads * D : (num_heads + H) * D].reshape(-1, H, D)
    return attn.k_proj, lambda out: out.reshape(-1, H, D)


def make_stats_cache(model: torch.nn.Module, collector: StatsCollector):
    """A ``DynamicCache`` that reports each layer's key/value states (post-RoPE K, V) to ``collector``."""
    from transformers.cache_utils import DynamicCache

    class _StatsCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            collector.add("k", layer_idx, _rows(key_states))
            collector.add("v", layer_idx, _rows(value_states))
            # calibration windows are single full forward passes: nothing needs to be stored
            return key_states, value_states

    return _StatsCache(config=model.config)


@contextlib.contextmanager
def observe_queries(model: torch.nn.Module, observe):
    """Within the block, every attention call of ``model`` first reports ``observe(layer_idx, query)`` (query
    [B, query_heads, S, D] as attention receives it: after RoPE and any q norm) and then runs the attention the model was
    configured with (transformers' registry, or the modeling module's own ``eager_attention_forward``)."""
    import sys

    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    configs = list({id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values())
    before = [c._attn_implementation for c in configs]
    impl = before[-1] or "eager"

    def observing(module, query, key, value, attention_mask, **kwargs):
        observe(module.layer_idx, query)
        fn = ALL_ATTENTION_FUNCTIONS[impl] if impl != "eager" else sys.modules[type(module).__module__].eager_attention_forward
        return fn(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("trtkv_observe_queries", observing)
    for c in configs:
        c._attn_implementation = "trtkv_observe_queries"
    try:
        yield
    finally:
        for c, b in zip(configs, before):
            c._attn_implementation = b


def collect_stats(
    loaded: Any,
    windows: torch.Tensor,
    batch_size: int = 4,
    progress: bool = True,
    *,
    reservoir: int = DEFAULT_RESERVOIR,
    seed: int = 0,
    sample_windows: int = DEFAULT_SAMPLE_WINDOWS,
) -> KVStats:
    """Run ``loaded.model`` over token ``windows`` [n, seq_len] and collect ``KVStats``.

    ``loaded`` is a ``trtkv.models.LoadedModel`` (``model``, ``info``, ``device``). Statistics
    accumulate on the model's device and are returned on the CPU. The first ``sample_windows`` windows are also kept
    whole (``KVStats.windows``), and the queries' second moments are collected (``KVStats.query``).
    """
    model, info, device = loaded.model, loaded.info, loaded.device
    if windows.dim() != 2 or windows.numel() == 0:
        raise TrtkvError(f"calibration windows must be a non-empty [n, seq_len] tensor, got shape {tuple(windows.shape)}", "check --samples and --seq-len")
    attn = _attention_modules(model)
    if len(attn) != info.num_layers:
        raise TrtkvError(f"model has {len(attn)} attention layers, its info says {info.num_layers}", "reload the model")
    n, seq_len = windows.shape
    stats = KVStats.empty(info.num_layers, info.num_kv_heads, info.head_dim, reservoir=reservoir, device=device,
                          sample_windows=min(sample_windows, n))
    collector = StatsCollector(stats, seed=seed, seq_len=seq_len)
    H, D = info.num_kv_heads, info.head_dim
    family = require(info.architecture, f"model '{info.name}'")

    hooks = []
    for i, a in enumerate(attn):
        module, rows = _pre_rope_keys(a, family, info.num_heads, H, D)

        def hook(_mod, _inp, out, i=i, rows=rows):
            collector.add("k_pre", i, rows(out.detach()))
        hooks.append(module.register_forward_hook(hook))

    total_tokens = n * seq_len
    t_start = time.perf_counter()
    try:
        with observe_queries(model, collector.add_queries):
            if getattr(loaded, "streamer", None) is not None:
                _collect_streamed(loaded, windows, batch_size, collector, progress)
                stats.count = total_tokens
                stats.seconds = time.perf_counter() - t_start
                return _finish(stats, reservoir, time.perf_counter() - t_start)
            with _progress(progress, total_tokens) as advance, torch.inference_mode():
                for start in range(0, n, batch_size):
                    batch = windows[start : start + batch_size].to(device)
                    collector.begin_batch(batch.numel())
                    t0 = time.perf_counter()
                    # the decoder stack alone: K/V are all we need, so the vocabulary projection is skipped
                    model.base_model(input_ids=batch, cache=make_stats_cache(model, collector), use_cache=True)
                    stats.seconds += time.perf_counter() - t0
                    collector.end_batch()
                    stats.count += batch.numel()
                    advance(batch.numel())
    finally:
        for h in hooks:
            h.remove()
    return _finish(stats, reservoir, time.perf_counter() - t_start)


def _collect_streamed(loaded: Any, windows: torch.Tensor, batch_size: int, collector: StatsCollector, progress: bool) -> None:
    """The layer-streamed pass (trtkv.streaming): every batch through layer i, then layer i+1.

    Each batch's reservoir draw is made up front, in batch order, and set before that batch's rows of every layer,
    so statistics and sample equal the resident pass's.
    """
    from rich.console import Console

    from trtkv.streaming import Job, record, stream_layers

    console = Console(stderr=True, quiet=not progress, soft_wrap=True)
    model, device = loaded.model, loaded.device
    batches = [windows[s : s + batch_size].to(device) for s in range(0, windows.shape[0], batch_size)]
    draws = [collector.draw(b.numel()) for b in batches]
    cache = make_stats_cache(model, collector)  # stateless: it reports each layer's K/V and stores nothing
    jobs = [Job(b, cache, before_layer=lambda _i, d=d: collector.use(d)) for b, d in zip(batches, draws)]
    with torch.inference_mode():
        record(model, jobs)
        stream_layers(loaded.streamer, jobs, progress=lambda line: console.print(f"  calibrating {line}", highlight=False))
    collector.end_batch()


def _finish(stats: KVStats, reservoir: int, wall: float) -> KVStats:
    """The statistics on the CPU, checked for NaN / inf and for the pre-RoPE key hooks having fired."""
    stats.seconds = stats.seconds or wall
    out = KVStats(
        stats.num_layers, stats.num_kv_heads, stats.head_dim,
        tensors={k: v.to("cpu") for k, v in stats.tensors.items()},
        count=stats.count, reservoir={k: v.cpu() for k, v in stats.reservoir.items()},
        reservoir_capacity=reservoir, seconds=wall,
        query=None if stats.query is None else stats.query.cpu(), query_count=stats.query_count,
        windows={k: v.cpu() for k, v in stats.windows.items()}, sample_windows=stats.sample_windows,
    )
    for kind, ts in out.tensors.items():
        if not (torch.isfinite(ts.amax).all() and torch.isfinite(ts.amin).all()):
            raise TrtkvError(
                f"the model produced NaN or inf {kind} values during calibration",
                "run in float32 (--dtype float32); fp16 can overflow",
            )
    if out.tensors["k_pre"].hist.sum() == 0:
        raise TrtkvError("the k_proj hooks saw no activations", "this model's attention layout is not supported")
    return out


class _progress:
    """Context manager yielding ``advance(n_tokens)``; a rich bar with tokens/s when enabled."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self._p = None

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        class _Rate(TextColumn):
            def render(self, task):
                elapsed = task.finished_time if task.finished else task.elapsed
                speed = task.completed / elapsed if elapsed and task.completed else None
                return TextColumn(f"{speed:,.0f} tok/s" if speed else "… tok/s").render(task)

        self._p = Progress(
            TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
            _Rate(""), TimeElapsedColumn(), TimeRemainingColumn(), transient=False,
        )
        self._p.__enter__()
        task = self._p.add_task("calibrate", total=self.total)
        return lambda n: self._p.advance(task, n)

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)
        return False


def stats_from_rows(rows: dict[str, Iterable[torch.Tensor]], reservoir: int = DEFAULT_RESERVOIR, seed: int = 0, *,
                    seq_len: int | None = None, sample_windows: int = DEFAULT_SAMPLE_WINDOWS,
                    queries: Iterable[torch.Tensor] | None = None) -> KVStats:
    """Build ``KVStats`` from synthetic data: ``rows[kind]`` is a list over layers of [N, H, D] tensors.

    Used by tests and by callers that capture K/V some other way. ``k_pre`` defaults to ``k``. With ``seq_len`` the rows
    are windows of that many tokens, the first ``sample_windows`` kept whole; ``queries``: per layer [B, query_heads, S, D].
    """
    k = [torch.as_tensor(x).float() for x in rows["k"]]
    v = [torch.as_tensor(x).float() for x in rows["v"]]
    kp = [torch.as_tensor(x).float() for x in rows.get("k_pre", k)]
    L = len(k)
    N, H, D = k[0].shape
    stats = KVStats.empty(L, H, D, reservoir=reservoir, sample_windows=sample_windows if seq_len else 0)
    col = StatsCollector(stats, seed=seed, seq_len=seq_len)
    col.begin_batch(N)
    for i in range(L):
        col.add("k", i, k[i])
        col.add("v", i, v[i])
        col.add("k_pre", i, kp[i])
    col.end_batch()
    for i, q in enumerate(queries or ()):
        col.add_queries(i, torch.as_tensor(q).float())
    stats.count = N
    return stats
