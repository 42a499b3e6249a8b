"""The capability table (plugins/contract/capabilities.py): each path's reasons on a grid of formats, sizes and
model features; the pool's seal asks it (an ``mse`` format is not sealed by the kernel on CUDA); the generated
support matrix in README.md / docs/architecture.md is current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from trtkv.cache_layout import PagedKVLayout
from trtkv.errors import TrtkvError
from trtkv.families import architectures
from trtkv.formats import CALIBRATION_FREE, PRESETS, fit_formats, get_format
from trtkv.plugins.contract import LIMITS
from trtkv.plugins.contract import capabilities as cap
from trtkv.plugins.contract.capabilities import CAPABILITIES, backend_path, kernels_take

ROOT = Path(__file__).resolve().parents[1]
MSE = {
    "int8": "k=int8:bchannel:sym:mse,v=int8:token:sym,block=64",
    "int4": "k=int4:bchannel:asym:mse,v=int4:g32:sym:hadamard,block=64,sink=4",
    "int3": "k=int3:bchannel:asym:mse,v=int3:g32:sym:hadamard,block=64,sink=4",
    "int2": "k=int2:bchannel:asym:mse,v=int2:token:asym:hadamard,block=64,sink=4",
}
PER_LAYER = "k=int8:bchannel:sym,v=int8:token:sym,block=64,layers=" + "|".join(
    f"{PRESETS[n].k.short()}/{PRESETS[n].v.short()}" for n in ("int8", "int4"))
BLOCKS = (4, 8, 12, 16, 32, 64, 128, 256)
HEAD_DIMS = (16, 32, 48, 64, 128, 256, 512)


def model(arch="LlamaForCausalLM", window=None):
    return SimpleNamespace(name="m", architecture=arch, has_sliding_layers=window is not None, sliding_window=window)


FORMATS = [*PRESETS, *CALIBRATION_FREE.values(), *MSE.values(), PER_LAYER]


@pytest.mark.parametrize("spec", FORMATS)
def test_format_reasons_of_every_path(spec):
    fmt = get_format(spec)
    if any(t.codebook or t.outliers or t.pre_rope for f in fmt.layer_formats() for t in (f.k, f.v)):  # the calibrated storage features
        for path in CAPABILITIES.values():  # refused in one reason by each path that lacks one; the torch ops read them all
            r = path.layout_reasons(fmt)
            if any(path.lacks(t) for f in fmt.layer_formats() for t in (f.k, f.v)):
                assert len(r) == 1 and "does not read yet" in r[0] and r[0].kind == "layout", (path.name, r)
            else:
                assert not r and path.name in ("torch", "cpu", "kernels", "seal"), (path.name, r)
        assert not CAPABILITIES["torch"].layout_reasons(fmt)
        return
    mse = any(t.mse for f in fmt.layer_formats() for t in (f.k, f.v))
    for name in ("kernels", "seal"):
        r = CAPABILITIES[name].reasons(fmt, None, 64, 128)
        assert bool(r) == mse, (name, r)
        if mse:
            assert "mse" in r[0] and r[0].kind == "format"
    for name in ("native", "plugin", "tensorrt-rtx"):  # the pool seals for the step network: mse is no reason
        r = CAPABILITIES[name].reasons(fmt, None, 64, 128)
        assert bool(r) == fmt.is_per_layer, (name, r)
        if fmt.is_per_layer:
            assert "stores each layer its own way" in r[0] and r[0].hint == "build it with --backend torch"
    assert CAPABILITIES["torch"].reasons(fmt, model(), 4, 48) == []


def test_size_reasons_of_every_path():
    for bs in BLOCKS:
        for d in HEAD_DIMS:
            kernel_ok = LIMITS.block_size_problem(bs) is None and LIMITS.head_dim_problem(d) is None
            for name in ("kernels", "seal"):
                r = CAPABILITIES[name].size_reasons(bs, d)
                assert (not r) == kernel_ok, (name, bs, d, r)
                assert all(x.startswith(("block size ", "head_dim ")) for x in r)
            plugin = CAPABILITIES["plugin"].size_reasons(bs, d)
            assert (not plugin) == (bs in (16, 32, 64, 128) and d in (32, 64, 128, 256)), (bs, d, plugin)
            for name in ("native", "tensorrt-rtx"):
                assert (not CAPABILITIES[name].size_reasons(bs, d)) == (bs in (4, 8, 16, 32, 64, 128, 256)), (name, bs, d)
            assert CAPABILITIES["torch"].size_reasons(bs, d) == []
    assert CAPABILITIES["plugin"].size_reasons(8, 64) == ["plugin attention supports block sizes [16, 32, 64, 128], not 8"]
    assert CAPABILITIES["plugin"].size_reasons(16, 48) == ["plugin attention supports head dims [32, 64, 128, 256], not 48"]


def test_storage_dtypes_the_kernels_lack_are_reasons(monkeypatch):
    monkeypatch.setattr(cap, "LIMITS", type(LIMITS)(dtypes=("fp16", "int8")))
    fmt = get_format("int4")
    assert "the kernels take fp16, int8" in CAPABILITIES["kernels"].reasons(fmt)[0]
    assert CAPABILITIES["seal"].reasons(fmt)
    plugin = CAPABILITIES["plugin"].reasons(fmt)
    assert len(plugin) == 2 and plugin[0].startswith("k=int4:") and plugin[1].startswith("v=int4:") and "storage int4" in plugin[0]
    assert not CAPABILITIES["native"].reasons(fmt) and not CAPABILITIES["torch"].reasons(fmt)
    assert not CAPABILITIES["plugin"].reasons(get_format("k=int8:token,v=int8:token"))


@pytest.mark.parametrize("arch,window", [("LlamaForCausalLM", None), ("Gemma3ForCausalLM", 512), ("Gemma2ForCausalLM", 4096),
                                         ("Gemma2ForCausalLM", None), ("FalconForCausalLM", None), ("MistralForCausalLM", 4096)])
def test_model_reasons_of_every_path(arch, window):
    m = model(arch, window)
    known = arch in architectures(lambda f: f.step_network)
    for name in ("native", "tensorrt-rtx"):
        r = CAPABILITIES[name].model_reasons(m)
        assert bool(r) == (not known), (name, r)
    r = CAPABILITIES["plugin"].model_reasons(m)
    if not known:
        assert len(r) == 1 and "does not implement its layers" in r[0]
    else:
        assert any("sliding-window" in x for x in r) == (window is not None)
        assert any("soft-caps" in x for x in r) == (arch == "Gemma2ForCausalLM")
        assert all(x.hint == "use --attention native" for x in r)
    for name in ("torch", "kernels", "seal"):  # transformers' layers; windows and soft-cap are the kernels' own
        assert CAPABILITIES[name].model_reasons(m) == []


def test_tensorrt_rtx_runs_native_attention_only():
    rtx = backend_path("tensorrt-rtx")
    assert rtx is CAPABILITIES["tensorrt-rtx"] and rtx.attention_reason("native") is None
    assert "TensorRT-RTX loads no plugins" in rtx.attention_reason("plugin")
    assert all(backend_path(b) is None for b in ("onnxruntime", "tensorrt", "torch"))
    assert CAPABILITIES["native"].attention_reason("plugin") is None


def test_cache_shapes_are_the_layouts():
    lay = PagedKVLayout(get_format("int4"), 2, 64, 64, 8, 3)
    shapes = CAPABILITIES["kernels"].cache_shapes(lay)
    assert shapes["k_data"] == tuple(lay.data_shape("k")) and shapes["v_tail"] == tuple(lay.tail_shape())
    assert set(shapes) >= {"k_data", "k_scale", "v_data", "v_scale", "k_tail", "v_tail"}


# ----------------------------------------------------------------------------- the pool's seal (the bug)


def _kernel_seals_in_place(spec: str, block: int | None = None, head_dim: int = 128, forced: bool | None = True) -> bool:
    """Whether the Triton backend seals a cache of ``spec`` with its seal kernel (``forced``: as on CUDA; None: the
    cache's device, here the CPU)."""
    from trtkv.attention.triton import TritonKernels
    from trtkv.runtime.kv_pool import PagedKVCache

    fmt = get_format(spec)
    fmt = fmt.with_block_size(block) if block else fmt
    return TritonKernels(seal_kernel=forced).seals_in_place(PagedKVCache(PagedKVLayout(fmt, 2, head_dim, fmt.block_size, 4, 2), 2))


@pytest.mark.parametrize("spec,kernel", [("int4", True), ("int3", True), (MSE["int4"], False), (MSE["int2"], False),
                                         (CALIBRATION_FREE["int2"], True), ("int2", True)])
def test_the_seal_kernel_only_where_the_seal_row_takes_the_format(spec, kernel):
    """The Triton backend seals an ``mse`` format with the reference quantizer (its search): the seal kernel would
    seal it with plain ranges while attention fell back to the torch ops."""
    assert _kernel_seals_in_place(spec) is kernel


def test_the_seal_kernel_only_at_sizes_and_on_the_device_it_takes():
    assert not _kernel_seals_in_place("int4", block=8)  # blocks the kernel does not take
    assert not _kernel_seals_in_place("k=int8:bchannel:sym,v=int8:token:sym,block=64", head_dim=48)
    assert _kernel_seals_in_place("k=int8:bchannel:sym,v=int8:token:sym,block=64", head_dim=64)
    assert not _kernel_seals_in_place("int4", forced=None)  # a CPU cache: the seal kernel is CUDA's


# ----------------------------------------------------------------------------- the callers read the table


def test_callers_are_lookups_in_the_table(monkeypatch):
    from trtkv.attention.triton import TritonKernels
    from trtkv.builder.plugin_nodes import get_backend

    assert get_backend("native").block_sizes == CAPABILITIES["native"].block_sizes
    assert get_backend("plugin").head_dims == CAPABILITIES["plugin"].head_dims
    assert kernels_take(get_format("int3")) and not kernels_take(get_format(MSE["int3"]))
    man = SimpleNamespace(kv_format=get_format(MSE["int4"]), limits=SimpleNamespace(block_size=64), model=SimpleNamespace(head_dim=128))
    assert "no mse seal" in TritonKernels.manifest_refusal("cuda", man)
    man.kv_format = get_format("int4")
    assert TritonKernels.manifest_refusal("cuda", man) is None
    man.limits.block_size = 256
    assert TritonKernels.manifest_refusal("cuda", man).startswith("block size must be a power of two")


def test_check_model_reads_the_table():
    from trtkv.builder.step_network import check_model

    gemma2 = SimpleNamespace(name="g", architecture="Gemma2ForCausalLM", has_sliding_layers=True, sliding_window=4096)
    with pytest.raises(TrtkvError, match="sliding-window layers") as ei:
        check_model(gemma2, "plugin")
    assert "use --attention native" in str(ei.value)
    check_model(gemma2, "native")
    check_model(SimpleNamespace(name="f", architecture="FalconForCausalLM", has_sliding_layers=False, sliding_window=None), "plugin", "torch")
    with pytest.raises(TrtkvError, match="does not implement its layers"):
        check_model(SimpleNamespace(name="f", architecture="FalconForCausalLM", has_sliding_layers=False, sliding_window=None), "native")


def test_fit_hint_names_the_alignment_rule():
    with pytest.raises(TrtkvError) as ei:
        fit_formats(["k=int3:token:asym,v=int3:token:asym"], 36)
    assert "int3 needs a head_dim that is a multiple of 8" in str(ei.value)
    with pytest.raises(TrtkvError) as ei:
        fit_formats(["k=int2:token:asym,v=int8:token:sym"], 34)
    assert "int2 needs a head_dim that is a multiple of 4" in str(ei.value) and "int4" not in str(ei.value)


# ----------------------------------------------------------------------------- the generated matrix


def test_support_matrix_in_docs_is_generated_from_the_table():
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_support_matrix.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_support_matrix_follows_the_table():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import gen_support_matrix as gen
    finally:
        sys.path.remove(str(ROOT / "docs"))
    before = gen.table()
    rows = {line.split("`")[1]: line for line in before.splitlines()[2:]}
    # int8, int4 (their mse variants refused), the int3 / int2 presets, the calibration-free 3- / 2-bit layouts
    assert "| yes (no mse) | yes (no mse) | yes | yes | yes (no mse) |" in rows["kernels"]
    assert "| yes | yes | no | no | yes |" in rows["native"]  # the int3 / int2 presets' keys: the torch engine only
    assert "| no | no | no |" in rows["plugin"]  # per-layer, windows, soft-cap
    from trtkv.attention import EXPORTERS, Exporter

    at = next(i for i, e in enumerate(EXPORTERS) if e.name == "plugin")
    kept = EXPORTERS[at]
    EXPORTERS[at] = Exporter("plugin", cap.ExecutionPath("plugin", "p", step_network=True, attention_op=True))
    try:
        assert gen.table() != before
        doc = (ROOT / "docs" / "architecture.md").read_text()
        assert gen.render(doc, ROOT / "docs" / "architecture.md") != doc
    finally:
        EXPORTERS[at] = kept
