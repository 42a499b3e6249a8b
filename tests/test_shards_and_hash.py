"""The per-machine content-hash cache (trtkv.content_hash) and sharded checkpoints in and out (trtkv.shards)."""

from __future__ import annotations

import builtins
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_TEXT, build_tiny_model

from trtkv import content_hash
from trtkv.content_hash import hash_cache_dir, sha256_file
from trtkv.errors import TrtkvError
from trtkv.models import load_model, model_info
from trtkv.shards import INDEX_FILE, TensorEntry, checkpoint_files, tensor_index


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TRTKV_CACHE", str(root))
    content_hash._sha256_cached.cache_clear()
    yield root / "hashes"
    content_hash._sha256_cached.cache_clear()


def _blob(path: Path, n: int = 100_000, seed: int = 0) -> Path:
    path.write_bytes(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8).numpy().tobytes())
    return path


def _reads(monkeypatch, path: Path) -> list[str]:
    """Record every open() of ``path`` from here on."""
    seen: list[str] = []
    real = builtins.open

    def spy(file, *a, **kw):
        if Path(str(file)).resolve() == path.resolve():
            seen.append(str(file))
        return real(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", spy)
    return seen


# --------------------------------------------------------------------------- the hash cache


def test_digest_is_hashlib_and_entry_lands_under_trtkv_cache(cache, tmp_path):
    f = _blob(tmp_path / "w.bin")
    assert sha256_file(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    assert hash_cache_dir() == cache
    [entry] = cache.glob("*.json")
    data = json.loads(entry.read_text())
    assert data["path"] == str(f.resolve()) and data["size"] == f.stat().st_size and data["sha256"] == sha256_file(f)
    assert not list(cache.glob(".tmp-*"))


def test_second_call_in_a_new_process_reads_no_weights(cache, tmp_path, monkeypatch):
    f = _blob(tmp_path / "w.bin")
    first = sha256_file(f)
    content_hash._sha256_cached.cache_clear()  # what a new process sees: only the entry on disk
    seen = _reads(monkeypatch, f)
    assert sha256_file(f) == first and seen == []


def test_changed_mtime_or_size_is_hashed_again(cache, tmp_path):
    f = _blob(tmp_path / "w.bin")
    first = sha256_file(f)
    # same size, new bytes, a new mtime: a new digest
    _blob(f, seed=1)
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert sha256_file(f) == hashlib.sha256(f.read_bytes()).hexdigest() != first
    # a different size with the mtime put back exactly: hashed again too
    mtime = f.stat().st_mtime_ns
    _blob(f, n=50_000, seed=2)
    os.utime(f, ns=(mtime, mtime))
    assert sha256_file(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    assert len(list(cache.glob("*.json"))) == 3


@pytest.mark.parametrize("garbage", ["", "{not json", '{"sha256": "zz"}', '{"v": 1, "path": "/elsewhere", "sha256": "' + "0" * 64 + '"}'])
def test_a_corrupt_entry_is_ignored_and_rewritten(cache, tmp_path, garbage):
    f = _blob(tmp_path / "w.bin")
    right = sha256_file(f)
    [entry] = cache.glob("*.json")
    entry.write_text(garbage)
    content_hash._sha256_cached.cache_clear()
    assert sha256_file(f) == right
    assert json.loads(entry.read_text())["sha256"] == right


def test_file_memo_computes_once_per_machine_and_again_when_the_file_changes(cache, tmp_path):
    """A GGUF's parsed header is remembered like a digest: one parse per (path, size, mtime), a corrupt entry reparsed."""
    f = _blob(tmp_path / "m.gguf")
    calls: list[Path] = []

    def parse(p: Path) -> dict:
        calls.append(p)
        return {"n": p.stat().st_size, "first": p.read_bytes()[:4].hex(), "pair": (1, 2)}

    content_hash._memo_cached.cache_clear()
    first = content_hash.file_memo(f, "meta", parse)
    assert first == {"n": 100_000, "first": f.read_bytes()[:4].hex(), "pair": [1, 2]}  # as JSON gives it back
    content_hash._memo_cached.cache_clear()  # a new process: read from disk, no parse
    assert content_hash.file_memo(f, "meta", parse) == first and len(calls) == 1
    [entry] = (cache.parent / "meta").glob("*.json")
    entry.write_text("{not json")
    content_hash._memo_cached.cache_clear()
    assert content_hash.file_memo(f, "meta", parse) == first and len(calls) == 2
    _blob(f, n=50_000, seed=3)
    assert content_hash.file_memo(f, "meta", parse)["n"] == 50_000 and len(calls) == 3
    content_hash._memo_cached.cache_clear()


def test_progress_on_stderr_for_large_files_only(cache, tmp_path, monkeypatch, capsys):
    small = _blob(tmp_path / "small.bin")
    sha256_file(small)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(content_hash, "PROGRESS_BYTES", 1000)
    monkeypatch.setattr(content_hash, "_CHUNK", 20_000)
    big = _blob(tmp_path / "big.bin", seed=3)
    sha256_file(big)
    err = capsys.readouterr().err
    assert "hashing big.bin" in err and "GiB" in err and "MB/s" in err
    content_hash._sha256_cached.cache_clear()
    sha256_file(big)  # a cache hit prints nothing
    assert capsys.readouterr().err == ""


def test_model_info_hash_of_a_dir_is_unchanged_and_cached(cache, tiny_model, monkeypatch):
    d, _ = tiny_model("qwen2")
    files = sorted(d.glob("*.safetensors"))
    expected = hashlib.sha256("".join(hashlib.sha256(f.read_bytes()).hexdigest() for f in files).encode()).hexdigest()
    assert model_info(str(d)).sha256 == expected
    content_hash._sha256_cached.cache_clear()

    def no_rehash(path, size):
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(content_hash, "_hash", no_rehash)  # the headers are read for the parameter count, not the weights
    assert model_info(str(d)).sha256 == expected


# --------------------------------------------------------------------------- sharded checkpoints in


def _sharded(d: Path, model: torch.nn.Module) -> Path:
    out = d.parent / (d.name + "-sharded")
    model.save_pretrained(str(out), max_shard_size="20KB")
    assert (out / INDEX_FILE).is_file() and len(list(out.glob("*.safetensors"))) > 2
    return out


def test_sharded_dir_reads_like_the_single_file(cache, tiny_model):
    d, model = tiny_model("mistral")
    s = _sharded(d, model)
    shards = sorted(set(json.loads((s / INDEX_FILE).read_text())["weight_map"].values()))
    _blob(s / "stray.safetensors")  # not in the index: ignored (it is not even a safetensors file)
    assert [f.name for f in checkpoint_files(s)] == shards
    one, many = model_info(str(d)), model_info(str(s))
    assert many.num_params == one.num_params and many.param_bytes == one.param_bytes
    expected = hashlib.sha256("".join(hashlib.sha256((s / f).read_bytes()).hexdigest() for f in shards).encode()).hexdigest()
    assert many.sha256 == expected
    idx = tensor_index(s)
    assert set(idx) == set(tensor_index(d))
    for name, p in model.state_dict().items():
        if name in idx:
            e = idx[name]
            assert isinstance(e, TensorEntry) and e.shape == tuple(p.shape) and e.dtype == "F32" and e.file.name in shards
    assert sum(math.prod(e.shape) for e in idx.values()) == one.num_params
    lm = load_model(str(s), device="cpu", dtype="float32")
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_index_naming_a_missing_shard_is_one_line(cache, tiny_model):
    d, model = tiny_model("mistral")
    s = _sharded(d, model)
    gone = sorted(set(json.loads((s / INDEX_FILE).read_text())["weight_map"].values()))[1]
    (s / gone).unlink()
    for call in (lambda: model_info(str(s)), lambda: tensor_index(s), lambda: checkpoint_files(s)):
        with pytest.raises(TrtkvError) as e:
            call()
        assert gone in e.value.problem and "\n" not in str(e.value.problem)


def test_unreadable_index_is_one_line(cache, tiny_model):
    d, model = tiny_model("mistral")
    s = _sharded(d, model)
    (s / INDEX_FILE).write_text("{")
    with pytest.raises(TrtkvError, match="shard index"):
        model_info(str(s))


# --------------------------------------------------------------------------- sharded checkpoints out


@pytest.mark.slow
def test_vllm_export_shards_load_back_in_transformers_and_trtkv(cache, tmp_path):
    from transformers import AutoModelForCausalLM

    from trtkv.calibration.checkpoint import export_checkpoint
    from trtkv.calibration.run import run_calibration

    d = tmp_path / "m"
    model = build_tiny_model(d, "llama", with_tokenizer=True, seed=3)
    data = tmp_path / "data.txt"
    data.write_text(TINY_TEXT * 40)
    cal = run_calibration(str(d), str(data), tmp_path / "cal", formats=["fp8"], method="max", samples=4, seq_len=32,
                          progress=False, reservoir=128)
    out = tmp_path / "vllm"
    export_checkpoint(cal, str(d), "vllm", out, dtype="float32", max_shard_size="20KB")
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and index["metadata"]["total_size"] > 0
    assert [f.name for f in checkpoint_files(out)] == shards
    idx = tensor_index(out)
    assert any(k.endswith("k_scale") for k in idx)
    assert model_info(str(out)).num_params == sum(math.prod(e.shape) for e in idx.values())
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(4))
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_model(str(out), device="cpu", dtype="float32")
    with torch.no_grad():
        ref = model(ids).logits
        torch.testing.assert_close(back(ids).logits, ref, rtol=0, atol=0)
        torch.testing.assert_close(ours.model(ids).logits, ref, rtol=0, atol=0)
    shutil.rmtree(out)
