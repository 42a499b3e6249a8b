"""Layer streaming (trtkv.streaming): the same statistics and the same scores as the resident model, one layer held.

* calibration statistics, resident vs streamed, byte-identical (``stats.safetensors``'s tensors) on a tiny model of
  every family (sliding windows, soft-caps, fused qkv, q/k norms, tied embeddings);
* eval perplexity / KL / top-1, resident vs streamed, within 1e-6 relative, with formats that seal several blocks,
  keep sinks and store each layer its own way;
* the skeleton holds no layer weights between layers, and exactly one layer while one runs;
* the memory plan chooses streaming when the resident model would not fit, and the CLI's ``--stream always`` writes
  the same statistics as ``--stream never``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, calibration_free

from trtkv.calibration.budget import per_layer_format
from trtkv.calibration.stats import collect_stats
from trtkv.evaluate import evaluate_formats
from trtkv.formats import fit_formats
from trtkv.models import load_model
from trtkv.streaming import load_streamed

ARCHS = {"llama": ("llama", {}), **FAMILIES}


@pytest.fixture(autouse=True, scope="module")
def _threads(one_thread):
    yield


def _pair(tiny_models, name: str):
    arch, kw = ARCHS[name]
    d, _ = tiny_models(arch, **kw)
    return load_model(str(d), "cpu", "float32"), load_streamed(str(d), "cpu", "float32")


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_streamed_statistics_equal_the_resident_ones(tiny_models, name):
    resident, streamed = _pair(tiny_models, name)
    windows = torch.randint(0, 300, (5, 37), generator=torch.Generator().manual_seed(1))
    a = collect_stats(resident, windows, batch_size=2, progress=False, reservoir=40, seed=3).to_tensors()
    b = collect_stats(streamed, windows, batch_size=2, progress=False, reservoir=40, seed=3).to_tensors()
    assert a.keys() == b.keys()
    differ = [k for k in a if k != "meta.seconds" and not torch.equal(a[k], b[k])]
    assert differ == []
    assert a["reservoir.k"].shape[1] == 40  # the sample filled and then replaced rows across batches


def _formats(head_dim: int, num_layers: int):
    sealed, = fit_formats(["k=int4:bchannel:asym,v=int4:g8:asym,block=8,sink=2"], head_dim)[0]
    low = [f.with_block_size(8) for f in fit_formats(["int4", calibration_free("int2", head_dim)], head_dim)[0]]
    mixed = per_layer_format("mix", low, [{"k": i % 2, "v": (i + 1) % 2} for i in range(num_layers)])
    return ["int8", sealed, mixed]


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_streamed_eval_equals_the_resident_eval(tiny_models, name):
    resident, streamed = _pair(tiny_models, name)
    windows = torch.randint(0, 300, (3, 29), generator=torch.Generator().manual_seed(2))  # 3 sealed blocks + an open one
    fmts = _formats(resident.info.head_dim, resident.info.num_layers)
    a = evaluate_formats(resident.model, windows, fmts, batch_size=2, generate_prompts=0)
    b = evaluate_formats(streamed.model, windows, fmts, batch_size=2, generate_prompts=0, streamer=streamed.streamer)
    assert [r.format for r in a] == [r.format for r in b]
    assert a[2].kld_mean > 10 * a[1].kld_mean > 0  # the sealed int4 format really changed the logits (more than int8)
    for ra, rb in zip(a, b):
        assert rb.ppl == pytest.approx(ra.ppl, rel=1e-6)
        assert rb.kld_mean == pytest.approx(ra.kld_mean, rel=1e-6, abs=1e-12)
        assert rb.top1_agreement == ra.top1_agreement


def test_the_skeleton_holds_one_layer_at_a_time(tiny_models):
    d, _ = tiny_models("llama", num_hidden_layers=3)
    streamed = load_streamed(str(d), "cpu", "float32")
    layers = streamed.model.model.layers
    assert all(p.is_meta for p in layers.parameters())
    assert not streamed.model.model.embed_tokens.weight.is_meta
    held = []
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: held.append([j for j, lay in enumerate(layers)
                                                                         if not next(lay.parameters()).is_meta]))
    collect_stats(streamed, torch.randint(0, 300, (3, 11)), batch_size=2, progress=False)
    assert held == [[0], [0], [1], [1], [2], [2]]  # layer-major: both batches through layer i, then layer i+1
    assert all(p.is_meta for p in layers.parameters())
    # the per-layer reads add up to the layers' weights (each read once)
    layer_bytes = sum(p.numel() * 4 for p in layers.parameters())
    outside = sum(p.numel() * 4 for n, p in streamed.model.named_parameters() if not n.startswith("model.layers.") and not p.is_meta)
    assert streamed.streamer.read_bytes == layer_bytes + outside


def test_auto_streams_when_the_resident_model_does_not_fit(tiny_models, monkeypatch, tmp_path):
    from trtkv import memory
    from trtkv.calibration.run import run_calibration

    d, _ = tiny_models("llama", with_tokenizer=True, num_hidden_layers=4)
    info = load_model(str(d), "cpu", "float32").info
    resident = memory.plan_memory(info, torch.device("cpu"), torch.float32, streamed=False, activations=0)
    streamed = memory.plan_memory(info, torch.device("cpu"), torch.float32, streamed=True, activations=0)
    assert streamed.weights < resident.weights
    # a budget between the two plans (the activations the command adds are the same in both): only streaming fits
    monkeypatch.setenv(memory.LIMIT_ENV, str((resident.total + streamed.total) // 2))
    out = run_calibration(str(d), "builtin:pydoc", tmp_path / "cal", formats=["int8-static"], samples=2, seq_len=16,
                          progress=False, reservoir=8)
    from trtkv.artifacts import load_calibration

    assert load_calibration(out).recipe.options["streamed"] is True
    monkeypatch.setenv(memory.LIMIT_ENV, str(resident.total * 4))
    out2 = run_calibration(str(d), "builtin:pydoc", tmp_path / "cal2", formats=["int8-static"], samples=2, seq_len=16,
                           progress=False, reservoir=8)
    assert load_calibration(out2).recipe.options["streamed"] is False


@pytest.mark.slow
def test_cli_stream_always_writes_the_resident_statistics(tiny_models, tmp_path):
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from trtkv.cli import app

    d, _ = tiny_models("qwen3", with_tokenizer=True, head_dim=128)
    stats = {}
    for mode in ("always", "never"):
        out = tmp_path / mode
        r = CliRunner().invoke(app, ["calibrate", "--model", str(d), "--dataset", "builtin:pydoc", "--kv", "int8-static",
                                     "--samples", "3", "--seq-len", "24", "--batch-size", "2", "--stream", mode, "--out", str(out)])
        assert r.exit_code == 0, r.output
        stats[mode] = load_file(str(out / "stats.safetensors"))
    assert all(torch.equal(stats["always"][k], stats["never"][k]) for k in stats["never"] if k != "meta.seconds")


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_streamed_eval_equals_resident(builtin_model):
    from trtkv.data import token_windows

    windows = token_windows(builtin_model.tokenizer, "builtin:pydoc", seq_len=160, samples=2, seed=0, split="eval")
    fmts = fit_formats(["int8", "int4"], builtin_model.info.head_dim)[0]
    a = evaluate_formats(builtin_model.model, windows, fmts, batch_size=2, generate_prompts=0)
    streamed = load_streamed("smollm2-135m", "cpu", "float32")
    b = evaluate_formats(streamed.model, windows, fmts, batch_size=2, generate_prompts=0, streamer=streamed.streamer)
    for ra, rb in zip(a, b):
        assert rb.ppl == pytest.approx(ra.ppl, rel=1e-6)
        assert rb.kld_mean == pytest.approx(ra.kld_mean, rel=1e-6, abs=1e-12)
    assert a[-1].kld_mean > 1e-4  # int4 sealed 2 blocks of each window


def test_load_planned_says_its_first_line_only_after_the_plan(tiny_models, monkeypatch):
    """The one loader of calibrate and eval: the plan first (a refusal prints nothing else), then the command's own
    first line and the plan's note, then the model resident or streamed as the plan says."""
    import io

    from rich.console import Console

    from trtkv import memory
    from trtkv.errors import TrtkvError
    from trtkv.models import model_info
    from trtkv.streaming import load_planned

    d, _ = tiny_models("llama", with_tokenizer=True, num_hidden_layers=4)
    info = model_info(str(d))
    resident = memory.plan_memory(info, torch.device("cpu"), torch.float32, streamed=False, activations=0)
    streamed = memory.plan_memory(info, torch.device("cpu"), torch.float32, streamed=True, activations=0)

    def load(command: str, limit: int, **kw):
        monkeypatch.setenv(memory.LIMIT_ENV, str(limit))
        out = io.StringIO()
        kw = {"device": "cpu", "dtype": "auto", "stream": "auto", "can_stream": True, **kw}
        loaded = load_planned(str(d), info, None, command=command, windows=(3, 16), activations=0,
                              console=Console(file=out, width=400), **kw)
        return loaded, out.getvalue().splitlines()

    loaded, lines = load("eval", resident.total * 4)
    assert loaded.streamer is None and lines[0].startswith(f"eval {info.name}: ") and lines[0].endswith("; 3 windows of 16 tokens")
    loaded, lines = load("calibrate", (resident.total + streamed.total) // 2)
    assert loaded.streamer is not None and lines[0].startswith(f"calibrate {info.name}: ")
    assert lines[1].startswith("note: calibrate: loading the weights in float32, streamed layer by layer")
    out = io.StringIO()
    monkeypatch.setenv(memory.LIMIT_ENV, "1MiB")
    with pytest.raises(TrtkvError, match="eval does not fit in memory"):
        load_planned(str(d), info, None, command="eval", windows=(3, 16), activations=0, device="cpu", dtype="auto",
                     stream="auto", can_stream=True, console=Console(file=out))
    assert out.getvalue() == ""  # refused before the first line


def test_calibrate_budget_refuses_stream_always_before_the_weights(tiny_models, tmp_path, monkeypatch):
    from trtkv import streaming
    from trtkv.calibration.run import run_calibration
    from trtkv.errors import TrtkvError

    d, _ = tiny_models("qwen3", with_tokenizer=True, head_dim=128)  # the default --budget-formats fit head_dim 128
    monkeypatch.setattr(streaming, "load_planned", lambda *a, **k: pytest.fail("the weights were planned for"))
    with pytest.raises(TrtkvError, match="--budget measures each layer's choice on the whole model"):
        run_calibration(str(d), "builtin:pydoc", tmp_path / "cal", formats=["int8-static"], samples=2, seq_len=16,
                        progress=False, reservoir=8, budget="kl=0.01", stream="always")
