"""Ahead-of-time compilation of every plugin kernel configuration for sm_80 and sm_90, on CPU.

Compiles ``trtkv.plugins.aot.lean_configs()`` (every kernel and preset format at head_dim 128, plus the
int4 preset at head_dim 64, plus its decode / prefill kernels with the sliding window's and soft-cap's code) with triton's compiler for ``GPUTarget("cuda", 80|90, 32)`` and reads the
ptxas resource usage. A configuration spilling more than ``aot.SPILL_LIMIT_BYTES`` fails: spills on a
memory-bound decode kernel mean local-memory traffic in the inner loop. The full table (both head dims,
all GQA buckets) is ``python -m trtkv.plugins.aot --out DIR``. Compiled kernels are cached in ``TRITON_CACHE_DIR``
(the Makefile's: ``~/.cache/trtkv/triton``), so reruns take seconds; a cold run compiles on one process per core, ~2
minutes on 2 cores.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("triton")

from trtkv.formats import PRESETS
from trtkv.plugins import aot

# The second tier (docs/development.md): compiling every kernel configuration to PTX / cubin takes minutes on a cold
# Triton cache, so `make test` deselects these and CI runs them as its own step (`make test-tier2`).
# The grid-formula test below compiles nothing and stays in the first tier.


@pytest.fixture(scope="module")
def compiled():
    return aot.compile_all(aot.lean_configs(), aot.ARCHS)


@pytest.mark.slow
@pytest.mark.tier2
def test_every_lean_config_compiles_for_both_archs_without_spills(compiled):
    configs = aot.lean_configs()
    assert len(compiled) == 2 * len(configs)
    kernels = {c.kernel for c in configs}
    assert kernels == {"seal_kernel", "paged_decode_partition_kernel", "paged_decode_reduce_kernel",
                       "paged_prefill_kernel"}
    bad = [f"sm_{r.arch} {r.config}: {r.spill_stores} B spilled" for r in compiled
           if r.spill_stores > aot.SPILL_LIMIT_BYTES]
    assert not bad, "\n".join(bad)
    for r in compiled:
        assert 0 < r.n_regs <= 255
        assert r.shared <= (163 if r.arch == 80 else 227) * 1024  # fits the opt-in shared memory of A100 / H100
        assert r.global_scratch_size == 0 and r.profile_scratch_size == 0


@pytest.mark.slow
@pytest.mark.tier2
def test_ptxas_usage_is_cached_by_ptx_and_arch(compiled, tmp_path, monkeypatch):
    """The ptxas report is cached under TRITON_CACHE_DIR: a second ask reads the file (same numbers as running ptxas),
    another PTX is its own entry."""
    from triton.backends.nvidia.compiler import get_ptxas

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    r = compiled[0]
    tool = get_ptxas(r.arch)
    first = aot._ptxas_usage(r.ptx, f"sm_{r.arch}", tool.path, str(tool.version))
    assert first == aot._run_ptxas(r.ptx, f"sm_{r.arch}", tool.path) and first["n_regs"] == r.n_regs
    [entry] = (tmp_path / "trtkv-ptxas").glob("*.json")
    entry.write_text(json.dumps({**first, "n_regs": -1}))  # the second ask must read the file, not run ptxas
    assert aot._ptxas_usage(r.ptx, f"sm_{r.arch}", tool.path, str(tool.version))["n_regs"] == -1
    aot._ptxas_usage(r.ptx + "\n// another", f"sm_{r.arch}", tool.path, str(tool.version))
    assert len(list((tmp_path / "trtkv-ptxas").glob("*.json"))) == 2 and not list((tmp_path / "trtkv-ptxas").glob("*.tmp"))


@pytest.mark.slow
@pytest.mark.tier2
def test_the_worker_processes_compile_what_one_process_does_in_its_order(compiled):
    """``compile_all`` on forked workers (the fixture's default, one per core) returns every (arch, config) in the
    order one process compiles them, with the same resources and code: a few configurations again in-process
    (triton's cache answers) against the fixture's."""
    configs = aot.lean_configs()
    some = [configs[0], configs[len(configs) // 2], configs[-1]]
    alone = aot.compile_all(some, aot.ARCHS, workers=1)
    assert [(r.arch, r.config) for r in alone] == [(a, c.name) for a in aot.ARCHS for c in some]
    by_key = {(r.arch, r.config): r for r in compiled}
    assert [(r.arch, r.config) for r in compiled] == [(a, c.name) for a in aot.ARCHS for c in configs]
    for r in alone:
        twin = by_key[(r.arch, r.config)]
        assert {k: v for k, v in r.row().items() if k != "compile_s"} == {k: v for k, v in twin.row().items() if k != "compile_s"}
        assert r.ptx == twin.ptx and r.cubin == twin.cubin


@pytest.mark.slow
@pytest.mark.tier2
def test_ptx_entry_points_and_parameter_lists(compiled):
    for r in compiled:
        assert f".visible .entry {r.name}(" in r.ptx
        assert re.search(rf"^\.target sm_{r.arch}a?\b", r.ptx, re.M)
        params = re.search(r"\.entry\s+\w+\s*\(([^)]*)\)", r.ptx).group(1)
        # runtime arguments in declaration order + triton's two scratch pointers
        assert params.count(".param") == len(r.args) + 2, r.config
        assert r.cubin[:4] == b"\x7fELF"


def test_configs_cover_every_preset_and_grid_formulas():
    from trtkv.plugins import contract as C
    from trtkv.plugins.contract.capabilities import kernel_refusal, kernels_attend, kernels_take

    configs = aot.kernel_configs()
    names = {c.name for c in configs}
    for fmt in [f for f in PRESETS.values() if kernels_attend(f)]:
        for d in aot.HEAD_DIMS:
            assert any(n.startswith("paged_decode_partition.") and f"k-{aot._tag(fmt.k)}.v-{aot._tag(fmt.v)}.d{d}."
                       in n for n in names), (fmt.name, d)
            for tf in (fmt.k, fmt.v):  # a seal configuration exactly where the seal kernel writes the format
                sealed = f"seal.{aot._tag(tf)}.d{d}.b{aot.block_size_of(fmt)}.fp16" in names
                assert sealed == (kernel_refusal(tf, ("seal",)) is None), (fmt.name, d, tf.short())
    assert all(kernels_take(f) for f in PRESETS.values() if kernels_attend(f))  # what the attention reads, the seal writes
    # the AOT formulas are the contract's grid functions: same numbers for concrete dims
    for c in configs:
        if c.kernel == "paged_decode_partition_kernel":
            p = c.constexprs["PARTITION"]
            bs = int(c.name.split(".b")[-1].split(".")[0])
            for mb in (1, 7, 2048):
                want, _ = C.decode_grids(3, 8, mb, bs, p)
                assert aot.eval_grid(c.grid, batch=3, kv_heads=8, max_blocks=mb) == want
        if c.kernel == "paged_prefill_kernel":
            assert aot.eval_grid(c.grid, max_seqlen_q=100, kv_heads=2, batch=3) == C.prefill_grid(
                100, 2, 3, c.constexprs["BLOCK_M"])
        if c.kernel == "seal_kernel":
            assert aot.eval_grid(c.grid, blocks=5, kv_heads=3) == C.seal_grid(5, 3)
    # a batch of 1 at 128k with 8 KV heads fills the GPU: 2049 programs (the + 1 block: open block + new row)
    grid_p, grid_r = C.decode_grids(1, 8, 128 * 1024 // 64, 64, C.LIMITS.default_partition)
    assert grid_p == (1, 8, 257) and grid_r == (1, 8, 1)


@pytest.mark.slow
@pytest.mark.tier2
def test_compile_for_one_layer_bf16():
    got = aot.compile_for("int4", 64, 3, 90, q_dtype="bf16")
    assert set(got) == {"seal_k", "seal_v", "decode_partition", "decode_reduce", "prefill"}
    assert all(r.spill_stores <= aot.SPILL_LIMIT_BYTES for r in got.values())


@pytest.mark.slow
@pytest.mark.tier2
def test_cli_writes_ptx_cubin_and_metadata(tmp_path):
    out = tmp_path / "aot"
    rc = aot.main(["--out", str(out), "--formats", "int8", "--head-dims", "64", "--gqa-ratios", "4", "--arch", "80"])
    assert rc == 0
    table = json.loads((out / "kernels.json").read_text())
    rows = table["kernels"]
    assert {r["kernel"] for r in rows} == {"seal_kernel", "paged_decode_partition_kernel",
                                           "paged_decode_reduce_kernel", "paged_prefill_kernel"}
    for r in rows:
        assert (out / "sm_80" / f"{r['config']}.ptx").is_file() and (out / "sm_80" / f"{r['config']}.cubin").is_file()
        assert {"n_regs", "spill_stores", "shared", "num_warps", "name", "grid", "args"} <= set(r)
