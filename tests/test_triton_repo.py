"""The generated repository and request parsing, without a server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trtkv.errors import TrtkvError
from trtkv.runtime.config import RuntimeConfig
from trtkv.triton_repo.inputs import parse_request
from trtkv.triton_repo.interface import INPUTS, OUTPUTS
from trtkv.triton_repo.repository import RUNTIME_CONFIG, RepoOptions, instance_runtime, llm_config, parse_config, write_repository

# TensorRT-LLM's ensemble (tensorrtllm_backend all_models/inflight_batcher_llm/ensemble/config.pbtxt): the
# inputs and outputs a client of it relies on, with their types and dims.
TRTLLM_ENSEMBLE = {
    "text_input": ("TYPE_STRING", [1], False),
    "max_tokens": ("TYPE_INT32", [1], False),
    "bad_words": ("TYPE_STRING", [-1], True),
    "stop_words": ("TYPE_STRING", [-1], True),
    "exclude_input_in_output": ("TYPE_BOOL", [1], True),
    "end_id": ("TYPE_INT32", [1], True),
    "pad_id": ("TYPE_INT32", [1], True),
    "top_k": ("TYPE_INT32", [1], True),
    "top_p": ("TYPE_FP32", [1], True),
    "temperature": ("TYPE_FP32", [1], True),
    "length_penalty": ("TYPE_FP32", [1], True),
    "repetition_penalty": ("TYPE_FP32", [1], True),
    "min_length": ("TYPE_INT32", [1], True),
    "presence_penalty": ("TYPE_FP32", [1], True),
    "frequency_penalty": ("TYPE_FP32", [1], True),
    "random_seed": ("TYPE_UINT64", [1], True),
    "return_log_probs": ("TYPE_BOOL", [1], True),
    "beam_width": ("TYPE_INT32", [1], True),
    "stream": ("TYPE_BOOL", [1], True),
}
TRTLLM_OUTPUTS = {"text_output": ("TYPE_STRING", [-1]), "cum_log_probs": ("TYPE_FP32", [-1]), "output_log_probs": ("TYPE_FP32", [-1, -1])}


def _dtype_name(pb2, value: int) -> str:
    return pb2.DataType.Name(value)


def test_public_model_parses_and_matches_tensorrt_llm_ensemble(tmp_path):
    """The public model ``ensemble`` is the python model itself (cancellation reaches it)."""
    from trtkv.triton_repo.repository import load_model_config_pb2

    pb2 = load_model_config_pb2()
    (tmp_path / "c.pbtxt").write_text(llm_config("/engines/e", RepoOptions(), "cpu"))
    cfg = parse_config(tmp_path / "c.pbtxt")
    assert cfg.name == "ensemble" and cfg.backend == "python" and cfg.max_batch_size == 64 and not cfg.ensemble_scheduling.step
    got = {i.name: (_dtype_name(pb2, i.data_type), list(i.dims), i.optional) for i in cfg.input}
    for name, want in TRTLLM_ENSEMBLE.items():
        assert got[name] == want, name
    assert got["seed"] == ("TYPE_UINT64", [1], True) and got["min_tokens"] == ("TYPE_INT32", [1], True)
    outs = {o.name: (_dtype_name(pb2, o.data_type), list(o.dims)) for o in cfg.output}
    assert outs == TRTLLM_OUTPUTS
    assert [i.name for i in cfg.input] == [t.name for t in INPUTS] and [o.name for o in cfg.output] == [t.name for t in OUTPUTS]


@pytest.mark.parametrize("kind,want", [("cpu", "KIND_CPU"), ("gpu", "KIND_GPU")])
def test_llm_config_is_decoupled_python_with_instance_kind(tmp_path, kind, want):
    (tmp_path / "c.pbtxt").write_text(llm_config("/engines/e", RepoOptions(runtime=RuntimeConfig(kv_memory_gib=0.5, max_seqs=8)), kind))
    cfg = parse_config(tmp_path / "c.pbtxt")
    assert cfg.backend == "python" and cfg.model_transaction_policy.decoupled
    assert [type(cfg.instance_group[0]).Kind.Name(cfg.instance_group[0].kind)] == [want]
    assert {k: v.string_value for k, v in cfg.parameters.items()} == {"engine_dir": "/engines/e"}  # the runtime's: runtime_config.json


@pytest.mark.parametrize("kind, gib, instances, want", [
    ("cpu", 0.9, 3, 0.3),  # the server's budget split evenly
    ("gpu", 12.0, 2, 6.0),
    ("cpu", None, 4, None),  # the CPU default budget, split (checked below against its home)
    ("cpu", 0.5, 1, 0.5),
    ("gpu", None, 1, None),  # one instance on a GPU: what --reserve leaves at load
])
def test_instances_split_the_kv_budget(tmp_path, kind, gib, instances, want):
    opts = RepoOptions(runtime=RuntimeConfig(kv_memory_gib=gib), instances=instances)
    (tmp_path / "c.pbtxt").write_text(llm_config("/engines/e", opts, kind))
    assert parse_config(tmp_path / "c.pbtxt").instance_group[0].count == instances
    got = instance_runtime(opts, kind)
    if want is None and kind == "cpu":
        want = RuntimeConfig.CPU_KV_MEMORY_GIB / instances
    assert got.kv_memory_gib == (None if want is None else pytest.approx(want))
    assert got.device == ("cuda" if kind == "gpu" else "cpu")


def test_instances_on_a_gpu_need_an_explicit_budget(tmp_path):
    with pytest.raises(TrtkvError, match="--kv-memory"):
        instance_runtime(RepoOptions(instances=2), "gpu")
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "manifest.json").write_text("{}")
    with pytest.raises(TrtkvError, match="--kv-memory"):  # refused before anything is written
        write_repository(eng, tmp_path / "repo", RepoOptions(instances=2, instance_kind="gpu"))
    assert not (tmp_path / "repo").exists()


def test_parse_config_rejects_unknown_fields(tmp_path):
    from google.protobuf.text_format import ParseError

    (tmp_path / "c.pbtxt").write_text('name: "x"\nbogus_field: 3\n')
    with pytest.raises(ParseError):
        parse_config(tmp_path / "c.pbtxt")


def test_write_repository_references_or_copies_and_reuses(tmp_path):
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "manifest.json").write_text("{}")
    repo = write_repository(eng, tmp_path / "repo", RepoOptions(instance_kind="cpu"))
    for rel in ("ensemble/config.pbtxt", "ensemble/1/model.py", "trtkv_repo.json"):
        assert (repo / rel).exists(), rel
    assert str(eng.resolve()) in (repo / "ensemble/config.pbtxt").read_text()
    mtime = (repo / "ensemble/config.pbtxt").stat().st_mtime_ns
    write_repository(eng, repo, RepoOptions(instance_kind="cpu"))  # unchanged: reused
    assert (repo / "ensemble/config.pbtxt").stat().st_mtime_ns == mtime
    write_repository(eng, repo, RepoOptions(runtime=RuntimeConfig(max_seqs=4), instance_kind="cpu"))  # options changed: rewritten
    assert RuntimeConfig.load(repo / "ensemble/1" / RUNTIME_CONFIG).max_seqs == 4
    copied = write_repository(eng, tmp_path / "repo2", RepoOptions(instance_kind="cpu", copy_engine=True))
    assert (copied / "ensemble/1/engine/manifest.json").is_file()
    assert 'string_value: "engine"' in (copied / "ensemble/config.pbtxt").read_text()


def test_write_repository_refuses_foreign_folder_and_missing_engine(tmp_path):
    eng = tmp_path / "engine"
    eng.mkdir()
    with pytest.raises(TrtkvError, match="not a trtkv engine directory"):
        write_repository(eng, tmp_path / "repo")
    (eng / "manifest.json").write_text("{}")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "something").write_text("x")
    with pytest.raises(TrtkvError, match="not a trtkv model repository"):
        write_repository(eng, foreign)


# ---------------------------------------------------------------- request parsing


def getter(**inputs):
    def get(name):
        v = inputs.get(name)
        if v is None:
            return None
        return np.array([[v]], dtype=object if isinstance(v, (str, bytes)) else None)

    return get


def test_parse_defaults_to_greedy_and_accepts_both_seed_names():
    r = parse_request(getter(text_input=b"hello", max_tokens=np.int32(5)))
    assert r.prompt == "hello" and r.params.max_tokens == 5 and r.params.greedy and not r.stream
    r = parse_request(getter(text_input="x", max_tokens=3, temperature=np.float32(0.7), seed=np.uint64(9), min_tokens=2, stream=True))
    assert not r.params.greedy and r.params.temperature == pytest.approx(0.7) and r.params.seed == 9 and r.params.min_tokens == 2 and r.stream
    r = parse_request(getter(text_input="x", max_tokens=3, top_k=5, random_seed=np.uint64(4), min_length=1))
    assert r.params.temperature == 1.0 and r.params.top_k == 5 and r.params.seed == 4 and r.params.min_tokens == 1


def test_parse_words_lists():
    get = getter(text_input="x", max_tokens=3)

    def g(name):
        if name == "stop_words":
            return np.array([[b"\n\n", b"END"]], dtype=object)
        return get(name)

    assert parse_request(g).params.stop_words == ["\n\n", "END"]


@pytest.mark.parametrize(
    "inputs,match",
    [
        (dict(max_tokens=3), "text_input"),
        (dict(text_input="x"), "max_tokens"),
        (dict(text_input="x", max_tokens=-2), "max_tokens must be between"),
        (dict(text_input="x", max_tokens=0), "max_tokens must be between"),
        (dict(text_input="", max_tokens=2), "empty"),
        (dict(text_input="x", max_tokens=2, top_p=np.float32(1.5)), "top_p"),
        (dict(text_input="x", max_tokens=2, temperature=np.float32(-1)), "temperature"),
        (dict(text_input="x", max_tokens=2, beam_width=4), "beam_width=4 is not supported"),
        (dict(text_input="x", max_tokens=2, repetition_penalty=np.float32(1.3)), "repetition_penalty"),
        (dict(text_input=b"\xff\xfe", max_tokens=2), "UTF-8"),
    ],
)
def test_parse_rejects_bad_requests(inputs, match):
    with pytest.raises(TrtkvError, match=match):
        parse_request(getter(**inputs))


def test_neutral_values_are_accepted():
    r = parse_request(getter(text_input="x", max_tokens=2, beam_width=1, repetition_penalty=np.float32(1.0), presence_penalty=np.float32(0.0)))
    assert r.params.max_tokens == 2


def test_find_tritonserver_bundled_or_clear_error(monkeypatch, tmp_path):
    from trtkv.triton_repo.server import find_tritonserver

    monkeypatch.setenv("TRITONSERVER", str(tmp_path / "nope"))
    with pytest.raises(TrtkvError, match="not an executable"):
        find_tritonserver()
    monkeypatch.delenv("TRITONSERVER")
    pytest.importorskip("pytriton")
    monkeypatch.setenv("PATH", str(tmp_path))
    b = find_tritonserver()
    assert b.bundled and b.path.name == "tritonserver"
    assert json.dumps(str(b.path))


def test_client_wait_ready_times_out_with_a_clear_error():
    from trtkv.triton_repo.client import wait_ready
    from trtkv.triton_repo.server import free_port

    with pytest.raises(TrtkvError, match="was not ready within 1 s"):
        wait_ready(f"http://127.0.0.1:{free_port()}", 1)


def test_free_ports_are_drawn_below_the_ephemeral_range_and_skip_taken_ones(monkeypatch):
    """free_port draws from FREE_PORTS (not where outgoing connections take source ports), returns a port that binds,
    passes over one that is taken, and falls back to the kernel's choice when every draw is taken."""
    import random
    import socket

    from trtkv.triton_repo import server

    ports = {server.free_port() for _ in range(20)}
    assert all(p in server.FREE_PORTS for p in ports) and len(ports) > 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        draws = iter([busy, busy])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(draws, a + 7))
        assert server.free_port() == server.FREE_PORTS.start + 7  # the taken port skipped
        calls = []
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: calls.append(a) or busy)
        fallback = server.free_port()
        assert fallback != busy and len(calls) == 64  # every draw tried, then the kernel's port


def test_serving_defaults_have_one_home():
    """RuntimeConfig's defaults are what RepoOptions and the serve / triton-repo options use (field_option)."""
    import inspect

    from trtkv.triton_repo import cli

    want = RuntimeConfig()
    assert RepoOptions().runtime == want
    app = __import__("typer").Typer()
    cli.register(app, lambda f: f)
    checked = []
    for command in app.registered_commands:
        sig = inspect.signature(command.callback)
        if "max_seqs" in sig.parameters:
            for name in cli.RUNTIME_OPTIONS:
                assert sig.parameters[name].default == getattr(want, name), (command.callback.__name__, name)
            checked.append(command.callback.__name__)
    assert {"triton_repo", "serve"} <= set(checked)


@pytest.mark.parametrize("flag", [True, False])
def test_prefix_cache_flag_reaches_the_python_models_config(tmp_path, flag):
    """``trtkv serve --no-prefix-cache`` / ``triton-repo --no-prefix-cache`` -> the file the python model reads."""
    from trtkv.triton_repo.cli import REPO_OPTIONS, _repo_options

    defaults = {name: default for name, _, default in REPO_OPTIONS}
    opts = _repo_options(**{**defaults, "max_seqs": 8, "max_batched_tokens": 64, "instance_kind": "cpu", "enable_prefix_caching": flag})
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "manifest.json").write_text("{}")
    repo = write_repository(eng, tmp_path / "repo", opts)
    assert RuntimeConfig.load(repo / "ensemble/1" / RUNTIME_CONFIG).enable_prefix_caching is flag
    assert RepoOptions().runtime.enable_prefix_caching is True
