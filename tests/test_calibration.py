"""Calibration: streamed statistics, scale choice, the artifact, exports, and `run_calibration` end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from trtkv.artifacts import (
    CalibrationRecipe,
    ModelIdentity,
    load_calibration,
    load_stats_tensors,
    save_calibration,
)
from trtkv.calibration import scales as scales_mod
from trtkv.calibration.export import export_all, export_trtllm, export_vllm, load_safetensors_bytes
from trtkv.calibration.scales import choose_params, reservoir_error, smoothing_factors
from trtkv.calibration.stats import (
    HIST_BINS_PER_OCTAVE,
    KVStats,
    StatsCollector,
    collect_stats,
    stats_from_rows,
)
from trtkv.errors import TrtkvError
from trtkv.formats import get_format
from trtkv.quant import TensorParams, fake_quantize

BIN_REL = 2 ** (1 / HIST_BINS_PER_OCTAVE) - 1  # relative width of a histogram bin


def _rows(seed: int, L: int = 2, N: int = 300, H: int = 2, D: int = 8, heavy: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(L):
        x = torch.randn(N, H, D, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3.0, D, dtype=torch.float64) * (i + 1)
        if heavy:
            x = x * torch.empty(N, H, D, dtype=torch.float64).exponential_(generator=g) ** 2
        x[0, 0, 0] = 0.0  # a zero lands in the underflow bin
        out.append(x.float())
    return out


def _stats(seed: int = 0, reservoir: int = 2048, **kw) -> tuple[KVStats, list[torch.Tensor], list[torch.Tensor]]:
    k, v = _rows(seed, **kw), _rows(seed + 100, **kw)
    return stats_from_rows({"k": k, "v": v}, reservoir=reservoir), k, v


class _Info:
    """A ModelInfo stand-in (the artifact only needs its fields)."""

    def __init__(self, layers=2, kv_heads=2, head_dim=8, sha="a" * 64, name="synthetic"):
        self.d = dict(name=name, source="/x", sha256=sha, architecture="LlamaForCausalLM", num_layers=layers,
                      num_heads=kv_heads * 2, num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=64, vocab_size=100)

    def keys(self):
        return self.d.keys()

    def __getitem__(self, k):
        return self.d[k]


# --------------------------------------------------------------------------- statistics


def test_stats_match_naive_float64():
    stats, k, v = _stats()
    for kind, rows in (("k", k), ("v", v)):
        ref = torch.stack([r.double() for r in rows])  # [L, N, H, D]
        assert torch.equal(stats.tensors[kind].amax, ref.amax(1).float())
        assert torch.equal(stats.tensors[kind].amin, ref.amin(1).float())
        assert torch.equal(stats.absmax(kind, "per_channel"), ref.abs().amax(1).float())
        assert torch.equal(stats.absmax(kind, "per_head"), ref.abs().amax((1, 3)).float())
        assert torch.equal(stats.absmax(kind, "per_tensor"), ref.abs().flatten(1).amax(1).float())
        torch.testing.assert_close(stats.mean(kind).double(), ref.mean(1), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(stats.std(kind).double(), ref.std(1, unbiased=False), rtol=1e-5, atol=1e-6)
        N, H, D = rows[0].shape
        assert stats.count == N
        assert torch.equal(stats.tensors[kind].hist.sum(-1), torch.full((len(rows), H), N * D))
        assert stats.tensors[kind].hist[0, 0, 0] >= 1  # the zero
        for q in (50.0, 99.0, 99.9, 100.0):
            for layer in range(len(rows)):
                a = ref[layer].abs()
                for head in range(H):
                    vals = a[:, head].flatten().sort().values
                    exact = vals[max(math.ceil(vals.numel() * q / 100) - 1, 0)].item()
                    got = stats.percentile(kind, q, "per_head")[layer, head].item()
                    assert abs(got - exact) <= exact * BIN_REL * 1.001 + 1e-12, (kind, q, layer, head, got, exact)
                vals = a.flatten().sort().values
                exact = vals[max(math.ceil(vals.numel() * q / 100) - 1, 0)].item()
                got = stats.percentile(kind, q, "per_tensor")[layer].item()
                assert abs(got - exact) <= exact * BIN_REL * 1.001 + 1e-12


def test_streaming_merge_equals_one_pass():
    k, v = _rows(1), _rows(2)
    whole = stats_from_rows({"k": k, "v": v})
    a = stats_from_rows({"k": [x[:140] for x in k], "v": [x[:140] for x in v]})
    b = stats_from_rows({"k": [x[140:] for x in k], "v": [x[140:] for x in v]})
    merged = a.merge(b)
    assert merged.count == whole.count
    for kind in ("k", "k_pre", "v"):
        m, w = merged.tensors[kind], whole.tensors[kind]
        assert torch.equal(m.amin, w.amin) and torch.equal(m.amax, w.amax)
        assert torch.equal(m.hist, w.hist)
        torch.testing.assert_close(m.sum, w.sum, rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(m.sumsq, w.sumsq, rtol=1e-12, atol=1e-9)
    # streaming in batches through the collector gives the same deterministic statistics
    st = KVStats.empty(2, 2, 8, reservoir=64)
    col = StatsCollector(st, seed=3)
    for start in range(0, 300, 70):
        col.begin_batch(min(70, 300 - start))
        for layer in range(2):
            for kind, rows in (("k", k), ("k_pre", k), ("v", v)):
                col.add(kind, layer, rows[layer][start : start + 70])
        col.end_batch()
        st.count += min(70, 300 - start)
    for kind in ("k", "v"):
        assert torch.equal(st.tensors[kind].hist, whole.tensors[kind].hist)
        assert torch.equal(st.tensors[kind].amax, whole.tensors[kind].amax)
    assert st.reservoir_size == 64
    # serialization round trip (reservoir stored in fp16)
    back = KVStats.from_tensors(st.to_tensors())
    assert torch.equal(back.tensors["k"].hist, st.tensors["k"].hist) and back.count == st.count
    torch.testing.assert_close(back.reservoir["k"], st.reservoir["k"], rtol=1e-3, atol=1e-3)


def test_reservoir_is_a_uniform_sample_of_the_stream():
    N, cap = 4000, 200
    idx = torch.arange(N, dtype=torch.float32)
    x = idx.view(N, 1, 1).expand(N, 1, 2).clone()  # row n holds the value n
    st = KVStats.empty(2, 1, 2, reservoir=cap)
    col = StatsCollector(st, seed=0)
    for start in range(0, N, 250):
        col.begin_batch(250)
        for layer in range(2):
            col.add("k", layer, x[start : start + 250])
            col.add("v", layer, x[start : start + 250] + layer)
        col.end_batch()
    kept = st.reservoir["k"][0, :, 0, 0]
    assert st.reservoir_size == cap
    assert len(set(kept.tolist())) == cap  # distinct stream rows
    assert torch.equal(st.reservoir["k"][1], st.reservoir["k"][0])  # the same tokens in every layer
    assert torch.equal(st.reservoir["v"][1, :, 0, 0], kept + 1)
    # uniform over the stream: mean index ~ N/2 (sd of the mean ~ N/sqrt(12*cap) = 82)
    assert abs(kept.mean().item() - N / 2) < 4 * N / math.sqrt(12 * cap)
    assert (kept >= N / 2).sum() > cap / 4 and (kept < N / 2).sum() > cap / 4


# --------------------------------------------------------------------------- scale choice


@pytest.mark.parametrize("spec,gran", [
    ("k=int8:tensor,v=int8:tensor", "per_tensor"),
    ("k=int8:head,v=fp8:head", "per_head"),
    ("k=int4:channel,v=int8:channel", "per_channel"),
])
def test_max_method_is_absmax_over_qmax(spec, gran):
    stats, k, v = _stats(4)
    fmt = get_format(spec)
    params = choose_params(stats, fmt, "max")
    for kv, rows, tf in (("k", k, fmt.k), ("v", v, fmt.v)):
        for i, r in enumerate(rows):
            a = r.abs()
            amax = {"per_tensor": a.amax(), "per_head": a.amax((0, 2)), "per_channel": a.amax(0)}[gran]
            got = getattr(params[i], kv).scale
            assert got.shape == amax.shape
            assert torch.equal(got, amax / tf.traits.sym_max)
            assert getattr(params[i], kv).clip is None and getattr(params[i], kv).smooth is None


def test_shared_kv_scale_is_max_of_k_and_v():
    stats, k, v = _stats(5)
    params = choose_params(stats, get_format("int8-static"), "max")
    for i in range(2):
        want = torch.maximum(k[i].abs().amax(), v[i].abs().amax()) / 127
        assert torch.equal(params[i].k.scale, want) and torch.equal(params[i].v.scale, want)
    mse = choose_params(stats, get_format("int8-static"), "mse")
    assert all(torch.equal(p.k.scale, p.v.scale) for p in mse)


def _brute_force(x: torch.Tensor, tf, scale_of_ratio, grid) -> torch.Tensor:
    return torch.tensor([float((fake_quantize(x, tf, TensorParams(scale=scale_of_ratio(r)), -2) - x).double().square().sum()) for r in grid])


def test_mse_static_clip_on_heavy_tails_beats_max():
    stats, k, _ = _stats(6, heavy=True, N=600)
    fmt = get_format("k=int4:tensor,v=int4:tensor")
    params = choose_params(stats, fmt, "mse")
    grid = scales_mod.default_static_grid().tolist()
    for i in range(2):
        x = stats.samples("k", i)
        assert torch.equal(x, k[i])  # the reservoir (capacity 2048) holds every row
        amax = k[i].abs().amax()
        ratio = (params[i].k.scale * 7 / amax).item()
        assert ratio < 1.0
        errs = _brute_force(x, fmt.k, lambda r, amax=amax: amax * r / 7, grid)
        chosen = float((fake_quantize(x, fmt.k, params[i].k, -2) - x).double().square().sum())
        assert chosen <= errs.min().item() * (1 + 1e-9)  # at least as good as every coarse grid point
        assert chosen < errs[-1].item()  # strictly better than max calibration (ratio 1.0)
    err_mse = reservoir_error(stats, fmt, params)
    err_max = reservoir_error(stats, fmt, choose_params(stats, fmt, "max"))
    assert sum(err_mse["k"]) < sum(err_max["k"]) and sum(err_mse["v"]) < sum(err_max["v"])


def test_mse_per_head_and_per_channel_groups_are_searched_independently():
    stats, k, _ = _stats(7, heavy=True, N=600)
    for spec in ("k=int4:head,v=int4:head", "k=int4:channel,v=int4:channel"):
        fmt = get_format(spec)
        p = choose_params(stats, fmt, "mse", refine=0)
        amax = stats.absmax("k", fmt.k.granularity)[0]
        ratio = p[0].k.scale * 7 / amax
        grid = scales_mod.default_static_grid()
        assert torch.isin(ratio.round(decimals=4), grid.round(decimals=4)).all()  # refine=0: grid points only
        x = k[0]
        # brute force for one group: the error of that group's slice is minimal at its chosen ratio
        if fmt.k.granularity == "per_head":
            h = 1
            errs = []
            for r in grid.tolist():
                s = p[0].k.scale.clone()
                s[h] = amax[h] * r / 7
                e = (fake_quantize(x, fmt.k, TensorParams(scale=s), -2) - x)[:, h].double().square().sum()
                errs.append(float(e))
            assert grid[torch.tensor(errs).argmin()].item() == pytest.approx(ratio[h].item(), abs=1e-6)


def test_grid_search_refines_but_never_worsens():
    grid = scales_mod.default_static_grid()  # 0.30, 0.35, ..., 1.00
    target = torch.tensor([0.65, 0.62, 0.999, 0.3])  # on-grid, between grid points, near and at the ends

    def errors_of(cand):  # cand [n, 4]
        return (cand - target).abs()

    best = scales_mod._search(errors_of, (4,), grid, refine=2)
    assert best[0].item() == pytest.approx(0.65)  # exact coarse optimum kept: fine points are all worse
    assert abs(best[1].item() - 0.62) < abs(0.60 - 0.62)  # refined between grid points
    assert best[2].item() == pytest.approx(1.0) and best[3].item() == pytest.approx(0.3)  # stays inside the grid
    assert torch.equal(scales_mod._search(errors_of, (4,), grid, refine=0), grid[(grid.view(-1, 1) - target).abs().argmin(0)])


def test_dynamic_mse_clip_ratios():
    stats, k, v = _stats(8, heavy=True, N=600, D=64)
    fmt = get_format("k=int4:g32:sym,v=int4:g32:sym")
    params = choose_params(stats, fmt, "mse")
    for p in params:
        for tp in (p.k, p.v):
            assert tp.scale is None and tp.smooth is None
            assert tp.clip.shape == (2,) and (tp.clip >= 0.5).all() and (tp.clip <= 1.0).all()
    assert min(float(p.k.clip.min()) for p in params) < 1.0
    err = reservoir_error(stats, fmt, params)
    base = reservoir_error(stats, fmt, choose_params(stats, fmt, "max"))
    assert sum(err["k"]) < sum(base["k"])
    assert all(p.k.clip is None for p in choose_params(stats, fmt, "max"))
    assert all(p.k.clip is None for p in choose_params(stats, fmt, "percentile"))


def test_smoothing_factors_positive_and_reduce_int4_error_on_channel_outliers():
    g = torch.Generator().manual_seed(9)
    N, H, D = 512, 2, 64
    boost = torch.ones(D)
    boost[[5, 37]] = 25.0  # a RoPE pair of outlier channels
    k = [torch.randn(N, H, D, generator=g) * boost for _ in range(2)]
    v = [torch.randn(N, H, D, generator=g) for _ in range(2)]
    stats = stats_from_rows({"k": k, "v": v})
    s = smoothing_factors(stats.absmax("k", "per_channel"), 0.5)
    assert (s > 0).all()
    torch.testing.assert_close(torch.log(s).mean(-1), torch.zeros(2, H), atol=1e-5, rtol=0)
    assert (s[..., 5] > 3).all()
    with_smooth = get_format("k=int4:g64:asym:smooth,v=int4:g64:asym")
    plain = get_format("k=int4:g64:asym,v=int4:g64:asym")
    ps = choose_params(stats, with_smooth, "max")
    assert ps[0].k.smooth.shape == (H, D) and ps[0].v.smooth is None
    e_s = reservoir_error(stats, with_smooth, ps)
    e_p = reservoir_error(stats, plain, choose_params(stats, plain, "max"))
    assert sum(e_s["k"]) < 0.8 * sum(e_p["k"])


def test_percentile_method_bounded_by_absmax():
    stats, _, _ = _stats(10, heavy=True, N=600)
    fmt = get_format("k=int8:head,v=int8:tensor")
    pct = choose_params(stats, fmt, "percentile", percentile=99.0)
    mx = choose_params(stats, fmt, "max")
    for a, b in zip(pct, mx):
        assert (a.k.scale <= b.k.scale).all() and (a.k.scale < b.k.scale).any()
        assert a.v.scale <= b.v.scale
    with pytest.raises(TrtkvError):
        choose_params(stats, fmt, "median")


# --------------------------------------------------------------------------- artifact


def _recipe(info=None, formats=("int8-static", "int4")) -> CalibrationRecipe:
    info = info or _Info()
    from trtkv.artifacts import FormatCalibration

    return CalibrationRecipe(
        model=ModelIdentity.of(dict(info.d)), dataset={"spec": "synthetic"}, samples=1, seq_len=300, seed=0, tokens=300,
        formats={f: FormatCalibration(definition=get_format(f), method="max") for f in formats},
    )


def _params():
    stats, _, _ = _stats(11, D=64)
    return stats, {f: choose_params(stats, get_format(f), "mse") for f in ("int8-static", "int4")}


def test_artifact_round_trip(tmp_path):
    stats, params = _params()
    info = _Info(head_dim=64)
    out = save_calibration(tmp_path / "cal", _recipe(info), params, stats.to_tensors(), {"report.md": "# hi\n", "plots/a.png": b"\x89PNG"})
    assert sorted(p.name for p in out.iterdir()) == ["kv_scales.safetensors", "plots", "recipe.json", "report.md", "stats.safetensors"]
    assert not list(tmp_path.glob("cal.tmp-*")) and not list(tmp_path.glob("cal.old-*"))
    cal = load_calibration(out)
    assert cal.recipe.model.sha256 == info.d["sha256"] and set(cal.formats) == {"int8-static", "int4"}
    for name, layers in params.items():
        got = cal.params_for(name, info)
        assert got == cal.params_for(get_format(name), info)  # by name or by KVFormat
        for a, b in zip(got, layers):
            for kv in ("k", "v"):
                for f in ("scale", "smooth", "clip"):
                    x, y = getattr(getattr(a, kv), f), getattr(getattr(b, kv), f)
                    assert (x is None and y is None) or (x.dtype == torch.float32 and torch.equal(x, y))
    # overwrite an existing artifact: replaced only after success
    out2 = save_calibration(tmp_path / "cal", _recipe(info, formats=("int4",)), {"int4": params["int4"]})
    assert load_calibration(out2).formats == ["int4"] and not (out2 / "stats.safetensors").exists()
    # formats that need no calibration get empty params; missing calibrated ones are refused
    assert all(lp.k.scale is None and lp.k.clip is None for lp in load_calibration(out2).params_for("fp16", info))
    with pytest.raises(TrtkvError, match="--kv int8-static"):
        load_calibration(out2).params_for("int8-static", info)
    with pytest.raises(TrtkvError, match="different definition"):
        load_calibration(out2).params_for(get_format("k=int4:g32:sym,v=int4:g32:sym").model_copy(update={"name": "int4"}), info)


def test_mismatched_model_is_refused(tmp_path):
    _, params = _params()
    out = save_calibration(tmp_path / "cal", _recipe(_Info(head_dim=64)), params)
    cal = load_calibration(out)
    with pytest.raises(TrtkvError) as e:
        cal.params_for("int8-static", _Info(layers=3, head_dim=64, name="other"))
    assert "2 layers x 2 KV heads x head_dim 64" in str(e.value) and "3 layers x 2 KV heads x head_dim 64" in str(e.value)
    with pytest.raises(TrtkvError, match="head_dim 32"):
        cal.params_for("int8-static", _Info(head_dim=32))
    with pytest.raises(TrtkvError, match="sha256"):
        cal.params_for("int8-static", _Info(head_dim=64, sha="b" * 64))
    with pytest.raises(TrtkvError, match="sha256"):  # geometry mismatch is never allowed; hash mismatch can be
        cal.check_model(_Info(head_dim=64, sha="b" * 64))
    assert len(cal.params_for("int8-static", _Info(head_dim=64, sha="b" * 64), allow_other_model=True)) == 2
    with pytest.raises(TrtkvError, match="head_dim 32"):
        cal.params_for("int8-static", _Info(head_dim=32, sha="b" * 64), allow_other_model=True)


def test_unwritable_out_dir_leaves_nothing(tmp_path, monkeypatch):
    _, params = _params()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TrtkvError, match=str(blocker)):
        save_calibration(blocker / "cal", _recipe(_Info(head_dim=64)), params)
    assert blocker.is_file()
    # a failure half-way: no tmp dir left, an existing artifact untouched
    good = save_calibration(tmp_path / "cal", _recipe(_Info(head_dim=64)), params)
    before = sorted(p.name for p in good.iterdir())
    import trtkv.artifacts as art

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(art, "_write_file", boom)
    with pytest.raises(TrtkvError, match="No space left"):
        save_calibration(tmp_path / "cal", _recipe(_Info(head_dim=64)), params, None, {"report.md": "x"})
    assert sorted(p.name for p in good.iterdir()) == before and load_calibration(good).formats
    with pytest.raises(TrtkvError):
        save_calibration(tmp_path / "new", _recipe(_Info(head_dim=64)), params, None, {"report.md": "x"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal", "file"]


# --------------------------------------------------------------------------- exports


def test_exports_key_names_shapes_dtypes_and_direction():
    stats, k, v = _stats(12)
    info = _Info()
    int8 = get_format("int8-static")
    p8 = choose_params(stats, int8, "max")
    files = export_trtllm(int8, p8, info)
    assert sorted(files) == ["trtllm/int8-static/config.json", "trtllm/int8-static/rank0.safetensors"]
    cfg = json.loads(files["trtllm/int8-static/config.json"])
    assert cfg["quantization"]["kv_cache_quant_algo"] == "INT8" and cfg["num_hidden_layers"] == 2
    t = load_safetensors_bytes(files["trtllm/int8-static/rank0.safetensors"])
    assert sorted(t) == sorted(
        [f"transformer.layers.{i}.attention.kv_cache_scaling_factor" for i in range(2)]
        + [f"transformer.layers.{i}.attention.kv_cache_rcp_scaling_factor" for i in range(2)]
    )
    for i in range(2):
        s = t[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]
        assert s.dtype == torch.float32 and s.shape == (1,)
        amax = max(k[i].abs().max().item(), v[i].abs().max().item())
        assert s.item() == pytest.approx(amax / 127, rel=1e-7)
        assert t[f"transformer.layers.{i}.attention.kv_cache_rcp_scaling_factor"].item() == pytest.approx(127 / amax, rel=1e-6)

    fp8 = get_format("fp8")
    pf = choose_params(stats, fp8, "max")
    files = export_all(fp8, pf, info)
    cfg = json.loads(files["trtllm/fp8/config.json"])
    assert cfg["quantization"]["kv_cache_quant_algo"] == "FP8"
    tl = load_safetensors_bytes(files["trtllm/fp8/rank0.safetensors"])
    vt = load_safetensors_bytes(files["vllm/fp8/kv_scales.safetensors"])
    assert sorted(vt) == sorted(f"model.layers.{i}.self_attn.{kv}_scale" for i in range(2) for kv in "kv")
    for i in range(2):
        ks, vs = vt[f"model.layers.{i}.self_attn.k_scale"], vt[f"model.layers.{i}.self_attn.v_scale"]
        assert ks.dtype == torch.float32 and ks.shape == (1,) and vs.shape == (1,)
        assert ks.item() == pytest.approx(k[i].abs().max().item() / 448, rel=1e-7)
        assert vs.item() == pytest.approx(v[i].abs().max().item() / 448, rel=1e-7)
        assert tl[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"].item() == pytest.approx(max(ks.item(), vs.item()))
    qc = json.loads(files["vllm/fp8/quantization_config.json"])
    assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}

    head = get_format("k=fp8:head,v=fp8:head")
    files = export_vllm(head, choose_params(stats, head, "max"), info)
    (kvfile,) = [f for f in files if f.endswith(".safetensors")]
    vt = load_safetensors_bytes(files[kvfile])
    assert vt["model.layers.0.self_attn.k_scale"].shape == (2,)
    assert json.loads(files[kvfile.replace("kv_scales.safetensors", "quantization_config.json")])["kv_cache_scheme"]["strategy"] == "attn_head"
    assert export_trtllm(head, choose_params(stats, head, "max"), info) == {}
    int4 = get_format("int4")
    assert export_all(int4, choose_params(stats, int4, "max"), info) == {}


# --------------------------------------------------------------------------- collection on a real (tiny) model


def test_collect_stats_sees_cached_k_v_and_pre_rope_k(tiny_model):
    from transformers.cache_utils import DynamicCache

    from trtkv.models import load_model

    d, _ = tiny_model("llama")
    lm = load_model(str(d), device="cpu", dtype="float32")
    windows = torch.randint(0, lm.info.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    stats = collect_stats(lm, windows, batch_size=2, progress=False, reservoir=1000)
    H, D = lm.info.num_kv_heads, lm.info.head_dim
    cache = DynamicCache(config=lm.model.config)
    pre = {}
    hooks = [a.self_attn.k_proj.register_forward_hook(lambda m, i, o, n=n: pre.__setitem__(n, o)) for n, a in enumerate(lm.model.model.layers)]
    with torch.no_grad():
        lm.model(input_ids=windows, cache=cache, use_cache=True)
    for h in hooks:
        h.remove()
    assert stats.count == 48 and stats.reservoir_size == 48
    for layer in range(lm.info.num_layers):
        keys = cache.layers[layer].keys.permute(0, 2, 1, 3).reshape(-1, H, D)
        vals = cache.layers[layer].values.permute(0, 2, 1, 3).reshape(-1, H, D)
        kp = pre[layer].reshape(-1, H, D)
        torch.testing.assert_close(stats.absmax("k")[layer], keys.abs().amax(0))
        torch.testing.assert_close(stats.absmax("v")[layer], vals.abs().amax(0))
        torch.testing.assert_close(stats.absmax("k_pre")[layer], kp.abs().amax(0))
        torch.testing.assert_close(stats.mean("k")[layer], keys.mean(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats.samples("k", layer), keys)  # every token kept, in order
        assert not torch.allclose(keys, kp)  # RoPE really happened between the two capture points


# --------------------------------------------------------------------------- end to end on the builtin model


@pytest.mark.model
def test_run_calibration_on_builtin_model(builtin_model, tmp_path):
    from trtkv.calibration.run import run_calibration

    out = run_calibration(
        "smollm2-135m", "builtin:pydoc", tmp_path / "cal", samples=4, seq_len=128, method="mse",
        progress=False, reservoir=128, loaded=builtin_model,
    )
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {"recipe.json", "kv_scales.safetensors", "stats.safetensors", "report.md", "plots/absmax.png",
            "plots/key_channels.png", "plots/clipping.png", "trtllm/int8-static/config.json",
            "trtllm/int8-static/rank0.safetensors", "trtllm/fp8/rank0.safetensors", "vllm/fp8/kv_scales.safetensors"} <= names
    info = builtin_model.info
    cal = load_calibration(out)
    r = cal.recipe
    assert (r.model.num_layers, r.model.num_kv_heads, r.model.head_dim) == (30, 3, 64)
    assert r.tokens == 512 and r.throughput["tokens_per_s"] > 0 and r.model.sha256 == info.sha256
    assert set(r.formats) == {"int8-static", "fp8", "int4"} and r.dataset["spec"] == "builtin:pydoc"

    stats = KVStats.from_tensors(load_stats_tensors(out))
    kmax, vmax, kpre = stats.absmax("k", "per_tensor"), stats.absmax("v", "per_tensor"), stats.absmax("k_pre", "per_tensor")
    # SmolLM2's keys carry large channel outliers: K's range exceeds V's in (almost) every layer
    assert (kmax > vmax).sum() >= 27 and kmax.mean() > 1.5 * vmax.mean()
    ch = stats.absmax("k_pre", "per_channel").amax(1)  # [30, 64]
    assert (ch.amax(-1) / ch.median(-1).values).median() > 2.5  # a few outlier channels per layer
    torch.testing.assert_close(kmax, kpre, rtol=0.1, atol=0)  # RoPE rotates within pairs: ranges stay close

    i8 = cal.params_for("int8-static", info)
    assert len(i8) == 30
    for i, lp in enumerate(i8):
        assert lp.k.scale.shape == () and torch.equal(lp.k.scale, lp.v.scale)
        ratio = lp.k.scale * 127 / max(kmax[i], vmax[i])
        assert 0.5 <= ratio <= 1.0 + 1e-6
    i4 = cal.params_for("int4", info)  # keys per channel per sealed block: no smoothing, no clip; values: an MSE clip per head
    assert i4[0].k.smooth is None and i4[0].k.clip is None and i4[0].v.smooth is None
    assert i4[0].v.clip.shape == (3,) and ((i4[0].v.clip > 0) & (i4[0].v.clip <= 1)).all()
    tl = load_safetensors_bytes((out / "trtllm/int8-static/rank0.safetensors").read_bytes())
    assert tl["transformer.layers.7.attention.kv_cache_scaling_factor"].item() == pytest.approx(float(i8[7].k.scale))
    assert "K / V ranges" in (out / "report.md").read_text()
    assert (out / "plots/absmax.png").read_bytes()[:4] == b"\x89PNG"



# ----------------------------------------------------------------------------- knobs that must reach the result


@pytest.mark.parametrize("alpha", [0.25, 0.75])
def test_smooth_alpha_reaches_the_smoothing_factors(alpha):
    """A smoothing exponent other than the default is used, through choose_params and calibrate_formats alike."""
    from trtkv.calibration.run import calibrate_formats

    stats, k, _ = _stats(3)
    fmt = get_format("k=int4:g8:asym:smooth,v=int4:g8:asym")
    absmax = torch.stack([x.abs().amax(0) for x in k]).double()  # [L, H, D] from the raw rows, not from the stats
    floor = absmax.amax(-1, keepdim=True) * scales_mod.SMOOTH_FLOOR
    want = torch.maximum(absmax, floor) ** alpha
    want = want / want.log().mean(-1, keepdim=True).exp()
    params, *_ = calibrate_formats(stats, [fmt], "max", smooth_alpha=alpha)
    got = torch.stack([lp.k.smooth for lp in params[fmt.name]]).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    default = torch.stack([lp.k.smooth for lp in choose_params(stats, fmt, "max")]).double()
    assert (got - default).abs().max() > 1e-3  # and it differs from the default exponent


@pytest.mark.parametrize("spec", ["int8-static", "k=int8:head,v=int8:channel", "k=fp8:tensor,v=fp8:head"])
def test_clip_ratio_of_max_calibration_is_one(spec):
    """With max calibration the chosen range *is* the absmax: scale * qmax / absmax == 1 (a lost qmax gives 1/qmax)."""
    from trtkv.calibration.run import calibrate_formats

    stats, *_ = _stats(4)
    fmt = get_format(spec)
    _, _, ratios, _ = calibrate_formats(stats, [fmt], "max")
    for kv in ("k", "v"):
        assert ratios[fmt.name][kv] == pytest.approx([1.0] * stats.num_layers, rel=1e-5)
    _, _, mse, _ = calibrate_formats(stats, [fmt], "mse")
    assert all(0.3 <= r <= 1.0 + 1e-6 for kv in ("k", "v") for r in mse[fmt.name][kv])
