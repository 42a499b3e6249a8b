"""The generated model repository (triton_repo/repository.py), file by file: config.pbtxt parsed with Triton's own
schema and compared with the interface table (every input's type, dims and ``optional``, the outputs, the model's
name, backend, batching, decoupled policy, instance group, the one parameter), runtime_config.json against
``instance_runtime`` (each instance's share of the budget, its device), the model shim, the reuse stamp (what
makes a repository reused, rewritten or refused), and the budget split among instances.
"""

from __future__ import annotations

import json
import os

import pytest

from trtkv.errors import TrtkvError
from trtkv.runtime.config import RuntimeConfig
from trtkv.triton_repo import repository as repo_mod
from trtkv.triton_repo.interface import INPUTS, OUTPUTS
from trtkv.triton_repo.repository import (
    MODEL_SHIM,
    RepoOptions,
    detect_instance_kind,
    instance_budget,
    instance_runtime,
    llm_config,
    parse_config,
    write_repository,
)


@pytest.fixture(scope="module")
def pb2():
    return repo_mod.load_model_config_pb2()


@pytest.fixture
def engine(tmp_path):
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "manifest.json").write_text('{"x": 1}')
    (eng / "weights.bin").write_bytes(b"\0" * 10)
    return eng


def config_of(tmp_path, text: str):
    path = tmp_path / "written.pbtxt"
    path.write_text(text)
    return parse_config(path)


def test_names_the_python_model_and_its_files_depend_on():
    assert repo_mod.ENSEMBLE == repo_mod.LLM_MODEL == "ensemble"
    assert repo_mod.RUNTIME_CONFIG == "runtime_config.json" and repo_mod.STAMP == "trtkv_repo.json"
    assert "from trtkv.triton_repo.python_model import TritonPythonModel" in MODEL_SHIM


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_config_pbtxt_declares_every_interface_tensor(tmp_path, pb2, kind):
    cfg = config_of(tmp_path, llm_config("/engines/e", RepoOptions(), kind))
    got_in = [(i.name, pb2.DataType.Name(i.data_type), tuple(i.dims), i.optional) for i in cfg.input]
    assert got_in == [(t.name, f"TYPE_{t.dtype}", t.dims, t.optional) for t in INPUTS]
    assert [i.name for i in cfg.input if not i.optional] == ["text_input", "max_tokens"]
    got_out = [(o.name, pb2.DataType.Name(o.data_type), tuple(o.dims)) for o in cfg.output]
    assert got_out == [(t.name, f"TYPE_{t.dtype}", t.dims) for t in OUTPUTS]


@pytest.mark.parametrize("kind, kind_name, gpus", [("cpu", "KIND_CPU", []), ("gpu", "KIND_GPU", [0])])
@pytest.mark.parametrize("instances, batch", [(1, 64), (3, 8)])
def test_config_pbtxt_model_settings(tmp_path, kind, kind_name, gpus, instances, batch):
    opts = RepoOptions(runtime=RuntimeConfig(kv_memory_gib=3.0), instances=instances, max_batch_size=batch)
    cfg = config_of(tmp_path, llm_config("/some/engine dir", opts, kind))
    assert cfg.name == "ensemble" and cfg.backend == "python" and cfg.max_batch_size == batch
    assert cfg.model_transaction_policy.decoupled is True
    [group] = cfg.instance_group
    assert group.count == instances and type(group).Kind.Name(group.kind) == kind_name and list(group.gpus) == gpus
    assert {k: v.string_value for k, v in cfg.parameters.items()} == {"engine_dir": "/some/engine dir"}
    assert not cfg.ensemble_scheduling.step and not cfg.HasField("dynamic_batching")


def test_repo_options_defaults_and_stamp():
    o = RepoOptions()
    assert (o.runtime, o.instance_kind, o.instances, o.max_batch_size, o.copy_engine) == (RuntimeConfig(), "auto", 1, 64, False)
    o = RepoOptions(runtime=RuntimeConfig(max_seqs=5), instance_kind="cpu", instances=2, max_batch_size=9, copy_engine=True)
    assert o.stamp() == {"instance_kind": "cpu", "instances": 2, "max_batch_size": 9, "copy_engine": True,
                         "runtime": RuntimeConfig(max_seqs=5).model_dump(mode="json")}
    json.dumps(o.stamp())  # JSON values only


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_detect_instance_kind_takes_an_explicit_kind(kind):
    assert detect_instance_kind(kind) == kind


@pytest.mark.parametrize("cuda, want", [(True, "gpu"), (False, "cpu")])
def test_auto_instance_kind_follows_cuda(monkeypatch, cuda, want):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert detect_instance_kind("auto") == want == detect_instance_kind()


def test_an_unknown_instance_kind_is_refused():
    with pytest.raises(TrtkvError, match="unknown instance kind 'tpu'"):
        detect_instance_kind("tpu")


@pytest.mark.parametrize("gib, instances, kind, want", [
    (None, 1, "cpu", None), (None, 1, "gpu", None), (2.0, 1, "gpu", 2.0), (0.75, 1, "cpu", 0.75),
    (3.0, 4, "gpu", 0.75), (3.0, 4, "cpu", 0.75), (None, 2, "cpu", RuntimeConfig.CPU_KV_MEMORY_GIB / 2), (None, 5, "cpu", 0.2),
])
def test_each_instance_gets_its_share_of_the_budget(gib, instances, kind, want):
    opts = RepoOptions(runtime=RuntimeConfig(kv_memory_gib=gib, max_seqs=7, max_batched_tokens=99), instances=instances)
    got = instance_budget(opts, kind)
    assert got == (None if want is None else pytest.approx(want))
    rt = instance_runtime(opts, kind)
    assert rt == RuntimeConfig(kv_memory_gib=got, max_seqs=7, max_batched_tokens=99, device="cuda" if kind == "gpu" else "cpu")


def test_more_than_one_gpu_instance_needs_the_budget():
    with pytest.raises(TrtkvError, match="--instances 3 on a GPU needs the KV budget"):
        instance_budget(RepoOptions(instances=3), "gpu")


def test_the_written_repository(engine, tmp_path, pb2):
    opts = RepoOptions(runtime=RuntimeConfig(kv_memory_gib=0.5, max_seqs=6), instance_kind="cpu", instances=2, max_batch_size=16)
    out = write_repository(engine, tmp_path / "repo", opts)
    assert out == (tmp_path / "repo").resolve()
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "ensemble", "ensemble/1", "ensemble/1/model.py", "ensemble/1/runtime_config.json", "ensemble/config.pbtxt", "trtkv_repo.json"]
    assert (out / "ensemble/1/model.py").read_text() == MODEL_SHIM
    written = RuntimeConfig.load(out / "ensemble/1/runtime_config.json")
    assert written == RuntimeConfig(kv_memory_gib=0.25, max_seqs=6, device="cpu")
    assert json.loads((out / "ensemble/1/runtime_config.json").read_text()) == written.model_dump(mode="json")  # every field written
    cfg = parse_config(out / "ensemble/config.pbtxt")
    assert cfg.parameters["engine_dir"].string_value == str(engine.resolve()) and cfg.max_batch_size == 16
    assert cfg.instance_group[0].count == 2
    stamp = json.loads((out / "trtkv_repo.json").read_text())
    assert stamp == {"layout": repo_mod.REPO_LAYOUT, "engine_dir": str(engine.resolve()), "options": opts.stamp(), "instance_kind": "cpu",
                     "manifest_mtime_ns": (engine / "manifest.json").stat().st_mtime_ns}


def test_a_copied_engine_is_referenced_relative_to_the_version_directory(engine, tmp_path):
    out = write_repository(engine, tmp_path / "repo", RepoOptions(instance_kind="cpu", copy_engine=True))
    copied = out / "ensemble" / "1" / "engine"
    assert (copied / "manifest.json").read_text() == '{"x": 1}' and (copied / "weights.bin").read_bytes() == b"\0" * 10
    assert parse_config(out / "ensemble/config.pbtxt").parameters["engine_dir"].string_value == "engine"


def test_a_relative_engine_path_is_written_absolute(engine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = write_repository("engine", "repo", RepoOptions(instance_kind="cpu"))
    assert parse_config(out / "ensemble/config.pbtxt").parameters["engine_dir"].string_value == str(engine.resolve())


def _marker(out):
    m = out / "ensemble" / "1" / "marker"
    m.write_text("x")
    return m


def test_an_unchanged_repository_is_reused_and_force_rewrites_it(engine, tmp_path):
    opts = RepoOptions(instance_kind="cpu")
    out = write_repository(engine, tmp_path / "repo", opts)
    m = _marker(out)
    assert write_repository(engine, out, opts) == out and m.exists()
    write_repository(engine, out, opts, force=True)
    assert not m.exists() and (out / "ensemble/config.pbtxt").is_file()


@pytest.mark.parametrize("change", [
    lambda eng, opts: (eng, RepoOptions(instance_kind="cpu", max_batch_size=32)),
    lambda eng, opts: (eng, RepoOptions(instance_kind="cpu", instances=2)),
    lambda eng, opts: (eng, RepoOptions(instance_kind="gpu", runtime=RuntimeConfig(kv_memory_gib=1.0))),
    lambda eng, opts: (eng, RepoOptions(instance_kind="cpu", runtime=RuntimeConfig(enable_prefix_caching=False))),
    lambda eng, opts: (eng, RepoOptions(instance_kind="cpu", copy_engine=True)),
])
def test_changed_options_rewrite_the_repository(engine, tmp_path, change):
    opts = RepoOptions(instance_kind="cpu", runtime=RuntimeConfig(kv_memory_gib=1.0))
    out = write_repository(engine, tmp_path / "repo", opts)
    m = _marker(out)
    eng, new = change(engine, opts)
    write_repository(eng, out, new)
    assert not m.exists()
    assert json.loads((out / "trtkv_repo.json").read_text())["options"] == new.stamp()


def test_another_engine_or_a_rebuilt_one_rewrites_it(engine, tmp_path):
    opts = RepoOptions(instance_kind="cpu")
    out = write_repository(engine, tmp_path / "repo", opts)
    other = tmp_path / "engine2"
    other.mkdir()
    (other / "manifest.json").write_text("{}")
    m = _marker(out)
    write_repository(other, out, opts)
    assert not m.exists() and parse_config(out / "ensemble/config.pbtxt").parameters["engine_dir"].string_value == str(other.resolve())
    m = _marker(out)
    st = (other / "manifest.json").stat()
    os.utime(other / "manifest.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    write_repository(other, out, opts)
    assert not m.exists()


@pytest.mark.parametrize("edit", [
    lambda s: {**s, "layout": s["layout"] - 1},  # written by an older trtkv
    lambda s: {k: v for k, v in s.items() if k != "layout"},
    lambda s: "{ not json",
])
def test_a_stale_or_corrupt_stamp_rewrites_it(engine, tmp_path, edit):
    opts = RepoOptions(instance_kind="cpu")
    out = write_repository(engine, tmp_path / "repo", opts)
    stamp = out / "trtkv_repo.json"
    edited = edit(json.loads(stamp.read_text()))
    stamp.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    m = _marker(out)
    write_repository(engine, out, opts)
    assert not m.exists() and json.loads(stamp.read_text())["layout"] == repo_mod.REPO_LAYOUT


def test_a_rewrite_removes_the_legacy_model_folders(engine, tmp_path):
    out = write_repository(engine, tmp_path / "repo", RepoOptions(instance_kind="cpu"))
    for name in repo_mod.LEGACY_MODELS:
        (out / name / "1").mkdir(parents=True)
    assert repo_mod.LEGACY_MODELS == ("trtkv_llm",)
    write_repository(engine, out, RepoOptions(instance_kind="cpu", max_batch_size=2))
    assert not (out / "trtkv_llm").exists()
    foreign = out / "notes.txt"  # files of the user's beside the models stay
    foreign.write_text("mine")
    write_repository(engine, out, RepoOptions(instance_kind="cpu", max_batch_size=3))
    assert foreign.read_text() == "mine"


def test_an_empty_existing_folder_is_used(engine, tmp_path):
    (tmp_path / "repo").mkdir()
    out = write_repository(engine, tmp_path / "repo", RepoOptions(instance_kind="cpu"))
    assert (out / "ensemble/config.pbtxt").is_file()


def test_refusals(engine, tmp_path):
    with pytest.raises(TrtkvError, match="does not exist"):
        write_repository(tmp_path / "nowhere", tmp_path / "r1", RepoOptions(instance_kind="cpu"))
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(TrtkvError, match="has no manifest.json"):
        write_repository(bare, tmp_path / "r2", RepoOptions(instance_kind="cpu"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "a").write_text("x")
    with pytest.raises(TrtkvError, match="exists and is not a trtkv model repository"):
        write_repository(engine, foreign, RepoOptions(instance_kind="cpu"))
    assert sorted(p.name for p in foreign.iterdir()) == ["a"]
    with pytest.raises(TrtkvError, match="unknown instance kind"):
        write_repository(engine, tmp_path / "r3", RepoOptions(instance_kind="npu"))
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()


def test_an_unwritable_place_is_one_error(engine, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TrtkvError, match="cannot write the model repository"):
        write_repository(engine, blocker / "repo", RepoOptions(instance_kind="cpu"))


def test_parse_config_reads_what_llm_config_writes_and_refuses_junk(tmp_path):
    from google.protobuf.text_format import ParseError

    (tmp_path / "bad.pbtxt").write_text(llm_config("/e", RepoOptions(), "cpu") + "no_such_field: 1\n")
    with pytest.raises(ParseError):
        parse_config(tmp_path / "bad.pbtxt")


def test_without_tritonclient_the_schema_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tritonclient", None)
    with pytest.raises(TrtkvError, match="tritonclient is not installed"):
        repo_mod.load_model_config_pb2()


def test_a_rebuilt_engine_rewrites_the_repository(tmp_path):
    """A repository is reused only while its engine is unchanged;
    a rebuilt engine (a newer manifest.json) gets the repository written again."""
    import os

    from trtkv.triton_repo.repository import RepoOptions, write_repository

    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "manifest.json").write_text("{}")
    opts = RepoOptions(instance_kind="cpu")
    repo = write_repository(eng, tmp_path / "repo", opts)
    marker = repo / "ensemble" / "1" / "left-by-the-first-write"
    marker.write_text("x")
    write_repository(eng, repo, opts)
    assert marker.exists()  # nothing changed: reused as it is
    st = (eng / "manifest.json").stat()
    os.utime(eng / "manifest.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the engine was rebuilt
    write_repository(eng, repo, opts)
    assert not marker.exists() and (repo / "ensemble" / "config.pbtxt").is_file()


def test_a_rewrite_replaces_the_old_model_folder_also_with_a_copied_engine(tmp_path):
    """Changed options rewrite the repository from scratch, so a
    copied engine is copied again (not refused as an existing folder) and nothing of the old folder stays."""
    from trtkv.triton_repo.repository import RepoOptions, write_repository

    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "manifest.json").write_text("{}")
    repo = write_repository(eng, tmp_path / "repo", RepoOptions(instance_kind="cpu", copy_engine=True))
    stale = repo / "ensemble" / "stale.txt"
    stale.write_text("x")
    write_repository(eng, repo, RepoOptions(instance_kind="cpu", copy_engine=True, max_batch_size=8))
    assert (repo / "ensemble" / "1" / "engine" / "manifest.json").is_file() and not stale.exists()
    assert "max_batch_size: 8" in (repo / "ensemble" / "config.pbtxt").read_text()
