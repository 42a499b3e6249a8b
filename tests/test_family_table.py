"""The family table (trtkv/families.py): every row agrees with transformers' implementation of its family, every field
is read by the code it drives, and a family is added by one row.

* agreement: on a tiny random model of each row, what transformers' modules do -- the window and soft-cap each
  attention call receives, eager-only, (1 + w) norms, sandwich norms, per-head q/k norms, fused projections, scaled
  embeddings, final soft-capping -- is what the row says;
* each field is read: flipping it on one row changes what its reader (model loading, the capability table, the
  weight reader, calibration's key hook, the lean decoder, the torch engine, the TensorRT-LLM export) does, and
  every field but the names has such a check;
* a new family by one row: Ministral (``MinistralForCausalLM``, which transformers implements and the table does not
  list) is refused, then registered as one row, and runs calibrate -> eval -> build-engine (ONNX step network and
  torch engine) -> generate; the generated text is transformers' own greedy continuation over the same quantized
  cache.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trtkv import families
from trtkv.errors import TrtkvError
from trtkv.families import FAMILIES, LAYER_TYPES, NO_WINDOWS, SLIDING_ATTENTION, Family

# the tiny model each row is checked on: 6 layers, a window of 4 where the family takes one (Qwen2 / Qwen3 only with
# use_sliding_window, from layer max_window_layers on; Gemma 2 alternates; Gemma 3 has five local layers per global
# one), soft-caps in the config (a family that does not cap ignores them)
WINDOW = 4
ATTN_CAP, FINAL_CAP = 5.0, 2.0**-10  # exact in float32: a capped logit is at most FINAL_CAP
ROW_MODEL = dict(num_hidden_layers=6, sliding_window=WINDOW, use_sliding_window=True, max_window_layers=2,
                 attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP)


def _recorded_attention_calls(model) -> dict[int, dict]:
    """layer -> the ``sliding_window`` and ``softcap`` transformers' attention module passes to the attention function
    (what the torch engine's paged attention receives), from one forward of ``model`` with a recording function."""
    from transformers import AttentionInterface

    calls: dict[int, dict] = {}

    def recording(module, query, key, value, attention_mask, **kwargs):  # the output's values do not matter here
        calls[module.layer_idx] = {"sliding_window": kwargs.get("sliding_window"), "softcap": kwargs.get("softcap")}
        return query.transpose(1, 2).contiguous(), None

    AttentionInterface.register("trtkv_record_calls", recording)
    configs = list({id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values())
    before = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = "trtkv_record_calls"
    try:
        with torch.no_grad():
            model(torch.arange(3, 3 + 2 * WINDOW)[None])
    finally:
        for c, b in zip(configs, before):
            c._attn_implementation = b
    return calls


def check_row_against_transformers(row: Family, model) -> None:
    """What transformers' modules of ``model`` (a tiny random model of ``row``'s family, ``ROW_MODEL`` config) do is
    what the row says."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = model.config.get_text_config(decoder=True)
    assert type(model).__name__ in row.architectures and MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[row.model_type] in row.architectures
    assert type(cfg).model_type == row.model_type
    if row.gguf is not None:  # a key transformers' GGUF loader reads
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        assert row.gguf in GGUF_CONFIG_MAPPING
    assert row.eager_only == (not type(model)._supports_sdpa)
    n = cfg.num_hidden_layers
    calls = _recorded_attention_calls(model)
    assert [calls[i]["sliding_window"] for i in range(n)] == row.layer_windows(cfg, n)
    assert all((calls[i]["softcap"] == ATTN_CAP) == row.attn_softcap for i in range(n))
    base, layer, att = model.model, model.model.layers[0], model.model.layers[0].self_attn
    assert row.qk_norm == isinstance(getattr(att, "q_norm", None), torch.nn.Module) == isinstance(getattr(att, "k_norm", None), torch.nn.Module)
    assert row.fused_projections == hasattr(att, "qkv_proj") == hasattr(layer.mlp, "gate_up_proj") != hasattr(att, "k_proj")
    assert row.sandwich_norms == hasattr(layer, "pre_feedforward_layernorm") == hasattr(layer, "post_feedforward_layernorm")
    ids = torch.arange(5, 12)
    with torch.no_grad():
        scale = (base.embed_tokens(ids) / base.embed_tokens.weight[ids]).nanmean().item()
        assert scale == pytest.approx(math.sqrt(cfg.hidden_size) if row.scaled_embedding else 1.0, rel=1e-3)
        logits = model(ids[None]).logits
        x = torch.randn(3, cfg.hidden_size)
        base.norm.weight.zero_()  # the norm multiplies by (norm_offset + 0)
        want = F.rms_norm(x, (cfg.hidden_size,), eps=cfg.rms_norm_eps) * row.norm_offset
        torch.testing.assert_close(base.norm(x), want, rtol=1e-5, atol=1e-6)
    assert (logits.abs().max().item() <= FINAL_CAP) == row.final_softcap


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_row_agrees_with_transformers(tiny_model, name):
    _, model = tiny_model(name, **ROW_MODEL)
    check_row_against_transformers(FAMILIES[name], model)
    assert any(t == SLIDING_ATTENTION for t in FAMILIES[name].layer_types(model.config, 6)) == (FAMILIES[name].windows != NO_WINDOWS)


def test_a_window_in_a_config_of_a_family_without_windows_is_ignored(tiny_model):
    """Llama's attention takes no window: a sliding_window in its config leaves every layer global in the record, as
    transformers computes it (its logits past the window are those of the same model without the window)."""
    from trtkv.models import model_info

    d, model = tiny_model("llama", sliding_window=WINDOW)
    info = model_info(str(d))
    assert not info.has_sliding_layers and info.sliding_window is None
    ids = torch.randint(0, 320, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        windowed = model(ids).logits
        model.config.sliding_window = None
        assert torch.equal(model(ids).logits, windowed)


def test_rows_are_checked_when_made():
    with pytest.raises(ValueError, match="windows must be one of"):
        Family("x", "X", ("XForCausalLM",), "x", windows="alternating")
    with pytest.raises(ValueError, match="names no architecture"):
        Family("x", "X", (), "x")
    with pytest.raises(ValueError, match="lean decoder does not implement norm_offset, sandwich_norms"):
        Family("x", "X", ("XForCausalLM",), "x", lean=True, norm_offset=1.0, sandwich_norms=True)


def test_lookups_and_the_refusal_name_the_table():
    assert families.family_of("Gemma3ForCausalLM") is FAMILIES["gemma3"]
    assert families.family_of_gguf("gemma3") is FAMILIES["gemma3"] and families.family_of_gguf(None) is None
    assert families.family_of_model_type("gemma3_text") is FAMILIES["gemma3"] and families.family_of_model_type("gemma3") is None
    assert families.architectures(lambda f: f.lean) == ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    with pytest.raises(TrtkvError, match="here: architecture FalconForCausalLM is not supported") as e:
        families.require("FalconForCausalLM", "here")
    assert e.value.fix.endswith(", ".join(families.architectures()))


def test_family_table_in_docs_is_generated_from_the_rows(monkeypatch):
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "docs" / "gen_families.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sys.path.insert(0, str(root / "docs"))
    try:
        import gen_families
    finally:
        sys.path.remove(str(root / "docs"))
    before = gen_families.table()
    assert "| `gemma2`: Gemma 2 | `Gemma2ForCausalLM` | `gemma2` | `gemma2` | eager only, soft-caps scores" in before
    _flip(monkeypatch, "phi3", step_network=False)
    assert gen_families.table() != before


# --------------------------------------------------------------------------- each field is read


def _flip(monkeypatch, name: str, **fields) -> Family:
    row = dataclasses.replace(FAMILIES[name], **fields)
    monkeypatch.setitem(FAMILIES, name, row)
    return row


def _outcome(fn):
    """``fn()``'s value, or the type and first words of what it raised: a probe's observable either way."""
    try:
        return fn()
    except (TrtkvError, AttributeError) as e:
        return (type(e).__name__, str(e)[:60])


def _weights(d, model):
    from trtkv.builder.weights import extract_weights
    from trtkv.models import model_info

    return extract_weights(model, model_info(str(d)))


def _config_without_architectures(d, tmp_path):
    from trtkv.models import model_info

    cfg = json.loads((d / "config.json").read_text())
    del cfg["architectures"]
    (tmp_path / "bare").mkdir(exist_ok=True)
    for f in d.iterdir():
        (tmp_path / "bare" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "bare" / "config.json").write_text(json.dumps(cfg))
    return model_info(str(tmp_path / "bare")).architecture


def _gguf_record(d, model, tmp_path, monkeypatch):
    from test_families import _write_gguf
    from transformers import AutoTokenizer

    from trtkv.models import model_info

    monkeypatch.setenv("TRTKV_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    if not path.exists():
        _write_gguf(model, AutoTokenizer.from_pretrained(str(d)), path, "QWEN3")
    return model_info(str(path)).architecture


def _lean_layer(model):
    from trtkv.runtime.lean import LeanDecoder

    return LeanDecoder(copy.deepcopy(model), attention=None).layers  # the decoder makes the weights views: a copy's


def _pre_rope_key_module(model):
    from trtkv.calibration.stats import _pre_rope_keys

    family = families.family_of(type(model).__name__)
    return type(_pre_rope_keys(model.model.layers[0].self_attn, family, 1, 1, 1)[0]).__name__


def _torch_engine_final_cap(model):
    from trtkv.runtime.torch_engine import TorchEngine

    return TorchEngine(copy.deepcopy(model), attention="torch", device="cpu", lean=False)._final_softcap


def _step_network_refusal(d):
    from trtkv.builder.step_network import check_model
    from trtkv.models import model_info

    return _outcome(lambda: check_model(model_info(str(d)), "native"))


def _plugin_reasons(d):
    from trtkv.models import model_info
    from trtkv.plugins.contract.capabilities import CAPABILITIES

    return tuple(CAPABILITIES["plugin"].model_reasons(model_info(str(d))))


def _lean_reason(model):
    from trtkv.runtime.lean import LeanDecoder

    return LeanDecoder.reason(model)


def _trtllm_refusal(d):
    from trtkv.calibration.checkpoint import check_trtllm_model
    from trtkv.models import model_info

    info = model_info(str(d))
    return _outcome(lambda: check_trtllm_model(info, None, 1))


def _eager(d):
    from trtkv.models import attention_implementation, model_info

    return attention_implementation(model_info(str(d)), "sdpa")


GEMMA2 = dict(sliding_window=WINDOW, attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=3.0, head_dim=24)
# field -> (row, tiny-model config, the flipped value, probe(dir, model, tmp_path, monkeypatch) -> what the field drives)
FLIPS = {
    "architectures": ("qwen3", {}, ("Qwen3LikeForCausalLM",), lambda d, m, t, mp: _outcome(lambda: _weights(d, m).info.architecture)),
    "model_type": ("qwen3", {}, "qwen3_like", lambda d, m, t, mp: _outcome(lambda: _config_without_architectures(d, t))),
    "gguf": ("qwen3", dict(head_dim=128), "qwen3_like", lambda d, m, t, mp: _outcome(lambda: _gguf_record(d, m, t, mp))),
    "eager_only": ("gemma2", GEMMA2, False, lambda d, m, t, mp: _eager(d)),
    "attn_softcap": ("gemma2", GEMMA2, False, lambda d, m, t, mp: (_weights(d, m).attn_softcap, _plugin_reasons(d))),
    "final_softcap": ("gemma2", GEMMA2, False, lambda d, m, t, mp: (_weights(d, m).final_softcap, _torch_engine_final_cap(m))),
    "windows": ("mistral", dict(sliding_window=WINDOW), NO_WINDOWS, lambda d, m, t, mp: (_weights(d, m).info.layer_types,
                                                                                        [x.window for x in _lean_layer(m)])),
    "norm_offset": ("gemma2", GEMMA2, 0.0, lambda d, m, t, mp: float(_weights(d, m).final_norm.sum())),
    "sandwich_norms": ("gemma2", GEMMA2, False, lambda d, m, t, mp: _weights(d, m).layers[0].attn_out_norm is None),
    "qk_norm": ("qwen3", {}, False, lambda d, m, t, mp: (_weights(d, m).layers[0].q_norm is None, _pre_rope_key_module(m),
                                                          _lean_layer(m)[0].q_norm is None)),
    "fused_projections": ("phi3", dict(hidden_size=96), False, lambda d, m, t, mp: (_outcome(lambda: _weights(d, m).layers[0].wq.shape),
                                                                  _outcome(lambda: _pre_rope_key_module(m)))),
    "scaled_embedding": ("gemma2", GEMMA2, False, lambda d, m, t, mp: _weights(d, m).embed_scale),
    "step_network": ("qwen3", {}, False, lambda d, m, t, mp: _step_network_refusal(d)),
    "lean": ("qwen3", {}, False, lambda d, m, t, mp: _lean_reason(m)),
    "trtllm_export": ("llama", {}, False, lambda d, m, t, mp: _trtllm_refusal(d)),
}


def test_every_field_but_the_names_has_a_flip():
    assert set(FLIPS) == {f.name for f in dataclasses.fields(Family)} - {"name", "title"}


@pytest.mark.parametrize("field", list(FLIPS))
def test_flipping_a_field_changes_what_reads_it(tiny_models, field, tmp_path, monkeypatch):
    name, config, flipped, probe = FLIPS[field]
    d, model = tiny_models(name, with_tokenizer=field == "gguf", **config)
    before = probe(d, model, tmp_path, monkeypatch)
    _flip(monkeypatch, name, **{field: flipped})
    after = probe(d, model, tmp_path, monkeypatch)
    assert after != before, (field, before)


# --------------------------------------------------------------------------- a new family is one row

MINISTRAL = Family("ministral", "Ministral", ("MinistralForCausalLM",), "ministral", windows=LAYER_TYPES, lean=True)
MINISTRAL_MODEL = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])


@pytest.mark.slow
def test_a_new_family_is_one_row(tmp_path, monkeypatch):
    """Ministral is refused, then one row makes calibrate -> eval -> build-engine -> generate run on a tiny random
    model of it; both engines' greedy text is transformers' own continuation over the same int4 cache, past the
    window of its local layer."""
    from conftest import build_tiny_model
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from trtkv.cli import app
    from trtkv.evaluate import greedy_generate
    from trtkv.manifest import load_manifest
    from trtkv.models import model_info
    from trtkv.runtime.kv_pool import PagedKVCache

    assert families.family_of("MinistralForCausalLM") is None
    monkeypatch.setitem(FAMILIES, "ministral", MINISTRAL)  # the tiny-model builder reads the row too
    d = tmp_path / "ministral"
    model = build_tiny_model(d, "ministral", with_tokenizer=True, **MINISTRAL_MODEL)
    monkeypatch.delitem(FAMILIES, "ministral")
    with pytest.raises(TrtkvError, match="architecture MinistralForCausalLM is not supported"):
        model_info(str(d))

    monkeypatch.setitem(FAMILIES, "ministral", MINISTRAL)  # the one row
    info = model_info(str(d))
    assert info.architecture == "MinistralForCausalLM" and info.layer_types == ("sliding_attention", "full_attention")
    assert info.sliding_window == 8
    check_row_against_transformers(MINISTRAL, build_tiny_model(tmp_path / "check", "ministral", **ROW_MODEL))

    cli = CliRunner()
    cpu = ["--device", "cpu", "--dtype", "float32"]

    def run(*args):
        res = cli.invoke(app, [str(a) for a in args])
        assert res.exit_code == 0, res.output
        return res.output

    run("calibrate", "--model", d, "--out", tmp_path / "cal", "--samples", "2", "--seq-len", "32", *cpu)
    run("eval", "--model", d, "--calibration", tmp_path / "cal", "--kv", "fp16", "--kv", "int4", "--windows", "2", "--seq-len", "40",
        "--generate", "1", "--json", tmp_path / "eval.json", *cpu)
    results = {r["format"]: r for r in json.loads((tmp_path / "eval.json").read_text())["results"]}
    assert results["fp16"]["kld_mean"] == 0.0 and math.isfinite(results["int4"]["ppl"])
    prompt = "The quick brown fox"
    tok = AutoTokenizer.from_pretrained(str(d))
    ids = torch.tensor([tok(prompt)["input_ids"]])
    new_tokens = 16  # prompt + new tokens reach twice past the window of 8
    assert ids.shape[1] + new_tokens > 2 * info.sliding_window
    texts = {}
    for backend in ("onnxruntime", "torch"):  # the ONNX step network; the torch engine (the lean decoder runs the row)
        eng = tmp_path / f"engine-{backend}"
        run("build-engine", "--model", d, "--calibration", tmp_path / "cal", "--kv", "int4", "--out", eng, "--backend", backend,
            "--block-size", "4", "--max-seq-len", "64", "--max-batch", "2")
        texts[backend] = run("generate", prompt, "--engine", eng, "-n", new_tokens, "--no-stream").splitlines()[0]
    manifest = load_manifest(tmp_path / "engine-onnxruntime")
    params = PagedKVCache.for_engine(manifest, tmp_path / "engine-onnxruntime", num_blocks=1, num_slots=1).params
    with torch.inference_mode():
        want = greedy_generate(model, ids, manifest.kv_format, params, new_tokens=new_tokens)[0].tolist()
    eos = set(info.eos_token_ids)
    want = want[: next((i for i, t in enumerate(want) if t in eos), len(want))]
    assert texts["onnxruntime"] == texts["torch"] == prompt + tok.decode(want)
