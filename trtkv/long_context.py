"""The long-context tasks of ``trtkv eval``: retrieval at distance (``recall``) and pass-key retrieval (``passkey``).

This module builds the items and owns their result rows, tables and plot; ``trtkv.evaluate.evaluate_tasks`` scores
them: every format against the unquantized model on identical inputs through the eval cache (``score_windows``: the
sealed-block chunks the paged engine computes, only the scored positions projected to the vocabulary). The perplexity
task's error by position is ``trtkv.evaluate``'s (``kld_by_position``).

* **recall**: a passage of ``passage_tokens`` tokens from one document of the dataset's eval split, filler from *other*
  documents (joined with the separator, as token streams are), and the passage again, in a window of exactly
  ``context`` tokens::

      [BOS] passage SEP filler SEP passage

  The second copy's tokens 2..L are scored (its first token is unpredictable: nothing says the passage starts again):
  top-1 against the true tokens (``recall_top1``), agreement with fp16's top-1, perplexity, KL from fp16; the first
  copy's perplexity (tokens 2..L, nothing to recall) is the reference. ``distance`` = tokens from a passage token to
  its copy = ``context - passage_tokens`` (minus BOS).
* **passkey**: a needle sentence carrying a 5-digit key at depth d of a haystack of dataset text, the question, and the
  answer ``" <key>"`` as the window's last tokens. An item passes when every answer token is the top-1 — teacher-forced,
  which is exactly when greedy decoding writes the key. Depths spread evenly over 0..1 across a context's items.

Item i draws its passage (or key and haystack start) from ``seed`` independently of the context, so the buckets are
paired: the same passages at every distance. A one-document source (``builtin:shakespeare``) is cut into pieces of
``PIECE_TOKENS`` tokens that stand in for documents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel

from trtkv.errors import TrtkvError

TASKS = ("ppl", "recall", "passkey")
LONG_TASKS = ("recall", "passkey")
PASSAGE_TOKENS = 256
DEFAULT_CONTEXTS = (1024, 2048, 4096)
DEFAULT_ITEMS = 8  # --windows of a long-context task when not given (items per context)
PIECE_TOKENS = 2048  # a one-document source is cut into pieces of this many tokens, standing in for documents
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER = " {key}"
WEAK_BASELINE = 0.5  # fp16 scoring below this at a context: the model itself does not retrieve there (said in a note)


def check_tasks(tasks: Sequence[str] | None) -> list[str]:
    """The tasks asked for, each once, in the order ppl, recall, passkey (default: ppl)."""
    asked = [t.strip().lower() for t in (tasks or ["ppl"])]
    for t in asked:
        if t not in TASKS:
            raise TrtkvError(f"unknown --task {t!r}", f"use one of: {', '.join(TASKS)} (repeat --task for several)")
    return [t for t in TASKS if t in asked]


def check_contexts(contexts: Sequence[int], max_context: int, model: str) -> list[int]:
    """``--context`` values, sorted and each once: positive and within the model's maximum context (when it has one)."""
    for c in contexts:
        if not isinstance(c, int) or c < 2:
            raise TrtkvError(f"--context must be an integer of at least 2 tokens, got {c!r}", "pass e.g. --context 1024 --context 4096")
        if max_context and c > max_context:
            raise TrtkvError(f"--context {c} is longer than {model}'s maximum context of {max_context} tokens",
                             f"pass --context {max_context} or less")
    return sorted(set(contexts))


def task_documents(docs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The documents tasks draw from: ``docs``, or a single document's pieces of ``PIECE_TOKENS`` tokens."""
    docs = [d for d in docs if d.numel()]
    if len(docs) != 1:
        return list(docs)
    return list(docs[0].split(PIECE_TOKENS))


def _t(ids: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.long)


def _joined(docs: Sequence[torch.Tensor], order: Sequence[int], sep: Sequence[int], tokens: int) -> torch.Tensor:
    """The first ``tokens`` tokens of ``docs`` taken in ``order``, joined with ``sep`` (the caller checked there are enough)."""
    parts, n = [], 0
    sep_t = _t(sep)
    for k, i in enumerate(order):
        if n >= tokens:
            break
        if k:
            parts.append(sep_t)
            n += sep_t.numel()
        parts.append(docs[i])
        n += docs[i].numel()
    out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return out[:tokens]


def _available(docs: Sequence[torch.Tensor], order: Sequence[int], sep: Sequence[int]) -> int:
    return sum(docs[i].numel() for i in order) + len(sep) * max(0, len(order) - 1)


# --------------------------------------------------------------------------- recall


@dataclass(frozen=True)
class RecallSet:
    """The recall items of one context: ``ids`` [items, context], the passage at ``first`` and its copy at ``second``."""

    ids: torch.Tensor
    first: int
    second: int
    passage_tokens: int
    documents: tuple[int, ...]  # the passage's document (index into the task documents) per item

    @property
    def context(self) -> int:
        return self.ids.shape[1]

    @property
    def distance(self) -> int:
        return self.second - self.first

    def positions(self) -> torch.Tensor:
        """Scored positions: those predicting tokens 2..L of the first copy, then of the second."""
        n = self.passage_tokens - 1
        return torch.cat([torch.arange(self.first, self.first + n), torch.arange(self.second, self.second + n)])


def recall_set(docs: Sequence[torch.Tensor], *, context: int, passage_tokens: int, items: int, seed: int, sep: Sequence[int],
               bos: int | None, source: str = "the dataset") -> RecallSet:
    """``items`` recall windows of exactly ``context`` tokens: [BOS] passage SEP filler SEP passage (see the module)."""
    L, head = passage_tokens, [] if bos is None else [int(bos)]
    if not isinstance(L, int) or L < 2:
        raise TrtkvError(f"--passage-tokens must be at least 2, got {L!r}", f"pass e.g. --passage-tokens {PASSAGE_TOKENS}")
    filler = context - len(head) - 2 * L - 2 * len(sep)
    if filler < 0:
        need = context - filler
        raise TrtkvError(f"--context {context} is too short for the recall task: two passages of {L} tokens, their separators"
                         f"{' and BOS' if head else ''} need {need}", f"pass --context {need} or more, or a smaller --passage-tokens")
    eligible = [i for i, d in enumerate(docs) if d.numel() >= L]
    if not eligible:
        longest = max((d.numel() for d in docs), default=0)
        raise TrtkvError(f"no document of the eval split of {source} has {L} tokens for a passage (the longest has {longest})",
                         f"pass --passage-tokens {max(2, longest)} or less, or use a dataset with longer documents")
    g = torch.Generator().manual_seed(int(seed))
    order = torch.randperm(len(eligible), generator=g).tolist()
    rows, chosen = [], []
    for i in range(items):  # every draw is independent of the context: item i is the same passage at every distance
        doc = eligible[order[i % len(eligible)]]
        offset = int(torch.randint(0, docs[doc].numel() - L + 1, (), generator=g))
        others = [j for j in range(len(docs)) if j != doc]
        start = int(torch.randint(0, max(1, len(others)), (), generator=g))
        others = others[start:] + others[:start]
        if _available(docs, others, sep) < filler:
            raise TrtkvError(f"the eval split of {source} holds {_available(docs, others, sep)} tokens outside a passage's document, "
                             f"fewer than the {filler} tokens of filler --context {context} needs",
                             "pass a smaller --context or use a dataset with more text")
        passage = docs[doc][offset : offset + L]
        rows.append(torch.cat([_t(head), passage, _t(sep), _joined(docs, others, sep, filler), _t(sep), passage]))
        chosen.append(doc)
    ids = torch.stack(rows)
    assert ids.shape[1] == context
    return RecallSet(ids=ids, first=len(head), second=context - L, passage_tokens=L, documents=tuple(chosen))


# --------------------------------------------------------------------------- passkey


@dataclass(frozen=True)
class PasskeySet:
    """The pass-key items of one context: ``ids`` [items, context] ending in the ``answer_tokens`` tokens of the key."""

    ids: torch.Tensor
    keys: tuple[str, ...]
    depths: tuple[float, ...]
    needle_at: tuple[int, ...]  # where each item's needle starts
    answer_tokens: int

    @property
    def context(self) -> int:
        return self.ids.shape[1]

    def positions(self) -> torch.Tensor:
        """Scored positions: those predicting the answer's tokens (the window's last ``answer_tokens``)."""
        return torch.arange(self.context - self.answer_tokens - 1, self.context - 1)


def passkey_set(docs: Sequence[torch.Tensor], encode: Callable[[str], list[int]], *, context: int, items: int, seed: int,
                sep: Sequence[int], bos: int | None, source: str = "the dataset") -> PasskeySet:
    """``items`` pass-key windows of exactly ``context`` tokens: [BOS] haystack[:at] needle haystack[at:] question answer."""
    head = [] if bos is None else [int(bos)]
    g = torch.Generator().manual_seed(int(seed))
    question = encode(QUESTION)
    keys: list[str] = []
    answer_len = None
    for _ in range(100 * items):  # every answer the same number of tokens, so the items share their scored positions
        if len(keys) == items:
            break
        key = str(int(torch.randint(10000, 100000, (), generator=g)))
        n = len(encode(ANSWER.format(key=key)))
        answer_len = n if answer_len is None else answer_len
        if n == answer_len:
            keys.append(key)
    if len(keys) < items:  # pragma: no cover - a tokenizer that merges digits into ever-changing pieces
        raise TrtkvError(f"this tokenizer writes 5-digit keys in varying numbers of tokens; {len(keys)} of {items} keys share one",
                         f"pass --windows {max(1, len(keys))} or less")
    rows, needles, depths = [], [], []
    for i, key in enumerate(keys):
        needle, answer = encode(NEEDLE.format(key=key)), encode(ANSWER.format(key=key))
        hay = context - len(head) - len(needle) - len(question) - len(answer)
        if hay < 0:
            need = context - hay
            raise TrtkvError(f"--context {context} is too short for the pass-key task: its needle, question and answer need {need} tokens",
                             f"pass --context {need} or more")
        start = int(torch.randint(0, len(docs), (), generator=g))
        order = list(range(start, len(docs))) + list(range(start))
        if _available(docs, order, sep) < hay:
            raise TrtkvError(f"the eval split of {source} holds {_available(docs, order, sep)} tokens, fewer than the {hay} tokens "
                             f"of haystack --context {context} needs", "pass a smaller --context or use a dataset with more text")
        text = _joined(docs, order, sep, hay)
        depth = i / (items - 1) if items > 1 else 0.5
        at = round(depth * hay)
        rows.append(torch.cat([_t(head), text[:at], _t(needle), text[at:], _t(question), _t(answer)]))
        needles.append(len(head) + at)
        depths.append(depth)
    ids = torch.stack(rows)
    assert ids.shape[1] == context
    return PasskeySet(ids=ids, keys=tuple(keys), depths=tuple(depths), needle_at=tuple(needles), answer_tokens=int(answer_len or 0))


def task_sets(tokenizer, dataset: str, tasks: Sequence[str], contexts: Sequence[int], *, items: int, seed: int = 0,
              text_field: str = "text", passage_tokens: int = PASSAGE_TOKENS) -> list[RecallSet | PasskeySet]:
    """Every item of ``tasks`` (recall / passkey) at each context, from the eval split of ``dataset`` (before any weights load)."""
    if not tasks:
        return []
    from trtkv.data import adds_bos, document_tokens, separator_ids

    docs = task_documents(document_tokens(tokenizer, dataset, "eval", text_field))
    sep, bos = separator_ids(tokenizer), (int(tokenizer.bos_token_id) if adds_bos(tokenizer) else None)
    encode = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])
    out: list[RecallSet | PasskeySet] = []
    for c in contexts:
        if "recall" in tasks:
            out.append(recall_set(docs, context=c, passage_tokens=passage_tokens, items=items, seed=seed, sep=sep, bos=bos, source=dataset))
        if "passkey" in tasks:
            out.append(passkey_set(docs, encode, context=c, items=items, seed=seed, sep=sep, bos=bos, source=dataset))
    return out


# --------------------------------------------------------------------------- results


class TaskResult(BaseModel):
    """One format at one context of a long-context task, against the unquantized model on the same items."""

    format: str
    spec: str
    task: str
    context: int  # tokens per window
    windows: int  # items
    pool_bits_per_element: float
    bits_per_element: float  # at this context, the open block included
    fp16_agreement: float  # share of scored positions whose top-1 is fp16's
    kld_mean: float  # KL(fp16 || format) over the scored positions, nats
    seconds: float = 0.0


class RecallResult(TaskResult):
    task: Literal["recall"] = "recall"
    distance: int  # tokens from a passage token to its copy
    passage_tokens: int
    recall_top1: float  # second copy: share of tokens 2..L whose top-1 is the true token
    fp16_recall_top1: float  # the same for fp16 on the same items
    second_copy_ppl: float
    first_copy_ppl: float  # the passage's first occurrence (nothing to recall): the reference


class PasskeyResult(TaskResult):
    task: Literal["passkey"] = "passkey"
    passkey_accuracy: float  # share of items whose whole answer is the top-1
    fp16_passkey_accuracy: float
    same_outcome_as_fp16: float  # share of items passed (or failed) alike by fp16 and this format
    depths: list[float] = []
    passed: list[bool] = []  # per item, in the order of ``depths``


def weak_baseline_notes(results: Sequence[TaskResult], model: str) -> list[str]:
    """One line per context where fp16 itself scores below ``WEAK_BASELINE``: the formats' scores there say little."""
    notes = []
    for r in results:
        if r.format != "fp16":
            continue
        if isinstance(r, PasskeyResult) and r.passkey_accuracy < WEAK_BASELINE:
            notes.append(f"fp16 {model} passes {round(r.passkey_accuracy * r.windows)}/{r.windows} pass-key items at {r.context} tokens: "
                         "the model does not retrieve the key there, so the formats' pass-key scores at that context say little")
        if isinstance(r, RecallResult) and r.recall_top1 < WEAK_BASELINE:
            notes.append(f"fp16 {model} recalls {100 * r.recall_top1:.0f} % of the passage at {r.context} tokens: "
                         "the model barely retrieves at that distance")
    return notes


# --------------------------------------------------------------------------- output


def recall_table_rows(results: Sequence[TaskResult]):
    """``(title, columns, rows)`` of the recall rows."""
    from trtkv.tables import Column

    rs = [r for r in results if isinstance(r, RecallResult)]
    title = (f"Recall at distance ({rs[0].windows} passages of {rs[0].passage_tokens} tokens per context; second copy's tokens 2..L)"
             if rs else "Recall at distance")
    columns = [Column("format", numeric=False), Column("context"), Column("distance"), Column("recall %"), Column("fp16 %"),
               Column("of fp16 %"), Column("agree %"), Column("copy ppl"), Column("1st ppl"), Column("KL")]
    rows = [[r.format, str(r.context), str(r.distance), f"{100 * r.recall_top1:.2f}", f"{100 * r.fp16_recall_top1:.2f}",
             f"{100 * r.recall_top1 / r.fp16_recall_top1:.1f}" if r.fp16_recall_top1 else "-", f"{100 * r.fp16_agreement:.2f}",
             f"{r.second_copy_ppl:.3f}", f"{r.first_copy_ppl:.2f}", f"{r.kld_mean:.5f}"] for r in rs]
    return title, columns, rows


def passkey_table_rows(results: Sequence[TaskResult]):
    """``(title, columns, rows)`` of the pass-key rows."""
    from trtkv.tables import Column

    rs = [r for r in results if isinstance(r, PasskeyResult)]
    title = f"Pass key ({rs[0].windows} items per context, needle depths 0..1)" if rs else "Pass key"
    columns = [Column("format", numeric=False), Column("context"), Column("passed"), Column("fp16 passed"), Column("same as fp16 %"),
               Column("agree %"), Column("KL")]
    rows = [[r.format, str(r.context), f"{round(r.passkey_accuracy * r.windows)}/{r.windows}",
             f"{round(r.fp16_passkey_accuracy * r.windows)}/{r.windows}", f"{100 * r.same_outcome_as_fp16:.0f}",
             f"{100 * r.fp16_agreement:.2f}", f"{r.kld_mean:.5f}"] for r in rs]
    return title, columns, rows


def plot(results: Sequence, path: Path | str, title: str = "") -> Path:
    """Draw recall by distance, pass-key score by context and KL by position (the panels whose rows exist), one line per
    format, to ``path`` (PNG). ``results``: any rows with a ``task`` (the perplexity task's are ``trtkv.evaluate``'s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    recall = [r for r in results if isinstance(r, RecallResult)]
    passkey = [r for r in results if isinstance(r, PasskeyResult)]
    ppl = [r for r in results if r.task == "ppl" and len(r.kld_by_position) > 1 and r.format != "fp16"]  # trtkv.evaluate.EvalResult
    if recall:
        panels.append(("recall top-1 % (second copy)", "distance (tokens)", [(r.format, r.distance, 100 * r.recall_top1) for r in recall], "linear"))
    if passkey:
        panels.append(("pass-key items passed %", "context (tokens)", [(r.format, r.context, 100 * r.passkey_accuracy) for r in passkey], "linear"))
    if ppl:
        points = []
        for r in ppl:  # at each bucket's end (a log axis has no 0): the context the bucket reaches
            starts = sorted(r.kld_by_position)
            points += [(r.format, b, r.kld_by_position[a]) for a, b in zip(starts, starts[1:] + [r.seq_len - 1])]
        panels.append(("mean KL from fp16 (nats)", "position (end of each bucket, tokens)", points, "log"))
    if not panels:
        raise TrtkvError("nothing to plot: --plot draws recall / pass-key rows and the perplexity task's error by position",
                         "add --task recall or --task passkey, or a --seq-len above 512 for the position buckets")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (ylabel, xlabel, points, yscale) in zip(axes[0], panels):
        for name in dict.fromkeys(p[0] for p in points):
            xy = sorted((x, y) for n, x, y in points if n == name)
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale(yscale)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if ppl:  # fp16 is 0 there; the log scale leaves it out
        axes[0][-1].set_title("fp16: 0", fontsize=8, loc="right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
