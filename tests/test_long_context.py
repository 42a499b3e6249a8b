"""The long-context tasks of ``trtkv eval`` (recall at distance, pass key) and the perplexity task's error by position:
task construction on synthetic documents, metrics against naive float64 loops over full logits, JSON / table fields, the
command's errors, and one real-model run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from trtkv import evaluate as E
from trtkv import long_context as lc
from trtkv.errors import TrtkvError
from trtkv.formats import get_format

SEP = [7]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: one thread is faster than an OpenMP pool on a shared machine."""


def _docs(lengths, base=1000):
    """Document k holds tokens base*(k+1) .. base*(k+1)+len-1, so a token says which document it came from."""
    return [torch.arange(base * (k + 1), base * (k + 1) + n) for k, n in enumerate(lengths)]


def _owner(tok: int, base=1000) -> int:
    return tok // base - 1


# --------------------------------------------------------------------------- recall construction


@pytest.mark.parametrize("context,bos", [(301, None), (517, 3), (2 * 37 + 2, None)])
def test_recall_windows_repeat_the_passage_at_the_stated_distance_with_filler_from_other_documents(context, bos):
    docs = _docs([90, 41, 300, 17, 233, 150])
    L = 37
    s = lc.recall_set(docs, context=context, passage_tokens=L, items=5, seed=2, sep=SEP, bos=bos)
    head = 0 if bos is None else 1
    assert s.ids.shape == (5, context)
    assert s.first == head and s.second == context - L and s.distance == context - L - head
    for i, row in enumerate(s.ids.tolist()):
        if bos is not None:
            assert row[0] == bos
        first, second = row[s.first : s.first + L], row[s.second : s.second + L]
        assert first == second  # the passage really repeats, `distance` tokens later
        doc = s.documents[i]
        assert {_owner(t) for t in first} == {doc}
        start = first[0] - docs[doc][0].item()
        assert first == docs[doc][start : start + L].tolist()  # a contiguous slice of its document
        assert row[s.first + L] == SEP[0] and row[s.second - 1] == SEP[0]
        filler = row[s.first + L + 1 : s.second - 1]
        assert len(filler) == context - head - 2 * L - 2
        assert all(t == SEP[0] or _owner(t) != doc for t in filler)  # filler never comes from the passage's document
        # filler is whole documents in order, joined with the separator (the last one cut)
        pieces = [p for p in " ".join(map(str, filler)).split(f" {SEP[0]} ") if p] if filler else []
        for p in pieces[:-1]:
            toks = [int(t) for t in p.split()]
            assert toks == docs[_owner(toks[0])].tolist()
    # the positions scored: tokens 2..L of each copy
    pos = s.positions()
    assert pos.numel() == 2 * (L - 1)
    assert torch.equal(s.ids[:, pos[L - 1 :] + 1], s.ids[:, s.second + 1 : s.second + L])
    assert torch.equal(s.ids[:, pos[: L - 1] + 1], s.ids[:, s.first + 1 : s.first + L])


def test_recall_items_are_the_same_passages_at_every_context():
    docs = _docs([90, 41, 300, 17, 233, 150, 400, 600])
    a = lc.recall_set(docs, context=200, passage_tokens=30, items=4, seed=5, sep=SEP, bos=None)
    b = lc.recall_set(docs, context=900, passage_tokens=30, items=4, seed=5, sep=SEP, bos=None)
    assert a.documents == b.documents
    assert torch.equal(a.ids[:, :30], b.ids[:, :30])
    c = lc.recall_set(docs, context=900, passage_tokens=30, items=4, seed=6, sep=SEP, bos=None)
    assert not torch.equal(c.ids, b.ids)


def test_recall_errors_name_the_fix():
    docs = _docs([90, 41, 300])
    with pytest.raises(TrtkvError, match=r"too short for the recall task.*need 62.*--context 62 or more, or a smaller --passage-tokens"):
        lc.recall_set(docs, context=61, passage_tokens=30, items=1, seed=0, sep=SEP, bos=None)
    with pytest.raises(TrtkvError, match=r"has 400 tokens.*the longest has 300.*--passage-tokens 300 or less"):
        lc.recall_set(docs, context=2000, passage_tokens=400, items=1, seed=0, sep=SEP, bos=None)
    with pytest.raises(TrtkvError, match="fewer than the .* tokens of filler --context 5000 needs.*smaller --context"):
        lc.recall_set(docs, context=5000, passage_tokens=30, items=1, seed=0, sep=SEP, bos=None)
    with pytest.raises(TrtkvError, match="--passage-tokens must be at least 2"):
        lc.recall_set(docs, context=100, passage_tokens=1, items=1, seed=0, sep=SEP, bos=None)


def test_a_one_document_source_is_cut_into_pieces():
    one = [torch.arange(lc.PIECE_TOKENS * 2 + 5)]
    pieces = lc.task_documents(one)
    assert [p.numel() for p in pieces] == [lc.PIECE_TOKENS, lc.PIECE_TOKENS, 5]
    assert torch.equal(torch.cat(pieces), one[0])
    many = _docs([3, 4])
    assert lc.task_documents(many) == many


# --------------------------------------------------------------------------- passkey construction


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # one token per character: keys of 5 digits are 6 answer tokens


@pytest.mark.parametrize("items", [1, 5])
def test_passkey_windows_hide_the_key_at_each_depth_and_end_with_the_answer(items):
    docs = _docs([400, 333, 250])
    ctx = 601
    s = lc.passkey_set(docs, _encode, context=ctx, items=items, seed=1, sep=SEP, bos=2)
    assert s.ids.shape == (items, ctx) and s.answer_tokens == 6
    question = _encode(lc.QUESTION)
    for i, row in enumerate(s.ids.tolist()):
        key = s.keys[i]
        needle = _encode(lc.NEEDLE.format(key=key))
        assert row[0] == 2
        assert row[s.needle_at[i] : s.needle_at[i] + len(needle)] == needle
        assert row[-6:] == _encode(" " + key)
        assert row[-6 - len(question) : -6] == question
        hay = ctx - 1 - len(needle) - len(question) - 6
        assert s.needle_at[i] - 1 == round(s.depths[i] * hay)
        haystack = row[1 : s.needle_at[i]] + row[s.needle_at[i] + len(needle) : ctx - 6 - len(question)]
        assert len(haystack) == hay and all(t == SEP[0] or t >= 1000 for t in haystack)  # dataset text only
    if items == 5:
        assert s.depths == (0.0, 0.25, 0.5, 0.75, 1.0)
        assert s.needle_at[0] == 1  # depth 0: right after BOS
    assert torch.equal(s.ids[:, s.positions() + 1], s.ids[:, -6:])
    with pytest.raises(TrtkvError, match=r"too short for the pass-key task.*--context \d+ or more"):
        lc.passkey_set(docs, _encode, context=60, items=1, seed=1, sep=SEP, bos=None)


# --------------------------------------------------------------------------- metrics


def test_position_buckets_and_percentiles_match_numpy_and_naive_loops():
    g = torch.Generator().manual_seed(3)
    assert E.position_buckets(511) == [0]
    assert E.position_buckets(513) == [0, 512]
    assert E.position_buckets(4097) == [0, 512, 1024, 2048, 4096]
    vals = torch.rand(3, 1301, generator=g) ** 4
    got = E.by_position(vals, lambda x: x.double().mean().item())
    assert list(got) == [0, 512, 1024]
    for a, b in ((0, 512), (512, 1024), (1024, 1301)):
        naive = sum(vals[w, p].item() for w in range(3) for p in range(a, b)) / (3 * (b - a))
        assert got[a] == pytest.approx(naive, rel=1e-9)
    for q in (0.99, 0.999):
        assert E.quantile(vals, q) == pytest.approx(np.quantile(vals.double().numpy(), q), rel=1e-12)
    p999 = E.by_position(vals, lambda x: E.quantile(x, 0.999))
    assert p999[512] == pytest.approx(np.quantile(vals[:, 512:1024].double().numpy(), 0.999), rel=1e-12)
    assert E.quantile(torch.zeros(0), 0.999) == 0.0


def test_position_scores_match_naive_float64_per_position(monkeypatch):
    monkeypatch.setattr(E, "METRIC_ROWS", 16)
    g = torch.Generator().manual_seed(4)
    ref = torch.randn(2, 2 * E.METRIC_ROWS + 7, 29, generator=g) * 2  # more positions than one metric chunk
    cur = ref + torch.randn(ref.shape, generator=g)
    t = torch.randint(0, 29, ref.shape[:2], generator=g)
    sc = E.PositionScores(3, ref.shape[1] + 5)
    sc.add(1, slice(5, 5 + ref.shape[1]), ref, cur, t)
    kl, nll, agree = [], [], []
    for r, c, tt in zip(ref.double().reshape(-1, 29), cur.double().reshape(-1, 29), t.reshape(-1).tolist()):  # float64, one position at a time
        p, q = torch.softmax(r, 0).tolist(), torch.softmax(c, 0).tolist()
        kl.append(sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q)))
        nll.append(-math.log(q[tt]))
        agree.append(float(max(range(29), key=p.__getitem__) == max(range(29), key=q.__getitem__)))
    kl, nll, agree = (torch.tensor(x, dtype=torch.float64) for x in (kl, nll, agree))
    torch.testing.assert_close(sc.kld[1:, 5:].reshape(-1).double(), kl, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(sc.nll[1:, 5:].reshape(-1).double(), nll, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sc.agree[1:, 5:].reshape(-1).double(), agree)
    correct = (cur.argmax(-1) == t).double().reshape(-1)
    torch.testing.assert_close(sc.correct[1:, 5:].reshape(-1).double(), correct)
    assert 0 < correct.mean() < 1 and sc.kld[0].abs().sum() == 0 and sc.kld[1:, :5].abs().sum() == 0


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)[1]


@pytest.mark.parametrize("spec", ["fp16", "k=int8:token:sym,v=int8:token:sym", "k=int4:bchannel:asym,v=int4:token:asym,block=8,sink=2"])
def test_kept_logits_are_the_full_prefill_at_the_scored_positions(tiny, monkeypatch, spec):
    monkeypatch.setattr(E, "PREFILL_CHUNK", 13)  # formats without sealed blocks are prefilled in chunks: same cache, same logits
    fmt = get_format(spec)
    ids = torch.randint(0, 320, (2, 61), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 3, 8, 9, 15, 16, 40, 59])
    with torch.inference_mode():
        full = E.model_logits(tiny, ids, fmt)
        parts = list(E.kept_logits(tiny, ids, fmt, None, positions))
    got = torch.cat([x for _, x in parts], dim=1)
    assert [c.stop for c, _ in parts][-1] == positions.numel()
    torch.testing.assert_close(got, full[:, positions], rtol=1e-5, atol=2e-5)


def test_ppl_error_by_position_is_the_naive_per_position_kl(tiny):
    spec = "k=int2:token:asym,v=int2:token:asym,block=16"  # coarse: KL well above float32's rounding of it
    windows = torch.randint(0, 320, (2, 600), generator=torch.Generator().manual_seed(1))
    base, q = E.evaluate_formats(tiny, windows, [spec], batch_size=1, generate_prompts=0)
    with torch.inference_mode():
        ref = E.model_logits(tiny, windows, "fp16")[:, :-1]
        cur = E.model_logits(tiny, windows, spec)[:, :-1]
    kl = E.kl_divergence(ref.double(), cur.double())  # [2, 599]
    agree = (ref.argmax(-1) == cur.argmax(-1)).double()
    assert list(q.kld_by_position) == [0, 512]
    for a, b in ((0, 512), (512, 599)):
        assert q.kld_by_position[a] == pytest.approx(kl[:, a:b].mean().item(), rel=1e-3, abs=1e-7)
        assert q.kld_p999_by_position[a] == pytest.approx(np.quantile(kl[:, a:b].numpy(), 0.999), rel=1e-3, abs=1e-7)
        assert q.top1_by_position[a] == pytest.approx(agree[:, a:b].mean().item(), abs=1e-9)
    assert q.kld_p999 == pytest.approx(np.quantile(kl.numpy(), 0.999), rel=1e-3)
    assert q.kld_mean == pytest.approx(kl.mean().item(), rel=1e-3)
    assert q.kld_by_position[512] > 1e-5 and q.kld_p999 > q.kld_mean
    assert base.kld_by_position == {0: 0.0, 512: 0.0} and base.top1_by_position == {0: 1.0, 512: 1.0}


def test_recall_and_passkey_scores_are_the_naive_ones_over_full_logits(tiny):
    docs = [torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)) for n in (150, 90, 210, 77)]
    spec = "k=int4:token:asym,v=int4:token:asym,block=8"
    fmts = [get_format("fp16"), get_format(spec)]
    rs = lc.recall_set(docs, context=171, passage_tokens=23, items=3, seed=0, sep=[0], bos=None)
    encode = lambda text: [ord(c) % 320 for c in text]
    ps = lc.passkey_set(docs, encode, context=120, items=3, seed=0, sep=[0], bos=None)
    rows = E.evaluate_tasks(tiny, [rs, ps], fmts, {}, head_dim=16, batch_size=2)
    assert [(r.task, r.format) for r in rows] == [("recall", "fp16"), ("recall", spec), ("passkey", "fp16"), ("passkey", spec)]
    rec_base, rec, pk_base, pk = rows
    with torch.inference_mode():
        full = {f.name: E.model_logits(tiny, rs.ids, f) for f in fmts}
        pk_full = {f.name: E.model_logits(tiny, ps.ids, f) for f in fmts}
    second = torch.arange(rs.second, rs.second + 22)
    for row, name in ((rec_base, "fp16"), (rec, spec)):
        lg = full[name][:, second]
        truth = rs.ids[:, second + 1]
        assert row.recall_top1 == pytest.approx((lg.argmax(-1) == truth).double().mean().item())
        assert row.fp16_recall_top1 == rec_base.recall_top1
        assert row.second_copy_ppl == pytest.approx(math.exp(E.token_nll(lg, truth).double().mean().item()), rel=1e-4)
        first = torch.arange(rs.first, rs.first + 22)
        assert row.first_copy_ppl == pytest.approx(math.exp(E.token_nll(full[name][:, first], rs.ids[:, first + 1]).double().mean().item()), rel=1e-4)
        assert row.fp16_agreement == pytest.approx((lg.argmax(-1) == full["fp16"][:, second].argmax(-1)).double().mean().item())
        assert row.distance == 171 - 23 and row.context == 171 and row.windows == 3
    assert rec_base.fp16_agreement == 1.0 and rec_base.kld_mean == 0.0 and rec.kld_mean > 0
    answer = torch.arange(120 - ps.answer_tokens - 1, 119)
    passed = {n: (pk_full[n][:, answer].argmax(-1) == ps.ids[:, answer + 1]).all(-1) for n in pk_full}
    assert pk.passed == passed[spec].tolist() and pk_base.passed == passed["fp16"].tolist()
    assert pk.passkey_accuracy == pytest.approx(passed[spec].double().mean().item())
    assert pk.fp16_passkey_accuracy == pk_base.passkey_accuracy
    assert pk.same_outcome_as_fp16 == pytest.approx((passed[spec] == passed["fp16"]).double().mean().item())
    assert pk.depths == [0.0, 0.5, 1.0]


# --------------------------------------------------------------------------- output


def _recall_row(fmt: str, ctx: int, top1: float, base: float) -> lc.RecallResult:
    return lc.RecallResult(format=fmt, spec=fmt, context=ctx, windows=4, pool_bits_per_element=4.5, bits_per_element=5.0,
                           fp16_agreement=0.97, kld_mean=0.004, distance=ctx - 256, passage_tokens=256, recall_top1=top1,
                           fp16_recall_top1=base, second_copy_ppl=1.4, first_copy_ppl=18.0)


def test_json_rows_tables_and_plot(tmp_path):
    ppl = E.EvalResult(format="int4", spec="s", bits_per_element=5, pool_bits_per_element=4.5, kv_bytes_per_token=1, ppl=10, ppl_delta_pct=0.3,
                       kld_mean=0.004, top1_agreement=0.97, kld_p999=0.2, kld_by_position={0: 0.003, 512: 0.005},
                       kld_p999_by_position={0: 0.1, 512: 0.3}, top1_by_position={0: 0.98, 512: 0.96}, windows=2, seq_len=1024)
    rec = [_recall_row("fp16", 1024, 0.9, 0.9), _recall_row("int4", 1024, 0.88, 0.9), _recall_row("fp16", 4096, 0.75, 0.75),
           _recall_row("int4", 4096, 0.6, 0.75)]
    pk = lc.PasskeyResult(format="int4", spec="s", context=1024, windows=4, pool_bits_per_element=4.5, bits_per_element=5.0,
                          fp16_agreement=1.0, kld_mean=0.001, passkey_accuracy=0.5, fp16_passkey_accuracy=0.25,
                          same_outcome_as_fp16=0.75, depths=[0, 1 / 3, 2 / 3, 1], passed=[True, False, True, False])
    path = E.write_json([ppl, *rec, pk], tmp_path / "r.json")
    data = json.loads(path.read_text())["results"]
    assert data[0]["task"] == "ppl" and data[0]["kld_by_position"] == {"0": 0.003, "512": 0.005} and data[0]["kld_p999"] == 0.2
    assert E.EvalResult.model_validate(data[0]) == ppl  # bucket keys come back as ints
    assert {k: data[2][k] for k in ("format", "task", "distance", "recall_top1")} == {"format": "int4", "task": "recall", "distance": 768,
                                                                                    "recall_top1": 0.88}
    assert data[5]["task"] == "passkey" and data[5]["passkey_accuracy"] == 0.5
    _, cols, rows = lc.recall_table_rows([ppl, *rec, pk])
    assert [c.header for c in cols][:4] == ["format", "context", "distance", "recall %"]
    assert rows[1][:6] == ["int4", "1024", "768", "88.00", "90.00", "97.8"]
    _, _, rows = lc.passkey_table_rows([pk])
    assert rows == [["int4", "1024", "2/4", "1/4", "75", "100.00", "0.00100"]]
    _, _, rows = E.position_table_rows([ppl])
    assert [r[:3] for r in rows] == [["int4", "0-511", "0.00300"], ["int4", "512-1022", "0.00500"], ["int4", "all", "0.00400"]]
    assert lc.weak_baseline_notes([pk, lc.PasskeyResult(**{**pk.model_dump(), "format": "fp16", "passkey_accuracy": 0.25})], "m") == [
        "fp16 m passes 1/4 pass-key items at 1024 tokens: the model does not retrieve the key there, so the formats' pass-key scores at that context say little"]
    png = lc.plot([ppl, *rec, pk], tmp_path / "p" / "plot.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TrtkvError, match="nothing to plot"):
        lc.plot([E.EvalResult(**{**ppl.model_dump(), "kld_by_position": {0: 0.1}})], tmp_path / "x.png")


# --------------------------------------------------------------------------- the command


runner = CliRunner()


@pytest.fixture
def no_weights(monkeypatch):
    import trtkv.models

    def boom(*a, **k):  # pragma: no cover - must not be reached
        raise AssertionError("weights loaded before the cheap checks")

    monkeypatch.setattr(trtkv.models, "load_model", boom)


def test_command_errors_come_before_the_weights(tiny_models, tmp_path, no_weights):
    from trtkv.cli import app

    model_dir = str(tiny_models("llama", with_tokenizer=True, head_dim=32)[0])  # max_position_embeddings 256
    cases = [
        (["--task", "recall", "--context", "300"], "--context 300 is longer than", "pass --context 256 or less"),
        (["--task", "bogus"], "unknown --task 'bogus'", "use one of: ppl, recall, passkey"),
        (["--context", "128"], "--context sets the windows of --task recall / passkey", "use --seq-len"),
        (["--passage-tokens", "16"], "--passage-tokens sets the recall task's passage", "add --task recall"),
        (["--task", "recall", "--context", "256", "--passage-tokens", "300"], "two passages of 300 tokens", "smaller --passage-tokens"),
        (["--task", "recall", "--stream", "always"], "needs the resident model", "drop --stream always"),
        (["--task", "recall", "--windows", "0"], "--windows must be a positive integer", "--windows 8"),
        (["--task", "recall", "--plot", str(tmp_path)], "--plot", "is a directory"),
    ]
    for args, problem, fix in cases:
        res = runner.invoke(app, ["eval", "--model", model_dir, "--device", "cpu", *args])
        assert res.exit_code == 2, (args, res.output)
        assert problem in res.output and fix in res.output, (args, res.output)


@pytest.mark.slow
def test_command_runs_recall_and_passkey_on_a_tiny_model(tiny_models, tmp_path):
    from trtkv.cli import app

    model_dir = str(tiny_models("llama", with_tokenizer=True, head_dim=32)[0])
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    res = runner.invoke(app, ["eval", "--model", model_dir, "--device", "cpu", "--task", "recall", "--task", "passkey", "--task", "ppl",
                              "--context", "96", "--context", "160", "--passage-tokens", "24", "--windows", "2", "--seq-len", "64",
                              "--kv", "int8", "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    rows = data["results"]
    assert [(r["task"], r["format"], r.get("context")) for r in rows] == [
        ("ppl", "fp16", None), ("ppl", "int8", None),
        ("recall", "fp16", 96), ("recall", "fp16", 160), ("recall", "int8", 96), ("recall", "int8", 160),
        ("passkey", "fp16", 96), ("passkey", "fp16", 160), ("passkey", "int8", 96), ("passkey", "int8", 160)]
    assert data["meta"]["tasks"] == ["ppl", "recall", "passkey"] and data["meta"]["contexts"] == [96, 160]
    assert "Recall at distance" in res.output and "Pass key" in res.output and png.exists()
    res = runner.invoke(app, ["eval", "--model", model_dir, "--device", "cpu", "--task", "passkey", "--context", "20"])
    assert res.exit_code == 2 and "too short for the pass-key task" in res.output and "pass --context" in res.output


@pytest.mark.model
@pytest.mark.slow
def test_recall_on_the_real_model_at_a_short_context(builtin_model, monkeypatch):
    import trtkv.models

    monkeypatch.setattr(trtkv.models, "load_model", lambda *a, **k: builtin_model)
    rows = E.run_eval("smollm2-135m", "builtin:pydoc", ["int8"], tasks=["recall"], contexts=[512], passage_tokens=128, windows=2,
                      device="cpu", dtype="float32", progress=False)
    base, i8 = rows
    assert base.format == "fp16" and base.distance == 384 and base.windows == 2
    assert base.recall_top1 > 0.7 and base.second_copy_ppl < base.first_copy_ppl / 3  # SmolLM2 copies the passage
    assert abs(i8.recall_top1 - base.recall_top1) <= 0.02 and i8.fp16_agreement > 0.95
