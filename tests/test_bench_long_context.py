"""bench/long_context.py's report: the table per task and length bucket, and each target met or missed by how much."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))
    import long_context

    yield long_context
    sys.path.remove(str(ROOT / "bench"))


def _recall(fmt, ctx, top1, base, agree=1.0):
    return {"format": fmt, "task": "recall", "context": ctx, "distance": ctx - 256, "windows": 3, "recall_top1": top1,
            "fp16_recall_top1": base, "fp16_agreement": agree}


def _ppl(fmt, kl0, kl1, kl2):
    return {"format": fmt, "task": "ppl", "seq_len": 1500, "kld_by_position": {0: kl0, 512: kl1, 1024: kl2}, "kld_p999": 0.1,
            "ppl_delta_pct": 0.5}


def _results(**kw):
    formats = ["fp16", "int8", "int4", "int2"]
    r = {"formats": formats, "decode_formats": ["fp16", "int4"], "accuracy": {
        "recall": [_recall("fp16", 1024, 0.9, 0.9), _recall("int8", 1024, 0.9, 0.9, agree=0.985), _recall("int4", 1024, 0.891, 0.9),
                   _recall("int4", 4096, 0.873, 0.9), _recall("int2", 4096, 0.86, 0.9)],
        "passkey": [{"format": f, "task": "passkey", "context": 1024, "windows": 4, "passkey_accuracy": a, "same_outcome_as_fp16": s}
                    for f, a, s in (("fp16", 0.5, 1.0), ("int8", 0.5, 1.0), ("int4", 0.25, 0.75))],
        "ppl": [_ppl("fp16", 0, 0, 0), _ppl("int8", 1e-4, 1.2e-4, 1.6e-4), _ppl("int4", 0.003, 0.005, 0.0075)]},
        "decode": [{"context": 1024, "fp16": {"tok_s": 10.0}, "int4": {"tok_s": 11.0}},
                   {"context": 8064, "fp16": {"tok_s": 4.0}, "int4": {"tok_s": 3.6}}]}
    r.update(kw)
    return r


def test_targets_say_what_is_met_and_by_how_much_a_miss_falls_short(bench):
    lines = bench.targets(_results())
    text = "\n".join(lines)
    # int8: KL 1.6x over the first bucket (target 1.5x) and 98.5 % same top-1 (target 99 %)
    assert "int8: mean KL at positions 1024-1498 is 1.60x that at 0-511 (target ≤ 1.5x): **missed** by 7%" in text
    assert "int8: recall equal to fp16's (same top-1 on ≥ 99 % of tokens) in every bucket: **missed**: recall at 1024: same top-1 as fp16 on 98.5 %" in text
    # int4: 99.0 % of fp16 at 1024 (met), 97.0 % at 4096 (short by 1.0 point); KL 2.5x (over by 25 %)
    assert "recall at 4096: 97.0 % of fp16 (target 98 %, short by 1.0 percentage points)" in text and "recall at 1024" not in text.split("int4:")[2]
    assert "int4: mean KL at positions 1024-1498 is 2.50x that at 0-511 (target ≤ 2.0x): **missed** by 25%" in text
    assert "int2: recall ≥ 95 % of fp16's in every bucket: met" in text  # 95.6 %
    assert "int4 decode ≥ 1.0x fp16 tok/s at every context: **missed** at 8064 (0.90x, short by 0.10); at 8064: 0.90x (aim 1.2x, not reached)" in text
    fine = _results(decode=[{"context": 1024, "fp16": {"tok_s": 10.0}, "int4": {"tok_s": 13.0}}])
    assert "int4 decode ≥ 1.0x fp16 tok/s at every context: met; at 1024: 1.30x (aim 1.2x)" in "\n".join(bench.targets(fine))


def test_the_table_has_a_row_per_task_bucket_and_metric_and_a_column_per_format(bench):
    lines = bench.table(_results())
    assert lines[0] == "| task | bucket | metric | fp16 | int8 | int4 | int2 |"
    assert "| recall | 4096 tokens (distance 3840) | top-1 % (of fp16) |  |  | 87.3 (97.0 %) | 86.0 (95.6 %) |" in lines
    assert "| pass key | 1024 tokens | items passed | 2/4 | 2/4 | 1/4 |  |" in lines
    assert "| KL by position | 512-1023 | mean KL | 0.00000 | 0.00012 | 0.00500 |  |" in lines
    md = bench.render({**_results(), "command": "c", "date": "d", "machine": "m", "windows": 3, "passkey_windows": 4, "ppl_windows": 1,
                       "ppl_seq_len": 1500, "batch": 8, "steps": 3, "reps": 3, "seconds": {}})
    assert "| 8064 | 4.0 | 3.6 | 0.90x |" in md and "## Reading it" not in md
    noted = bench.render({**_results(), "command": "c", "date": "d", "machine": "m", "windows": 3, "passkey_windows": 4, "ppl_windows": 1,
                          "ppl_seq_len": 1500, "batch": 8, "steps": 3, "reps": 3, "seconds": {}, "notes": "Why int4 missed at 4096."})
    assert noted.endswith("## Reading it\n\nWhy int4 missed at 4096.\n")


def test_notes_are_kept_in_the_json_and_rendered_after_the_tables(bench, tmp_path, monkeypatch):
    import json

    data = {**_results(), "command": "c", "date": "d", "machine": "m", "windows": 3, "passkey_windows": 4, "ppl_windows": 1,
            "ppl_seq_len": 1500, "batch": 8, "steps": 3, "reps": 3, "seconds": {}}
    (tmp_path / "r.json").write_text(json.dumps(data))
    (tmp_path / "notes.md").write_text("The 8k bucket is one passage.\n")
    monkeypatch.setattr(sys, "argv", ["long_context.py", "--render", str(tmp_path / "r.json"), "--notes", str(tmp_path / "notes.md")])
    bench.main()
    assert json.loads((tmp_path / "r.json").read_text())["notes"] == "The 8k bucket is one passage."
    monkeypatch.setattr(sys, "argv", ["long_context.py", "--render", str(tmp_path / "r.json")])  # a later render keeps them
    bench.main()
    assert (tmp_path / "r.md").read_text().endswith("## Reading it\n\nThe 8k bucket is one passage.\n")
