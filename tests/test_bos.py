"""BOS where the model expects it: GGUF add_bos_token carried into the tokenizer, windows, served prompts."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_tokenizer
from test_families import FAMILIES, GGUF, GGUF_UNMAPPED, _write_gguf

from trtkv.data import adds_bos, split_tokens, token_windows, window_count
from trtkv.models import load_tokenizer


def _bos_tokenizer(add_bos: bool):
    """The tiny byte-level BPE tokenizer with ``<bos>`` as a special token, with or without a BOS post-processor."""
    from tokenizers import processors

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"bos_token": "<bos>"})
    if add_bos:
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", tok.bos_token_id)]
        )
    return tok


@pytest.mark.parametrize("add_bos", [True, False])
def test_gguf_add_bos_token_round_trips(tiny_models, tmp_path, monkeypatch, add_bos):
    from transformers import AutoTokenizer

    monkeypatch.setenv("TRTKV_CACHE", str(tmp_path / "cache"))
    arch, kw = FAMILIES["gemma2"]  # a Gemma GGUF says add_bos_token = true; transformers' tokenizer ignored it
    d, model = tiny_models(arch, with_tokenizer=True, **{k: v for k, v in kw.items() if k not in GGUF_UNMAPPED})
    path = tmp_path / f"bos-{add_bos}.gguf"
    _write_gguf(model, AutoTokenizer.from_pretrained(str(d)), path, GGUF["gemma2"], add_bos=add_bos)
    tok = load_tokenizer(str(path))
    ids = tok("hello world").input_ids
    assert adds_bos(tok) is add_bos
    assert (ids[0] == tok.bos_token_id) is add_bos
    assert ids[add_bos:] == tok("hello world", add_special_tokens=False).input_ids
    saved = tmp_path / f"saved-{add_bos}"  # what the conversion cache and an engine's tokenizer dir hold
    tok.save_pretrained(str(saved))
    assert adds_bos(AutoTokenizer.from_pretrained(str(saved))) is add_bos


@pytest.mark.parametrize("add_bos", [True, False])
def test_windows_start_with_bos_exactly_when_the_tokenizer_adds_it(tmp_path, add_bos):
    f = tmp_path / "text.txt"
    f.write_text("the quick brown fox jumps over the lazy dog and keeps running through the field. " * 40)
    tok = _bos_tokenizer(add_bos)
    assert adds_bos(tok) is add_bos
    stream = split_tokens(tok, str(f), "eval")
    w = token_windows(tok, str(f), seq_len=16, samples=None, split="eval")
    body = 16 - add_bos
    assert w.shape == (stream.numel() // body, 16) == (window_count(tok, str(f), seq_len=16, split="eval"), 16)
    assert bool((w[:, 0] == tok.bos_token_id).all()) is add_bos
    assert torch.equal(w[:, add_bos:].flatten(), stream[: w.shape[0] * body])  # the stream, continued window to window
    if add_bos:
        with pytest.raises(Exception, match="at least 2"):
            token_windows(tok, str(f), seq_len=1, samples=None, split="eval")


@pytest.mark.parametrize("add_bos", [True, False])
def test_a_cached_conversion_follows_the_gguf_flag(tiny_models, tmp_path, monkeypatch, add_bos):
    """A cache entry whose saved tokenizer disagrees with the GGUF (written before the flag was carried) is corrected on load."""
    from transformers import AutoTokenizer

    from trtkv.models import _CACHE_MARKER, gguf_cache_dir

    monkeypatch.setenv("TRTKV_CACHE", str(tmp_path / "cache"))
    arch, kw = FAMILIES["gemma2"]
    d, model = tiny_models(arch, with_tokenizer=True, **{k: v for k, v in kw.items() if k not in GGUF_UNMAPPED})
    path = tmp_path / "gemma.gguf"
    _write_gguf(model, AutoTokenizer.from_pretrained(str(d)), path, GGUF["gemma2"], add_bos=add_bos)
    stale = load_tokenizer(str(path))
    stale.add_bos_token = not add_bos
    assert adds_bos(stale) is not add_bos
    entry = gguf_cache_dir(str(path))
    stale.save_pretrained(str(entry))
    (entry / _CACHE_MARKER).write_text("{}\n")
    assert adds_bos(AutoTokenizer.from_pretrained(str(entry))) is not add_bos
    assert adds_bos(load_tokenizer(str(path))) is add_bos


# --------------------------------------------------------------------------- served prompts

_CHAT = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def _engine_ids(tok, prompt: str) -> list[int]:
    """The ids ``LLMEngine.make_sequence`` gives a text prompt (the one place the runtime tokenizes prompts)."""
    import threading
    from types import SimpleNamespace

    from trtkv.runtime.llm_engine import LLMEngine
    from trtkv.runtime.sequence import SamplingParams

    fake = SimpleNamespace(tokenizer=tok, manifest=SimpleNamespace(model=SimpleNamespace(vocab_size=len(tok))),
                           scheduler=SimpleNamespace(check=lambda seq: None), _reject_lock=threading.Lock(),
                           stats_counters={"rejected": 0})
    return list(LLMEngine.make_sequence(fake, prompt, SamplingParams()).prompt_ids)


@pytest.mark.parametrize("add_bos", [True, False])
def test_served_prompts_are_tokenized_the_way_the_tokenizer_says(add_bos):
    from trtkv.triton_repo.openai_api import ChatRequest, Served, chat_prompt

    tok = _bos_tokenizer(add_bos)
    tok.chat_template = _CHAT
    prompt = "the quick brown fox"
    ids = _engine_ids(tok, prompt)
    assert ids == tok(prompt).input_ids and (ids[0] == tok.bos_token_id) is add_bos

    served = Served("m", tok, 128, "http://127.0.0.1:1")
    req = ChatRequest(model="m", messages=[{"role": "user", "content": "hello fox"}], max_tokens=4)
    chat_ids = _engine_ids(tok, chat_prompt(served, req))
    want = tok.apply_chat_template([{"role": "user", "content": "hello fox"}], tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert chat_ids == want and chat_ids[0] == tok.bos_token_id and chat_ids[1] != tok.bos_token_id  # one BOS, not two
    assert served.count(chat_prompt(served, req)) == len(want)
