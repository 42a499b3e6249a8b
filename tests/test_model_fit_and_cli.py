"""Formats fitted to any head_dim, cheap checks before the weights, readable tables,
traceable eval JSON, error texts that name the right fix, plots for small models, CLI details."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from trtkv.cli import app
from trtkv.errors import TrtkvError
from trtkv.formats import PRESETS, TensorFormat, fit_format, fit_formats, get_format

runner = CliRunner()
FAST = ["--samples", "2", "--seq-len", "32", "--device", "cpu", "--dtype", "float32"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trtkv.cli", *args], capture_output=True, text=True, timeout=300)


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if model weights are loaded: cheap checks must come first."""
    import trtkv.models

    def boom(*a, **k):
        raise AssertionError("weights loaded before the cheap checks")

    monkeypatch.setattr(trtkv.models, "load_model", boom)


# ----------------------------------------------------------------------------- fitting formats to head_dim


@pytest.mark.parametrize("head_dim,group,blocks", [(32, 32, None), (48, 48, 16), (80, 40, 16), (96, 48, 32), (128, 64, None), (256, 64, None)])
def test_int4_preset_fits_every_real_head_dim(head_dim, group, blocks):
    # the sealed int4 preset: keys per channel per block fit any head_dim; values' groups of 32 are fitted
    fitted, note = fit_format(PRESETS["int4"], head_dim)
    assert fitted.k == PRESETS["int4"].k and head_dim % fitted.v.group_size == 0 and fitted.v.group_size <= 32
    assert (note is None) == (head_dim % 32 == 0 and blocks is None)
    assert blocks is None or f"Hadamard blocks of {blocks}" in note
    # a grouped format (the former int4 recipe) gets a group size that divides head_dim
    fmt, note = fit_format(get_format("k=int4:g64:asym:smooth:hadamard,v=int4:g64:asym:hadamard"), head_dim)
    assert fmt.k.group_size == fmt.v.group_size == group and head_dim % group == 0
    assert fmt.k.groups(head_dim) == head_dim // group  # no longer raises
    if group != 64:
        assert f"g64->g{group}" in note
    if blocks:
        assert f"Hadamard blocks of {blocks}" in note
    if group == 64 and not blocks:
        assert note is None


def test_defaults_that_cannot_fit_are_skipped_with_a_note_requested_ones_are_errors():
    fmts, notes = fit_formats(["int8", "int4"], 7, optional=True)
    assert [f.name for f in fmts] == ["int8"] and len(notes) == 1 and "skipped int4" in notes[0] and "even head_dim" in notes[0]
    with pytest.raises(TrtkvError, match="even head_dim"):
        fit_formats(["int4"], 7)
    with pytest.raises(TrtkvError, match="group size 64 does not divide the model's head_dim 48") as ei:
        fit_formats(["k=int4:g64,v=int4:g64"], 48)  # written out by the user: not silently changed
    assert "g48" in ei.value.fix


TINY = [("llama", 32), ("qwen2", 32), ("llama", 48), ("qwen2", 48), ("llama", 80), ("qwen2", 80)]


@pytest.mark.slow
@pytest.mark.parametrize("arch,head_dim", TINY, ids=[f"{a}-hd{d}" for a, d in TINY])
def test_calibrate_and_plan_default_formats_on_any_head_dim(tiny_model, tmp_path, arch, head_dim):
    model_dir, _ = tiny_model(arch, with_tokenizer=True, head_dim=head_dim)
    res = runner.invoke(app, ["plan", "--model", str(model_dir)])
    assert res.exit_code == 0, res.output
    assert "| int4 |" in res.output
    out = tmp_path / "cal"
    res = runner.invoke(app, ["calibrate", "--model", str(model_dir), "--out", str(out), *FAST])
    assert res.exit_code == 0, res.output
    recipe = json.loads((out / "recipe.json").read_text())
    assert set(recipe["formats"]) == {"int8-static", "fp8", "int4"}
    int4 = recipe["formats"]["int4"]["definition"]
    for side in ("k", "v"):  # every group (if any) divides head_dim
        assert TensorFormat(**int4[side]).groups(head_dim) * (int4[side]["group_size"] or head_dim) == head_dim or not int4[side]["group_size"]
    if head_dim & (head_dim - 1):  # not a power of two: the rotation uses smaller Hadamard blocks, said in the output
        assert "note: int4 at head_dim" in res.output


@pytest.mark.slow
def test_calibrate_only_the_formats_asked_for(tiny_model, tmp_path):
    model_dir, _ = tiny_model("llama", with_tokenizer=True, head_dim=32)
    out = tmp_path / "cal"
    res = runner.invoke(app, ["calibrate", "--model", str(model_dir), "--out", str(out), "--kv", "fp8", *FAST])
    assert res.exit_code == 0, res.output
    assert set(json.loads((out / "recipe.json").read_text())["formats"]) == {"fp8"}


# ----------------------------------------------------------------------------- cheap checks first


def test_a_preset_that_needs_a_calibration_is_one_line_naming_the_command(tiny_models, tmp_path, no_weights):
    """``trtkv eval --kv int3`` (and build-engine, and int2 / fp8 / int8-static) without --calibration: exit 2, one
    line naming what the format calibrates and the ``trtkv calibrate`` command that makes it, before any weights load;
    a retired preset name: one line naming its replacement."""
    model_dir, _ = tiny_models("llama", with_tokenizer=True, head_dim=32)
    cases = [
        (["eval", "--kv", "int3"], ["KV format int3 needs a calibration (K channel bits, V codebooks)", "run `trtkv calibrate", "--kv int3"]),
        (["eval", "--kv", "int4", "--kv", "int2", "--kv", "fp8"], ["int2, fp8 need a calibration", "--kv int2 --kv fp8"]),
        (["build-engine", "--kv", "int2", "--backend", "torch", "--out", str(tmp_path / "e")], ["int2 needs a calibration", "`trtkv calibrate"]),
        (["eval", "--kv", "int3-alloc"], ["'int3-alloc' was retired", "use 'int3' instead"]),
        (["eval", "--kv", "int4-token"], ["'int4-token' was retired", "'k=int4:token:asym:smooth:hadamard,v=int4:token:asym:hadamard'"]),
    ]
    for args, needles in cases:
        res = runner.invoke(app, [*args, "--model", str(model_dir)])
        assert res.exit_code == 2, (args, res.output)
        lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), (args, res.output)
        assert all(n in lines[0] for n in needles), (args, res.output)
    assert not (tmp_path / "e").exists()


@pytest.mark.slow
def test_cheap_checks_come_before_the_weights(tiny_model, tmp_path, no_weights):
    model_dir, _ = tiny_model("qwen2", with_tokenizer=True, head_dim=48)
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    cases = [
        (["calibrate", "--out", str(a_file)], "exists and is not a directory"),
        (["calibrate", "--out", str(tmp_path / "o"), "--kv", "k=int4:g64,v=int4:g64"], "does not divide the model's head_dim 48"),
        (["calibrate", "--out", str(tmp_path / "o"), "--samples", "99999", "--seq-len", "32"], "fewer than --samples 99999"),
        (["eval", "--windows", "99999", "--seq-len", "32"], "fewer than --windows 99999"),
        (["eval", "--windows", "99999", "--kv", "int8", "--seq-len", "32"], "fewer than --windows 99999"),
        (["eval", "--kv", "k=int4:g64,v=int8:token"], "does not divide the model's head_dim 48"),
    ]
    for args, needle in cases:
        res = runner.invoke(app, [*args, "--model", str(model_dir), "--device", "cpu"])
        assert res.exit_code == 2, (args, res.output)
        assert needle in res.output, (args, res.output)
    res = runner.invoke(app, ["eval", "--windows", "99999", "--seq-len", "32", "--model", str(model_dir)])
    assert "lower --windows to at most" in res.output and "--samples" not in res.output


@pytest.mark.slow
def test_model_without_tokenizer_names_the_flag_and_tokenizer_flag_works(tiny_model, tmp_path):
    bare, _ = tiny_model("llama", head_dim=32)  # no tokenizer files
    with_tok, _ = tiny_model("llama", with_tokenizer=True, head_dim=32)
    proc = _cli("calibrate", "--model", str(bare), "--out", str(tmp_path / "x"), *FAST)
    _one_line_error(proc, "has no tokenizer files", "--tokenizer DIR")
    assert not (tmp_path / "x").exists()
    out = tmp_path / "cal"
    res = runner.invoke(app, ["calibrate", "--model", str(bare), "--tokenizer", str(with_tok), "--kv", "int8-static", "--out", str(out), *FAST])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["calibrate", "--model", str(bare), "--tokenizer", str(tmp_path), "--out", str(out), *FAST])
    assert res.exit_code == 2 and "--tokenizer" in res.output


def test_loading_weights_shows_no_transformers_progress_bar(tiny_model, capfd):
    from trtkv.models import load_model

    model_dir, _ = tiny_model("llama", with_tokenizer=True, head_dim=32)
    capfd.readouterr()
    load_model(str(model_dir), device="cpu", dtype="float32")
    captured = capfd.readouterr()
    assert "Loading weights" not in captured.err + captured.out


# ----------------------------------------------------------------------------- eval: meta, other models, tables


@pytest.mark.slow
def test_eval_json_meta_model_from_calibration_and_other_model(tiny_model, tmp_path):
    model_dir, _ = tiny_model("qwen2", with_tokenizer=True, head_dim=48)
    other_dir, _ = tiny_model("qwen2", with_tokenizer=True, head_dim=48, seed=1)  # same shape, other weights
    cal = tmp_path / "cal"
    res = runner.invoke(app, ["calibrate", "--model", str(model_dir), "--out", str(cal), "--kv", "int4", "--kv", "fp8", *FAST])
    assert res.exit_code == 0, res.output
    out = tmp_path / "eval.json"
    args = ["eval", "--calibration", str(cal), "--kv", "int4", "--kv", "fp8", "--windows", "2", "--seq-len", "32",
            "--generate", "0", "--device", "cpu", "--dtype", "float32", "--seed", "3"]
    res = runner.invoke(app, [*args, "--json", str(out)])  # no --model: the calibration's
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    meta = data["meta"]
    from trtkv import __version__
    from trtkv.artifacts import calibration_sha256
    from trtkv.models import model_info

    assert meta["model"] == str(model_dir) and meta["model_sha256"] == model_info(str(model_dir)).sha256
    assert meta["dataset"] == "builtin:pydoc" and meta["split"] == "eval" and len(meta["dataset_sha256"]) == 64
    assert meta["calibration"] == str(cal) and meta["calibration_sha256"] == calibration_sha256(cal)
    assert (meta["seq_len"], meta["windows"], meta["seed"], meta["device"], meta["dtype"]) == (32, 2, 3, "cpu", "float32")
    assert meta["trtkv_version"] == __version__
    assert fit_format(get_format(meta["formats"]["int4"]), 48)[0] is not None  # the format evaluated fits head_dim 48
    # the table is plain Markdown when stdout is not a terminal: full numbers and names, nothing cut
    rows = {line.split("|")[1].strip(): line for line in res.output.splitlines() if line.startswith("| ")}
    assert {"fp16", "int4", "fp8"} <= set(rows) and "…" not in res.output
    ppl = next(r for r in data["results"] if r["format"] == "int4")["ppl"]
    assert f"{ppl:.4f}" in rows["int4"]

    res = runner.invoke(app, [*args, "--model", str(other_dir)])
    assert res.exit_code == 2 and "--allow-other-model" in res.output and "allow_other_model" not in res.output
    res = runner.invoke(app, [*args, "--model", str(other_dir), "--allow-other-model"])
    assert res.exit_code == 0, res.output


def _results(ppl: float = 48187.123456):
    from trtkv.evaluate import EvalResult

    long = "k=int4:bchannel:asym,v=int4:token:asym:hadamard,block=64"
    return [
        EvalResult(format=name, spec=name, bits_per_element=b, pool_bits_per_element=4.5 if name == long else b,
                   kv_bytes_per_token=kb, ppl=ppl, ppl_delta_pct=12.345, kld_mean=0.04383, top1_agreement=1.0,
                   generation_match=1.0, windows=2, seq_len=32)
        for name, b, kb in [("fp16", 16, 23040), ("int8-static", 8, 11520), (long, 7.375, 12345)]
    ]


@pytest.mark.parametrize("ppl", [15.654, 48187.123456])
def test_tables_never_cut_numbers_or_names_in_80_columns(ppl):
    from rich.console import Console

    from trtkv.evaluate import table_rows
    from trtkv.tables import print_table

    title, columns, rows = table_rows(_results(ppl))
    buf = io.StringIO()
    print_table(Console(file=buf, width=80, force_terminal=True, color_system=None), columns, rows, title)
    text = buf.getvalue()
    buf = io.StringIO()
    print_table(Console(file=buf, width=80, force_terminal=False), columns, rows, title)  # a log: Markdown
    assert f"| {rows[2][0]} | 4.5 | 7.375 |" in buf.getvalue() and "100.00" in buf.getvalue()
    assert "…" not in text
    for row in rows:
        for cell in row[1:]:
            assert cell in text, (cell, text)  # numbers on one line, whole
    if "\n|" in text:  # too wide for 80 columns with every number whole: Markdown, one row per line
        assert f"| {rows[2][0]} |" in text
        return
    assert max(len(line) for line in text.splitlines()) <= 80, text
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(rows[2][0][:8]))
    width = lines[i].index(" ")  # the folded name column: its pieces are the heads of the following lines
    pieces = [lines[i][:width]] + [line[:width].strip() for line in lines[i + 1:] if line[:width].strip()]
    assert "".join(pieces) == rows[2][0], pieces  # the long name folded, nothing lost
    for h in ("top-1 %", "gen %", "bits"):
        assert h in text


def test_plan_names_the_assumed_gpu_and_keeps_specs_whole():
    spec = "k=int4:g64:asym:smooth:hadamard,v=int4:token:asym"
    res = runner.invoke(app, ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--kv", spec])
    assert res.exit_code == 0, res.output
    assert "H100-80GB (assumed; pass --gpu" in res.output and f"| {spec} |" in res.output
    res = runner.invoke(app, ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--gpu", "A100-40GB"])
    assert "assumed" not in res.output and "A100-40GB" in res.output


# ----------------------------------------------------------------------------- CLI details


@pytest.mark.slow
def test_version_and_debug_after_the_subcommand():
    from trtkv import __version__

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"trtkv {__version__}"
    proc = _cli("plan", "--kv", "int5", "--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr
    _one_line_error(_cli("plan", "--kv", "k=int8:token", "--layers", "1", "--kv-heads", "1", "--head-dim", "8"), "missing v=")


# ----------------------------------------------------------------------------- plots for small models


def test_plots_for_a_two_layer_model_integer_ticks_linear_narrow_axes_distinct_colours():
    import matplotlib

    matplotlib.use("Agg")
    from trtkv.calibration.report import figure_absmax, figure_clipping

    class Stats:  # the two methods figure_absmax reads
        num_layers = 2

        def absmax(self, kind, granularity):
            return torch.tensor({"k": [3.0, 4.0], "k_pre": [2.5, 4.5], "v": [1.0, 1.5]}[kind])

    fig = figure_absmax(Stats())
    ax = fig.axes[0]
    assert ax.get_yscale() == "linear"  # 1.0 .. 4.5: less than a decade
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks

    ratios = {f"fmt{i}": {"k": [0.9, 0.95], "v": [0.8, 0.85]} for i in range(8)}
    fig = figure_clipping(ratios, 2)
    ax = fig.axes[0]
    colours = {}
    for line in ax.get_lines():
        colours.setdefault(line.get_label().rsplit(" ", 1)[0], set()).add(matplotlib.colors.to_hex(line.get_color()))
    assert len(colours) == 8 and all(len(c) == 1 for c in colours.values())  # K and V of a format share a colour
    assert len({next(iter(c)) for c in colours.values()}) == 8  # one colour per format
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert all(float(t).is_integer() for t in ticks), ticks


class _WideStats:
    num_layers = 2

    def absmax(self, kind, granularity):
        return torch.tensor({"k": [3.0, 400.0], "k_pre": [2.5, 450.0], "v": [1.0, 1.5]}[kind])


def test_absmax_plot_keeps_log_axis_over_decades():
    from trtkv.calibration.report import figure_absmax

    assert figure_absmax(_WideStats()).axes[0].get_yscale() == "log"


# ----------------------------------------------------------------------------- docs


@pytest.mark.slow
def test_preset_table_in_docs_is_generated_from_presets():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "docs" / "gen_preset_table.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
