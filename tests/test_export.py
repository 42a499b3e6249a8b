"""`trtkv export`: complete vLLM and TensorRT-LLM checkpoints, checked against independent references.

References used (read, not copied; see docs/interop.md):

* NVIDIA/TensorRT-LLM ``docs/source/architecture/checkpoint.md``: config.json fields (mandatory
  ``architecture``, ``dtype``, ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
  ``num_attention_heads``, ``hidden_act``; ``mapping.*``, ``quantization.*``), rank files
  ``rank{r}.safetensors``, linear weights stored (out_features, in_features), tensor names
  ``transformer.layers.{i}.attention.qkv`` / ``attention.dense`` / ``mlp.fc`` / ``mlp.proj`` /
  ``input_layernorm`` / ``post_layernorm`` / ``attention.kv_cache_scaling_factor``.
* NVIDIA/TensorRT-LLM ``tensorrt_llm/models/llama/convert.py`` (``load_weights_from_hf_model``,
  ``load_weights_from_hf_safetensors``, ``QkvWeightHelper``): HF ``gate_proj`` -> ``mlp.fc``, ``up_proj`` ->
  ``mlp.gate``, ``down_proj`` -> ``mlp.proj`` (split on the input dim), ``o_proj`` -> ``attention.dense``
  (input dim), fused qkv = cat(rank's Q heads, K heads, V heads), KV heads fewer than tp replicated
  (rank r takes head r*kv//tp), ``lm_head`` zero-padded to a multiple of tp and split on the vocab,
  ``vocab_embedding`` whole on every rank unless use_parallel_embedding.
* NVIDIA/TensorRT-LLM ``tensorrt_llm/models/llama/config.py`` (``LLaMAConfig.from_hugging_face``):
  head_size, rotary_base, rotary_scaling, norm_epsilon, position_embedding_type ``rope_gpt_neox``.
* NVIDIA/TensorRT-LLM ``tensorrt_llm/layers/mlp.py`` ``GatedMLP.forward``: ``proj(act(fc(x)) * gate(x))`` —
  the semantics the reference forward below runs.
* NVIDIA/TensorRT-LLM ``cpp/tensorrt_llm/common/attentionOp.cpp``: ``qkv_scale_orig_quant =
  kv_scale_orig_quant`` (FP8 context attention quantizes Q with the KV scale).
* vllm-project/vllm ``vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py``
  (``CompressedTensorsConfig.from_config``, ``CompressedTensorsKVCacheMethod.validate_kv_cache_scheme``:
  type float, 8 bits, strategy tensor / attn_head) and vllm-project/compressed-tensors
  ``QuantizationConfig`` / ``QuantizationArgs`` (parsed here with the real classes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TINY_TEXT, build_tiny_model
from typer.testing import CliRunner

from trtkv.artifacts import load_calibration, load_stats_tensors
from trtkv.calibration.checkpoint import export_checkpoint
from trtkv.calibration.stats import KVStats
from trtkv.cli import app
from trtkv.errors import TrtkvError
from trtkv.models import model_info

runner = CliRunner()
pytestmark = pytest.mark.filterwarnings("ignore")

# --------------------------------------------------------------------------- fixtures: tiny models + calibrations

# head_dim 64 so the default int4 preset (groups of 64) calibrates too
_MODELS = {
    # 4 heads / 2 KV heads: tp 1 and 2 split whole KV heads
    "gqa": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=56),
    # 1 KV head (MQA), vocab 321 (not a multiple of tp), tied embeddings: tp 2 / 4 replicate the KV head, pad lm_head
    "mqa": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, intermediate_size=56, vocab_size=321,
                tie_word_embeddings=True),
    # 6 heads / 3 KV heads: tp 2 cannot split the KV heads (neither divides the other)
    "odd": dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=3, intermediate_size=56),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (model dir, in-memory model, calibration dir (method max), calibration dir (method mse))."""
    from trtkv.calibration.run import run_calibration

    root = tmp_path_factory.mktemp("export")
    data = root / "data.txt"
    data.write_text(TINY_TEXT * 40)
    cache = {}

    def get(name):
        if name not in cache:
            d = root / name
            model = build_tiny_model(d, "llama", with_tokenizer=True, seed=3, **_MODELS[name])
            cals = [run_calibration(str(d), str(data), root / f"{name}-cal-{m}", formats=["fp8", "int8-static"], method=m,
                                    samples=4, seq_len=32, progress=False, reservoir=128) for m in ("max", "mse")]
            cache[name] = (d, model, *cals)
        return cache[name]

    return get


def _kv_absmax(cal_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    stats = KVStats.from_tensors(load_stats_tensors(cal_dir))
    return stats.absmax("k", "per_tensor"), stats.absmax("v", "per_tensor")


def _load_rank(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


# --------------------------------------------------------------------------- vLLM


@pytest.mark.slow
def test_vllm_checkpoint_loads_in_transformers_with_original_logits_and_valid_scheme(tiny, tmp_path):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationStrategy
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d, model, cal, _ = tiny("gqa")
    out = tmp_path / "vllm"
    res = export_checkpoint(cal, str(d), "vllm", out, dtype="float32", max_shard_size="40KB")
    assert res.next_step() == f"vllm serve {out.absolute()} --kv-cache-dtype fp8"
    # compressed-tensors' own pydantic classes accept the block config.json carries
    cfg = json.loads((out / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    assert qc.quant_method == "compressed-tensors" and qc.config_groups == {}
    kvs = qc.kv_cache_scheme
    assert isinstance(kvs, QuantizationArgs)
    assert (kvs.type, kvs.num_bits, kvs.strategy, kvs.dynamic, kvs.symmetric) == ("float", 8, QuantizationStrategy.TENSOR, False, True)
    assert not (out / "quantization_config.json").exists()  # vLLM reads config.json only
    assert AutoConfig.from_pretrained(out).quantization_config["kv_cache_scheme"]["type"] == "float"

    # sharded: the index lists every tensor, the scales included, and every shard holds what it lists
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    for s in shards:
        with safe_open(str(out / s), "pt") as f:
            assert set(f.keys()) == {k for k, v in index.items() if v == s}
    L = model.config.num_hidden_layers
    kmax, vmax = _kv_absmax(cal)
    for i in range(L):
        for kv, amax in (("k", kmax), ("v", vmax)):
            name = f"model.layers.{i}.self_attn.{kv}_scale"
            with safe_open(str(out / index[name]), "pt") as f:
                s = f.get_tensor(name)
            assert s.dtype == torch.float32 and s.shape == (1,)
            assert s.item() == pytest.approx(amax[i].item() / 448, rel=1e-6)  # vLLM fp8: amax / 448
    # the weights load back into the transformers model and give the original logits
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    tok_src, tok_out = AutoTokenizer.from_pretrained(d), AutoTokenizer.from_pretrained(out)
    assert tok_out(TINY_TEXT)["input_ids"] == tok_src(TINY_TEXT)["input_ids"]
    manifest = json.loads((out / "trtkv_export.json").read_text())
    assert manifest["format"] == "fp8" and manifest["format_definition"]["k"]["dtype"] == "fp8_e4m3" and manifest["next_step"].startswith("vllm serve")


@pytest.mark.slow
def test_vllm_default_dtype_is_float16_and_weights_round_trip(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    d, model, cal, _ = tiny("mqa")
    out = tmp_path / "vllm16"
    res = export_checkpoint(cal, str(d), "vllm", out, tp_size=4)
    assert res.dtype == "float16" and "--tensor-parallel-size 4" in res.next_step()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16)
    ref = model.state_dict()
    for name, t in back.state_dict().items():
        assert torch.equal(t, ref[name].half()), name


# --------------------------------------------------------------------------- TensorRT-LLM: names, shapes, config


def expected_trtllm_shapes(cfg: dict, rank: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of a LLaMA rank file and its shape, derived from config.json alone (checkpoint.md + llama/convert.py)."""
    tp = cfg["mapping"]["tp_size"]
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]
    hid, inter, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv_local = max(KV // tp, 1)  # fewer KV heads than ranks: one (replicated) head per rank
    vpad = math.ceil(V / tp) * tp
    out = {"transformer.vocab_embedding.weight": (V, hid), "transformer.ln_f.weight": (hid,), "lm_head.weight": (vpad // tp, hid)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (hid,),
            p + "attention.qkv.weight": ((H // tp + 2 * kv_local) * D, hid),
            p + "attention.dense.weight": (hid, H // tp * D),
            p + "post_layernorm.weight": (hid,),
            p + "mlp.fc.weight": (inter // tp, hid),
            p + "mlp.gate.weight": (inter // tp, hid),
            p + "mlp.proj.weight": (hid, inter // tp),
            p + "attention.kv_cache_scaling_factor": (1,),
            p + "attention.kv_cache_rcp_scaling_factor": (1,),
        }
    return out


_REQUIRED_CONFIG = {  # checkpoint.md "mandatory" fields, the LLaMA fields of LLaMAConfig, mapping and quantization
    "architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
    "num_key_value_heads", "head_size", "intermediate_size", "max_position_embeddings", "norm_epsilon",
    "position_embedding_type", "rotary_base", "rotary_scaling", "logits_dtype", "tie_word_embeddings",
    "use_parallel_embedding", "embedding_sharding_dim", "mapping", "quantization",
}


@pytest.mark.parametrize("name,tp", [("gqa", 1), ("gqa", 2), ("gqa", 4), ("mqa", 2), ("mqa", 4)])
def test_trtllm_names_shapes_config_and_rank_splits_reassemble(tiny, tmp_path, name, tp):
    d, model, cal, _ = tiny(name)
    out = tmp_path / f"trt-{name}-{tp}"
    res = export_checkpoint(cal, str(d), "trtllm", out, tp_size=tp, kv="int8-static", dtype="float32")
    assert res.next_step().startswith(f"trtllm-build --checkpoint_dir {out.absolute()}") and "--kv_cache_type paged" in res.next_step()
    cfg = json.loads((out / "config.json").read_text())
    assert _REQUIRED_CONFIG <= set(cfg)
    hf = model.config
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["dtype"] == "float32"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"],
            cfg["intermediate_size"], cfg["vocab_size"], cfg["max_position_embeddings"]) == (
        hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.intermediate_size,
        hf.vocab_size, hf.max_position_embeddings)
    assert cfg["norm_epsilon"] == hf.rms_norm_eps and cfg["hidden_act"] == "silu" and cfg["position_embedding_type"] == "rope_gpt_neox"
    assert cfg["rotary_base"] == hf.rope_parameters["rope_theta"] and cfg["rotary_scaling"] is None
    assert cfg["mapping"] == {"world_size": tp, "tp_size": tp, "pp_size": 1}
    assert cfg["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": "INT8"}
    assert sorted(p.name for p in out.glob("rank*.safetensors")) == sorted(f"rank{r}.safetensors" for r in range(tp))

    ranks = [_load_rank(out / f"rank{r}.safetensors") for r in range(tp)]
    for r, w in enumerate(ranks):
        assert {k: tuple(v.shape) for k, v in w.items()} == expected_trtllm_shapes(cfg, r)
    # reassemble every split tensor from the ranks and compare with the original weights
    H, KV, D = hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim
    hq, hk = H // tp * D, max(KV // tp, 1) * D
    sd = model.state_dict()
    for i in range(hf.num_hidden_layers):
        p, h = f"transformer.layers.{i}.", f"model.layers.{i}."
        qkv = [w[p + "attention.qkv.weight"].split([hq, hk, hk]) for w in ranks]
        assert torch.equal(torch.cat([q for q, _, _ in qkv]), sd[h + "self_attn.q_proj.weight"])
        for j, proj in ((1, "k_proj"), (2, "v_proj")):
            parts = [x[j] for x in qkv]
            if KV >= tp:
                got = torch.cat(parts)
            else:  # replicated: ranks r*KV//tp share a head; the distinct heads in order rebuild the projection
                owner = [r * KV // tp for r in range(tp)]
                for r in range(tp):
                    assert torch.equal(parts[r], parts[owner.index(owner[r])])
                got = torch.cat([parts[owner.index(kvh)] for kvh in range(KV)])
            assert torch.equal(got, sd[h + f"self_attn.{proj}.weight"])
        assert torch.equal(torch.cat([w[p + "attention.dense.weight"] for w in ranks], 1), sd[h + "self_attn.o_proj.weight"])
        assert torch.equal(torch.cat([w[p + "mlp.fc.weight"] for w in ranks]), sd[h + "mlp.gate_proj.weight"])
        assert torch.equal(torch.cat([w[p + "mlp.gate.weight"] for w in ranks]), sd[h + "mlp.up_proj.weight"])
        assert torch.equal(torch.cat([w[p + "mlp.proj.weight"] for w in ranks], 1), sd[h + "mlp.down_proj.weight"])
        for w in ranks:
            assert torch.equal(w[p + "input_layernorm.weight"], sd[h + "input_layernorm.weight"])
            assert torch.equal(w[p + "post_layernorm.weight"], sd[h + "post_attention_layernorm.weight"])
    lm = torch.cat([w["lm_head.weight"] for w in ranks])
    V = hf.vocab_size
    assert torch.equal(lm[:V], model.get_output_embeddings().weight) and not lm[V:].any()  # zero padding
    for w in ranks:
        assert torch.equal(w["transformer.vocab_embedding.weight"], sd["model.embed_tokens.weight"])
    # the scales are the same on every rank
    for k in ranks[0]:
        if "scaling_factor" in k:
            assert all(torch.equal(w[k], ranks[0][k]) for w in ranks)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def trtllm_reference_logits(cfg: dict, ranks: list[dict[str, torch.Tensor]], ids: torch.Tensor) -> torch.Tensor:
    """A plain torch forward of a TensorRT-LLM LLaMA checkpoint, rank by rank as tensor parallelism runs it.

    Each rank attends with its own Q heads and the K/V heads of its fused qkv (GQA groups inside the
    rank), applies its slice of dense / mlp.proj, and the partial outputs are summed (the all-reduce).
    The MLP is GatedMLP: proj(silu(fc(x)) * gate(x)). RoPE is rotate_half (rope_gpt_neox) with
    rotary_base. Logits are the ranks' lm_head slices concatenated, padding dropped.
    """
    tp = cfg["mapping"]["tp_size"]
    H, KV, D, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"], cfg["norm_epsilon"]
    hq, hk = H // tp, max(KV // tp, 1)
    B, T = ids.shape
    inv = 1.0 / cfg["rotary_base"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()

    def rope(x):  # [B, h, T, D]
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    mask = torch.full((T, T), float("-inf")).triu(1)
    x = ranks[0]["transformer.vocab_embedding.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.layers.{i}."
        h = _rms(x, ranks[0][p + "input_layernorm.weight"], eps)
        attn = 0
        for w in ranks:
            q, k, v = (h @ w[p + "attention.qkv.weight"].T).split([hq * D, hk * D, hk * D], -1)
            q = rope(q.view(B, T, hq, D).transpose(1, 2))
            k = rope(k.view(B, T, hk, D).transpose(1, 2)).repeat_interleave(hq // hk, 1)
            v = v.view(B, T, hk, D).transpose(1, 2).repeat_interleave(hq // hk, 1)
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + mask, -1) @ v
            attn = attn + a.transpose(1, 2).reshape(B, T, hq * D) @ w[p + "attention.dense.weight"].T
        x = x + attn
        h = _rms(x, ranks[0][p + "post_layernorm.weight"], eps)
        x = x + sum((torch.nn.functional.silu(h @ w[p + "mlp.fc.weight"].T) * (h @ w[p + "mlp.gate.weight"].T)) @ w[p + "mlp.proj.weight"].T
                    for w in ranks)
    x = _rms(x, ranks[0]["transformer.ln_f.weight"], eps)
    return torch.cat([x @ w["lm_head.weight"].T for w in ranks], -1)[..., : cfg["vocab_size"]]


@pytest.mark.parametrize("name,tp", [("gqa", 2), ("gqa", 4), ("mqa", 4)])
def test_trtllm_checkpoint_computes_the_original_model(tiny, tmp_path, name, tp):
    d, model, cal, _ = tiny(name)
    out = tmp_path / "trt"
    export_checkpoint(cal, str(d), "trtllm", out, tp_size=tp, kv="int8-static", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    ranks = [_load_rank(out / f"rank{r}.safetensors") for r in range(tp)]
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
    torch.testing.assert_close(trtllm_reference_logits(cfg, ranks, ids), ref, rtol=1e-4, atol=1e-4)
    # the reference is sensitive to the fc / gate assignment: swapping them breaks it
    swapped = [{k.replace("mlp.fc.", "mlp.TMP.").replace("mlp.gate.", "mlp.fc.").replace("mlp.TMP.", "mlp.gate."): v for k, v in w.items()}
               for w in ranks]
    assert not torch.allclose(trtllm_reference_logits(cfg, swapped, ids), ref, atol=1e-3)


def test_trtllm_default_dtype_float16_and_tokenizer_beside(tiny, tmp_path):
    d, _, cal, _ = tiny("gqa")
    out = tmp_path / "trt16"
    export_checkpoint(cal, str(d), "trtllm", out, kv="int8-static")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "float16"
    w = _load_rank(out / "rank0.safetensors")
    assert w["transformer.layers.0.attention.qkv.weight"].dtype == torch.float16
    assert w["transformer.layers.0.attention.kv_cache_scaling_factor"].dtype == torch.float32
    assert (out / "tokenizer" / "tokenizer.json").is_file()


# --------------------------------------------------------------------------- scale values


def _query_absmax_reference(model, windows: torch.Tensor) -> torch.Tensor:
    """Post-RoPE query absmax per layer, recomputed from the hidden states (independent of the export's capture)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    with torch.no_grad():
        out = model(windows, output_hidden_states=True)
        T = windows.shape[1]
        pos = torch.arange(T)[None].expand(windows.shape[0], T)
        cos, sin = model.model.rotary_emb(out.hidden_states[0], pos)
        res = []
        for i, layer in enumerate(model.model.layers):
            h = layer.input_layernorm(out.hidden_states[i])
            q = layer.self_attn.q_proj(h).view(*windows.shape, -1, layer.self_attn.head_dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            res.append(q.abs().amax())
    return torch.stack(res)


def test_scale_values_max_method_equal_ranges_and_fp8_includes_query(tiny, tmp_path):
    from trtkv.data import token_windows
    from trtkv.models import load_model

    d, model, cal, _ = tiny("gqa")
    kmax, vmax = _kv_absmax(cal)
    L = model.config.num_hidden_layers
    # int8-static (shared scale) to TensorRT-LLM: scale * 127 == max(K, V absmax)
    export_checkpoint(cal, str(d), "trtllm", tmp_path / "i8", kv="int8-static")
    w = _load_rank(tmp_path / "i8" / "rank0.safetensors")
    for i in range(L):
        s = w[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]
        assert s.dtype == torch.float32 and s.shape == (1,)
        assert s.item() * 127 == pytest.approx(max(kmax[i], vmax[i]).item(), rel=1e-6)
        assert w[f"transformer.layers.{i}.attention.kv_cache_rcp_scaling_factor"].item() == pytest.approx(1 / s.item(), rel=1e-6)
    # fp8 to TensorRT-LLM: the query range (post-RoPE, on the recipe's calibration windows) is folded in
    res = export_checkpoint(cal, str(d), "trtllm", tmp_path / "f8", kv="fp8")
    recipe = load_calibration(cal).recipe
    lm = load_model(str(d), device="cpu", dtype="float32")
    windows = token_windows(lm.tokenizer, recipe.dataset["spec"], seq_len=recipe.seq_len, samples=recipe.samples, seed=recipe.seed)
    qref = _query_absmax_reference(model, windows)
    torch.testing.assert_close(torch.tensor(res.q_amax), qref, rtol=1e-5, atol=1e-6)
    assert any(qref[i] > max(kmax[i], vmax[i]) for i in range(L))  # Q sets the scale somewhere: the check below bites
    w = _load_rank(tmp_path / "f8" / "rank0.safetensors")
    for i in range(L):
        want = max(kmax[i].item(), vmax[i].item(), qref[i].item())
        assert w[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"].item() * 448 == pytest.approx(want, rel=1e-5)
    assert json.loads((tmp_path / "f8" / "config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"
    # --q-windows 0: K and V only
    res0 = export_checkpoint(cal, str(d), "trtllm", tmp_path / "f8kv", kv="fp8", q_windows=0)
    assert res0.q_amax is None and "not measured" in res0.notes[0]
    for i, s in enumerate(res0.scales["kv"]):
        assert s * 448 == pytest.approx(max(kmax[i], vmax[i]).item(), rel=1e-6)


def test_clipped_methods_stay_below_the_range_and_all_scales_positive(tiny, tmp_path):
    d, model, _, cal_mse = tiny("gqa")
    kmax, vmax = _kv_absmax(cal_mse)
    r = export_checkpoint(cal_mse, str(d), "vllm", tmp_path / "v")
    for i in range(model.config.num_hidden_layers):
        for kv, amax in (("k", kmax), ("v", vmax)):
            s = r.scales[kv][i]
            assert math.isfinite(s) and s > 0 and s * 448 <= amax[i].item() * (1 + 1e-6)
    r = export_checkpoint(cal_mse, str(d), "trtllm", tmp_path / "t", kv="int8-static")
    for i, s in enumerate(r.scales["kv"]):
        assert math.isfinite(s) and s > 0 and s * 127 <= max(kmax[i], vmax[i]).item() * (1 + 1e-6)


# --------------------------------------------------------------------------- refusals


@pytest.mark.slow
def test_refusals_name_problem_and_fix(tiny, tmp_path):
    d, _, cal, _ = tiny("gqa")
    with pytest.raises(TrtkvError, match="INT4") as e:
        export_checkpoint(cal, str(d), "trtllm", tmp_path / "a", kv="int4")
    assert "--kv fp8 or --kv int8-static" in str(e.value)
    with pytest.raises(TrtkvError, match="FP8") as e:  # per-token (dynamic) int8 to vLLM
        export_checkpoint(cal, str(d), "vllm", tmp_path / "b", kv="int8")
    assert "--kv fp8" in str(e.value)
    with pytest.raises(TrtkvError, match="per_token"):  # dynamic FP8 is not a static per-tensor scale
        export_checkpoint(cal, str(d), "vllm", tmp_path / "b", kv="k=fp8:token,v=fp8:token")
    with pytest.raises(TrtkvError, match="per-tensor KV scale per layer") as e:
        export_checkpoint(cal, str(d), "trtllm", tmp_path / "c", kv="k=fp8:head,v=fp8:head")
    assert "fp8" in e.value.fix
    with pytest.raises(TrtkvError, match="INT4"):
        export_checkpoint(cal, str(d), "vllm", tmp_path / "c", kv="int4")
    with pytest.raises(TrtkvError, match="--to vllm or --to trtllm"):
        export_checkpoint(cal, str(d), "onnx", tmp_path / "c")
    with pytest.raises(TrtkvError, match="attention heads cannot be split"):
        export_checkpoint(cal, str(d), "trtllm", tmp_path / "c", tp_size=3, kv="int8-static")
    with pytest.raises(TrtkvError, match="4 attention heads"):
        export_checkpoint(cal, str(d), "vllm", tmp_path / "c", tp_size=3)
    do, _, calo, _ = tiny("odd")
    with pytest.raises(TrtkvError, match="3 KV heads cannot be split over --tp-size 2"):
        export_checkpoint(calo, str(do), "trtllm", tmp_path / "c", tp_size=2, kv="int8-static")
    with pytest.raises(TrtkvError, match="was made for"):  # scales of another model
        dm, _, _, _ = tiny("mqa")
        export_checkpoint(cal, str(dm), "vllm", tmp_path / "c")
    assert not any(p.name.startswith(("a", "b", "c")) for p in tmp_path.iterdir())


def test_existing_out_needs_force_and_failures_leave_nothing(tiny, tmp_path, monkeypatch):
    d, _, cal, _ = tiny("gqa")
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(TrtkvError, match="already exists") as e:
        export_checkpoint(cal, str(d), "trtllm", out, kv="int8-static")
    assert "--force" in e.value.fix and (out / "keep.txt").is_file()
    import trtkv.calibration.checkpoint as ex

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ex, "_write_trtllm", boom)
    with pytest.raises(TrtkvError, match="No space left"):
        export_checkpoint(cal, str(d), "trtllm", out, kv="int8-static", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and (out / "keep.txt").is_file()  # untouched
    monkeypatch.undo()
    export_checkpoint(cal, str(d), "trtllm", out, kv="int8-static", force=True)
    assert not (out / "keep.txt").exists() and (out / "rank0.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_cli_export_and_one_line_errors(tiny, tmp_path):
    d, _, cal, _ = tiny("gqa")
    out = tmp_path / "cli"
    r = runner.invoke(app, ["export", "--calibration", str(cal), "--model", str(d), "--to", "trtllm", "--out", str(out),
                            "--tp-size", "2", "--kv", "int8-static"])
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[0]  # said before the weights load: what is exported, how the weights are read
    assert first.startswith("export ") and "int8-static KV scales into a trtllm checkpoint; loading the weights in float32" in first
    assert "trtllm-build --checkpoint_dir" in r.output and (out / "rank1.safetensors").is_file()
    r = runner.invoke(app, ["export", "--calibration", str(cal), "--model", str(d), "--to", "trtllm", "--out", str(out)])
    assert r.exit_code == 2 and "error:" in r.output and "already exists" in r.output and "--force" in r.output
    r = runner.invoke(app, ["export", "--calibration", str(cal), "--model", str(d), "--to", "trtllm", "--out", str(tmp_path / "x"),
                            "--kv", "int4"])
    assert r.exit_code == 2 and "INT4" in r.output and len(r.output.strip().splitlines()) <= 3
    r = runner.invoke(app, ["export", "--calibration", str(cal), "--model", str(d), "--to", "vllm", "--out", str(tmp_path / "y"),
                            "--kv", "int8"])
    assert r.exit_code == 2 and "error:" in r.output and "fp8" in r.output


# --------------------------------------------------------------------------- the builtin model


@pytest.mark.model
def test_builtin_model_exports_load_back(builtin_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from trtkv.calibration.run import run_calibration

    cal = run_calibration("smollm2-135m", "builtin:pydoc", tmp_path / "cal", formats=["fp8"], method="max", samples=2, seq_len=64,
                          progress=False, reservoir=64, loaded=builtin_model)
    out = export_checkpoint(cal, "smollm2-135m", "vllm", tmp_path / "vllm", dtype="float32", loaded=builtin_model).out
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, builtin_model.info.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, builtin_model.model(ids).logits, rtol=0, atol=1e-5)
    del back
    # 9 heads / 3 KV heads: tp 3 splits (one KV head per rank), tp 2 is refused
    res = export_checkpoint(cal, "smollm2-135m", "trtllm", tmp_path / "trt", tp_size=3, loaded=builtin_model, q_windows=1)
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["num_key_value_heads"] == 3
    w = _load_rank(res.out / "rank2.safetensors")
    assert {k: tuple(v.shape) for k, v in w.items()} == expected_trtllm_shapes(cfg, 2)
    assert all(s > 0 and math.isfinite(s) for s in res.scales["kv"])
    with pytest.raises(TrtkvError, match="9 attention heads"):
        export_checkpoint(cal, "smollm2-135m", "trtllm", tmp_path / "trt2", tp_size=2, loaded=builtin_model)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_vllm_export_copies_tensor_by_tensor_when_the_model_does_not_fit(tiny, tmp_path, monkeypatch, name):
    """A budget the resident export (float32 model + its copy) is over but one output shard fits: the weights are copied
    from the source shards, equal to the resident export's tensors (tied embeddings included), and load back."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from trtkv import memory

    d, model, cal, _ = tiny(name)
    ref = export_checkpoint(cal, str(d), "vllm", tmp_path / "resident", dtype="float16", max_shard_size="40KB")
    assert not any("copied" in n for n in ref.notes)
    params = sum(p.numel() for p in model.parameters())
    monkeypatch.setenv(memory.LIMIT_ENV, str(memory.HOST_OVERHEAD + params * 2 - 1))  # not even the float16 model fits
    lines: list[str] = []
    res = export_checkpoint(cal, str(d), "vllm", tmp_path / "copied", dtype="float16", max_shard_size="40KB", progress=lines.append)
    assert any("copied tensor by tensor" in n for n in res.notes)
    # the first line says what is about to be copied, then one line per shard written, counting up
    assert lines[0].startswith(f"export {model_info(str(d)).name}:") and "copying the weights tensor by tensor" in lines[0]
    shard_lines = [ln for ln in lines[1:] if "shard" in ln]
    assert len(shard_lines) == len(list((tmp_path / "copied").glob("*.safetensors"))) > 1
    assert [int(ln.split()[1]) for ln in shard_lines] == list(range(1, len(shard_lines) + 1))

    def tensors(out: Path) -> dict[str, torch.Tensor]:
        files = sorted(out.glob("*.safetensors"))
        assert len(files) > 1 and (out / "model.safetensors.index.json").is_file()
        t = {}
        for f in files:
            with safe_open(str(f), "pt") as h:
                t.update({k: h.get_tensor(k) for k in h.keys()})
        return t

    a, b = tensors(tmp_path / "resident"), tensors(tmp_path / "copied")
    assert set(b) - set(a) == set()  # nothing the resident export lacks (tied lm_head is left out of both or kept in both)
    for k in b:
        assert b[k].dtype == a[k].dtype and torch.equal(b[k], a[k]), k
    index = json.loads((tmp_path / "copied" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(b)
    cfg = json.loads((tmp_path / "copied" / "config.json").read_text())
    assert cfg["dtype"] == "float16" and cfg["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "copied", dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model.half().float()(ids).logits, rtol=0, atol=1e-4)
    # one shard must fit: a budget under it is refused in one line naming --max-shard-size, nothing written
    monkeypatch.setenv(memory.LIMIT_ENV, str(memory.HOST_OVERHEAD))
    with pytest.raises(TrtkvError, match="--max-shard-size"):
        export_checkpoint(cal, str(d), "vllm", tmp_path / "none", dtype="float16", max_shard_size="40KB")
    assert not (tmp_path / "none").exists()
