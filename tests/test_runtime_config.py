"""``RuntimeConfig``: one typed definition of the serving settings.

Its JSON round trip, its one-line validation errors, the repository's ``runtime_config.json`` as the python model
reads it (a hand-corrupted file included), and the CLI options generated from its fields (the defaults the help
shows are the ones the commands use).
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import types
from typing import get_args

import pytest
from typer.testing import CliRunner

from trtkv.errors import TrtkvError
from trtkv.runtime.config import RuntimeConfig
from trtkv.triton_repo.repository import RUNTIME_CONFIG, RepoOptions, instance_runtime, parse_config, write_repository

# A value unlike the default for every field (the round trip must carry each one; a new field must be added here).
CHANGED = {
    "kv_memory_gib": 0.37,
    "reserve": 0.25,
    "max_seqs": 7,
    "max_batched_tokens": 33,
    "backend": "torch",
    "attention": "torch",
    "cpu_threads": 3,
    "device": "cpu",
    "enable_prefix_caching": False,
    "free_window_blocks": False,
    "deterministic": True,
}


def test_changed_covers_every_field_and_differs_from_its_default():
    assert set(CHANGED) == set(RuntimeConfig.model_fields)
    default = RuntimeConfig()
    for name, value in CHANGED.items():
        assert getattr(default, name) != value, name


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_json_round_trip_carries_each_field(name, tmp_path):
    config = RuntimeConfig(**{name: CHANGED[name]})
    path = tmp_path / RUNTIME_CONFIG
    path.write_text(config.dump_json())
    back = RuntimeConfig.load(path)
    assert getattr(back, name) == CHANGED[name] and back == config
    assert json.loads(path.read_text())[name] == CHANGED[name]  # plain JSON values, not "1" / repr(float) strings


def test_json_round_trip_of_every_field_at_once(tmp_path):
    config = RuntimeConfig(**CHANGED)
    path = tmp_path / RUNTIME_CONFIG
    path.write_text(config.dump_json())
    assert json.loads(path.read_text()) == CHANGED
    assert RuntimeConfig.model_validate_json(path.read_text()).model_dump() == CHANGED


def test_every_engine_backend_is_accepted():
    """The backends are the manifest's (plus auto), not a list restated here or in the config."""
    from trtkv.manifest import Backend

    for backend in ("auto", *get_args(Backend)):
        assert RuntimeConfig(backend=backend).backend == backend


@pytest.mark.parametrize("name, bad, flag", [
    ("max_seqs", 0, "--max-seqs"),
    ("max_batched_tokens", 0, "--max-batched-tokens"),
    ("kv_memory_gib", 0.0, "--kv-memory"),
    ("kv_memory_gib", -1.0, "--kv-memory"),
    ("reserve", -0.1, "--reserve"),
    ("reserve", 1.0, "--reserve"),
    ("backend", "trt", "--backend"),
    ("cpu_threads", 0, "--cpu-threads"),
    ("device", "tpu", None),
    ("max_seqs", "8", "--max-seqs"),  # strict: the old config.pbtxt strings are refused, not coerced
    ("enable_prefix_caching", "1", "--prefix-cache"),
    ("free_window_blocks", 0, "--free-window-blocks"),
    ("max_seq", 8, None),  # a typo is an error, not ignored
])
def test_a_bad_value_is_one_line_naming_the_field(name, bad, flag):
    with pytest.raises(TrtkvError) as info:
        RuntimeConfig(**{name: bad})
    msg = str(info.value)
    assert "\n" not in msg and f"{name}" in msg and repr(bad) in msg
    assert (flag is None) or flag in msg


def test_the_ranges_include_their_bounds():
    assert RuntimeConfig(reserve=0.0).reserve == 0.0  # [0, 1)
    assert RuntimeConfig(max_seqs=1, max_batched_tokens=1).max_seqs == 1


def test_replace_validates_its_changes():
    with pytest.raises(TrtkvError, match="max_seqs"):
        RuntimeConfig().replace(max_seqs=0)
    assert RuntimeConfig().replace(max_seqs=3).max_seqs == 3


def test_cpu_budget_default_lives_in_the_config():
    import torch

    from trtkv.runtime.llm_engine import resolve_kv_budget

    gib = 1024**3
    assert resolve_kv_budget(RuntimeConfig(), torch.device("cpu")) == int(RuntimeConfig.CPU_KV_MEMORY_GIB * gib)
    assert resolve_kv_budget(RuntimeConfig(kv_memory_gib=0.125), torch.device("cpu")) == gib // 8
    assert RuntimeConfig().kv_memory(gpu=True) is None and RuntimeConfig().kv_memory(gpu=False) == RuntimeConfig.CPU_KV_MEMORY_GIB


# ---------------------------------------------------------------- the repository's file and the python model


def _fake_engine(tmp_path):
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "manifest.json").write_text("{}")
    return eng


@pytest.fixture
def python_model(monkeypatch):
    """``trtkv.triton_repo.python_model`` imported over a stand-in ``triton_python_backend_utils`` (the real one
    exists only inside tritonserver); its Logger records what it is given."""
    logged = []
    stub = types.ModuleType("triton_python_backend_utils")
    stub.Logger = types.SimpleNamespace(**{f"log_{k}": (lambda msg, k=k: logged.append((k, msg))) for k in ("info", "warn", "error")})
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    monkeypatch.delitem(sys.modules, "trtkv.triton_repo.python_model", raising=False)
    module = importlib.import_module("trtkv.triton_repo.python_model")
    monkeypatch.setitem(sys.modules, "trtkv.triton_repo.python_model", module)  # removed again afterwards
    module.logged = logged
    return module


def _triton_args(repo):
    """``initialize``'s args as tritonserver gives them: the model config as JSON, the model directory, the version."""
    from google.protobuf import json_format

    cfg = json_format.MessageToJson(parse_config(repo / "ensemble" / "config.pbtxt"), preserving_proto_field_name=True)
    return {"model_config": cfg, "model_repository": str(repo / "ensemble"), "model_version": "1"}


class _Loaded(Exception):
    pass


def test_python_model_runs_with_the_config_the_repository_wrote(python_model, tmp_path, monkeypatch):
    from trtkv.runtime.llm_engine import LLMEngine

    opts = RepoOptions(runtime=RuntimeConfig(**{**CHANGED, "device": "auto"}), instance_kind="cpu", instances=2)
    repo = write_repository(_fake_engine(tmp_path), tmp_path / "repo", opts)
    seen = {}

    def from_engine_dir(engine_dir, config):
        seen.update(engine_dir=engine_dir, config=config)
        raise _Loaded

    monkeypatch.setattr(LLMEngine, "from_engine_dir", staticmethod(from_engine_dir))
    with pytest.raises(_Loaded):
        python_model.TritonPythonModel().initialize(_triton_args(repo))
    assert seen["config"] == instance_runtime(opts, "cpu")  # half the budget each, device cpu, the rest as given
    assert seen["config"].kv_memory_gib == pytest.approx(CHANGED["kv_memory_gib"] / 2)
    assert seen["engine_dir"] == (tmp_path / "engine").resolve()


@pytest.mark.parametrize("edit, field", [
    (lambda d: {**d, "max_seqs": 0}, "max_seqs"),
    (lambda d: {**d, "max_seqs": "8"}, "max_seqs"),
    (lambda d: {**d, "enable_prefix_caching": "0"}, "enable_prefix_caching"),
    (lambda d: {**d, "backend": "tensorrt-llm"}, "backend"),
    (lambda d: {**d, "reserve": 2}, "reserve"),
    (lambda d: {**d, "max_batched_tokns": 64}, "max_batched_tokns"),
    (lambda d: json.dumps(d)[:-3], "Invalid JSON"),
])
def test_python_model_refuses_a_hand_corrupted_file_in_one_line(python_model, tmp_path, monkeypatch, edit, field):
    from trtkv.runtime.llm_engine import LLMEngine

    repo = write_repository(_fake_engine(tmp_path), tmp_path / "repo", RepoOptions(instance_kind="cpu"))
    path = repo / "ensemble" / "1" / RUNTIME_CONFIG
    edited = edit(json.loads(path.read_text()))
    path.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    monkeypatch.setattr(LLMEngine, "from_engine_dir", staticmethod(lambda *a: pytest.fail("the engine loaded with a bad config")))
    with pytest.raises(TrtkvError) as info:
        python_model.TritonPythonModel().initialize(_triton_args(repo))
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and field in msg
    assert python_model.logged == [("error", f"trtkv: {msg}")]  # the same line in the server log


def test_python_model_without_the_file_names_it(python_model, tmp_path):
    repo = write_repository(_fake_engine(tmp_path), tmp_path / "repo", RepoOptions(instance_kind="cpu"))
    path = repo / "ensemble" / "1" / RUNTIME_CONFIG
    path.unlink()
    with pytest.raises(TrtkvError, match=re.escape(str(path))):
        python_model.TritonPythonModel().initialize(_triton_args(repo))


# ---------------------------------------------------------------- the CLI options generated from the fields

runner = CliRunner()


def _help(command: str) -> str:
    from trtkv.cli import app

    out = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"}, terminal_width=400)
    assert out.exit_code == 0, out.output
    return " ".join(out.output.replace("│", " ").split())


def _option_help(text: str, flag: str) -> str:
    """The help of option ``flag`` (from the flag to the end of its ``[default: ...]``)."""
    start = re.search(rf"(^| ){re.escape(flag)} ", text).start()
    return text[start: text.index("]", text.index("[default:", start)) + 1]


def _config_generate_opens(monkeypatch) -> dict:
    """``seen["config"]``: the RuntimeConfig ``generate --engine`` hands the engine (which then stops the command)."""
    from trtkv.runtime.llm_engine import LLMEngine

    seen = {}

    def from_engine_dir(engine_dir, config):
        seen["config"] = config
        raise TrtkvError("stop here")

    monkeypatch.setattr(LLMEngine, "from_engine_dir", staticmethod(from_engine_dir))
    return seen


def test_generate_help_shows_the_kv_memory_generate_uses(tmp_path, monkeypatch):
    from trtkv.cli import app
    from trtkv.triton_repo.cli import GENERATE_CONFIG

    seen = _config_generate_opens(monkeypatch)
    out = runner.invoke(app, ["generate", "hi", "--engine", str(tmp_path)])
    assert out.exit_code == 2 and "stop here" in out.output
    used = seen["config"]
    assert used == GENERATE_CONFIG and used.kv_memory_gib != RuntimeConfig().kv_memory_gib  # its own, named default
    assert f"[default: {used.kv_memory_gib}]" in _option_help(_help("generate"), "--kv-memory")
    assert f"[default: {used.backend}]" in _option_help(_help("generate"), "--backend")


def test_generate_options_reach_its_config(tmp_path, monkeypatch):
    from trtkv.cli import app

    seen = _config_generate_opens(monkeypatch)
    runner.invoke(app, ["generate", "hi", "--engine", str(tmp_path), "--kv-memory", "0.125", "--backend", "onnxruntime"])
    assert (seen["config"].kv_memory_gib, seen["config"].backend) == (0.125, "onnxruntime")
    out = runner.invoke(app, ["generate", "hi", "--engine", str(tmp_path), "--kv-memory", "-1"])
    assert out.exit_code == 2 and "--kv-memory" in out.output and len(out.output.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["serve", "triton-repo"])
def test_serve_help_shows_the_config_defaults_and_the_real_backends(command):
    from trtkv.manifest import Backend

    text = _help(command)
    default = RuntimeConfig()
    for name, flag in [("reserve", "--reserve"), ("max_batched_tokens", "--max-batched-tokens"), ("backend", "--backend")]:
        assert f"[default: {getattr(default, name)}]" in _option_help(text, flag), flag
    assert default.max_seqs is None and "[default: (the engine's --max-batch)]" in _option_help(text, "--max-seqs")
    assert "[default: prefix-cache]" in _option_help(text, "--prefix-cache")  # typer names the default side of a flag
    assert f"{RuntimeConfig.CPU_KV_MEMORY_GIB:g} GiB on CPU" in _option_help(text, "--kv-memory")
    backend_help = _option_help(text, "--backend")
    for backend in ("auto", *get_args(Backend)):
        assert re.search(rf"(^|[ :|]){re.escape(backend)}( |$)", backend_help), backend


def test_cli_refuses_a_bad_runtime_option_in_one_line_naming_the_flag():
    from trtkv.triton_repo.cli import REPO_OPTIONS, _repo_options

    defaults = {name: default for name, _, default in REPO_OPTIONS}
    with pytest.raises(TrtkvError, match="--max-batched-tokens") as info:
        _repo_options(**{**defaults, "max_batched_tokens": 0})
    assert "\n" not in str(info.value)
    with pytest.raises(TrtkvError, match="--instances"):
        _repo_options(**{**defaults, "instances": 0})


@pytest.mark.slow
def test_triton_repo_cli_writes_the_json_and_no_runtime_strings(tiny_model, tmp_path):
    """``trtkv triton-repo`` (the repository code ``trtkv serve`` runs): the options land in runtime_config.json,
    config.pbtxt holds only what tritonserver reads and the engine directory."""
    from trtkv.builder.build import build_engine
    from trtkv.cli import app

    model_dir, _ = tiny_model("mistral", with_tokenizer=True)
    engine = build_engine(str(model_dir), None, "int8", tmp_path / "eng", backend="torch", block_size=16, max_batch=2, max_seq_len=64)
    out = runner.invoke(app, ["triton-repo", str(engine), "--out", str(tmp_path / "repo"), "--instance-kind", "cpu", "--instances", "2",
                              "--kv-memory", "0.5", "--max-seqs", "7", "--max-batched-tokens", "33", "--backend", "torch", "--no-prefix-cache",
                              "--keep-window-blocks", "--reserve", "0.25", "--cpu-threads", "3", "--deterministic",
                              "--attention", "torch"])
    assert out.exit_code == 0, out.output
    assert "warning: --max-seqs 7 is above the engine's batch limit (build-engine --max-batch 2)" in " ".join(out.output.split())
    got = RuntimeConfig.load(tmp_path / "repo" / "ensemble" / "1" / RUNTIME_CONFIG)
    assert got == RuntimeConfig(**{**CHANGED, "kv_memory_gib": 0.25})  # the 0.5 GiB split between 2 instances
    pbtxt = (tmp_path / "repo" / "ensemble" / "config.pbtxt").read_text()
    assert {k: v.string_value for k, v in parse_config(tmp_path / "repo" / "ensemble" / "config.pbtxt").parameters.items()} == {
        "engine_dir": str(engine.resolve())}
    for name in RuntimeConfig.model_fields:
        assert f'key: "{name}"' not in pbtxt, name
    assert 'string_value: "1"' not in pbtxt and 'string_value: "0"' not in pbtxt


def test_every_backend_refusal_names_every_backend(tmp_path):
    """build-engine and open_engine refuse an unknown backend naming exactly the list --backend takes."""
    from trtkv.builder.build import build_engine
    from trtkv.engine_backends import RUNTIME_BACKENDS
    from trtkv.runtime.backends import open_engine

    class _Manifest:
        backend, plans = "onnxruntime", []

    with pytest.raises(TrtkvError) as a:
        open_engine(tmp_path, backend="tensorrt_llm", manifest=_Manifest())
    with pytest.raises(TrtkvError) as b:
        build_engine("smollm2-135m", None, "int4", tmp_path / "x", backend="tensorrt_llm")
    for e in (a.value, b.value):
        assert "tensorrt_llm" in e.problem and e.fix == f"use one of {', '.join(RUNTIME_BACKENDS)}"


@pytest.mark.parametrize("command", ["generate", "serve", "triton-repo"])
def test_a_commands_own_options_keep_their_flags_and_help_beside_the_generated_ones(command):
    """The generated options join the command's own: those keep their short flags and help (typer would read a
    string annotation as a bare option named after the parameter)."""
    import inspect

    from trtkv.cli import app

    text = _help(command)
    fn = {"generate": "generate", "serve": "serve", "triton-repo": "triton_repo"}[command]
    commands = {c.callback.__name__: c.callback for c in app.registered_commands}
    for p in inspect.signature(commands[fn]).parameters.values():
        meta = getattr(p.annotation, "__metadata__", None)
        assert meta is not None, (command, p.name)  # every parameter carries its typer.Option / Argument
        info = meta[0]
        for flag in [d for d in (info.param_decls or ()) if d.startswith("-")]:
            assert re.search(rf"(^|[\s,]){re.escape(flag)}(\s|,|$)", text, re.M), (command, flag)
    if command == "generate":
        assert "-n" in _option_help(text, "--max-tokens")


@pytest.mark.parametrize("command", [None, "serve", "build-engine", "calibrate", "generate"])
def test_flags_print_no_type(command):
    """A flag takes no value: typer's rich help prints no type for it (``<bool>``), while an option that takes one keeps its type."""
    from trtkv.cli import app

    out = runner.invoke(app, [command, "--help"] if command else ["--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}, terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "<bool>" not in out.output and "--help" in out.output
    assert command is None or "<int>" in out.output or "<str>" in out.output
