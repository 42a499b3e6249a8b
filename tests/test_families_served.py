"""Each model family served: an int4 torch engine (the CPU default) of every tiny family model of
tests/test_families.py behind the real tritonserver gives the offline runtime's greedy text. Its own file so that
pytest-xdist (``--dist loadfile``) runs it beside test_families.py rather than after it."""

from __future__ import annotations

import pytest
from test_families import LAYER_TYPES, STEP_NETWORK

from trtkv.models import SLIDING_ATTENTION


@pytest.mark.server
@pytest.mark.slow
def test_each_family_is_served_like_offline(family, tmp_path):
    """Every family: an int4 build (the torch engine, the CPU default, no calibration) -> ``trtkv serve``'s repository
    on the real tritonserver -> greedy generate over HTTP: the text equals the offline runtime's (LLMEngine), for
    continuations that run past the window of 8. The six servers start side by side (a start is mostly imports)."""
    pytest.importorskip("pytriton")
    from concurrent.futures import ThreadPoolExecutor

    from trtkv.builder.build import build_engine
    from trtkv.runtime.llm_engine import LLMEngine, RuntimeConfig
    from trtkv.runtime.sequence import SamplingParams
    from trtkv.triton_repo.client import generate
    from trtkv.triton_repo.repository import RepoOptions, write_repository
    from trtkv.triton_repo.server import TritonServer, free_port

    prompts = ["The quick brown fox", "Pack my box with"]
    want, servers = {}, {}
    for name in STEP_NETWORK:
        engine = build_engine(str(family(name)[0]), None, "int4", tmp_path / name / "eng", backend="torch", block_size=16, max_batch=4, max_seq_len=128)
        llm = LLMEngine.from_engine_dir(engine, RuntimeConfig(kv_memory_gib=0.01, max_seqs=8))
        want[name] = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
        repo = write_repository(engine, tmp_path / name / "repo", RepoOptions(runtime=RuntimeConfig(kv_memory_gib=0.01, max_seqs=8), instance_kind="cpu"), force=True)
        servers[name] = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_file=tmp_path / name / "server.log")
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda s: s.start(timeout=300), servers.values()))
        got = {name: [generate(s.http_url, p, 16, min_length=16, exclude_input_in_output=True)["text_output"] for p in prompts]
               for name, s in servers.items()}
        # the sliding families free their passed blocks (a window ring): said at start, KV bytes reported per layer type
        for name, s in servers.items():
            sliding = SLIDING_ATTENTION in LAYER_TYPES[name]
            assert ("keep a ring of" in (tmp_path / name / "server.log").read_text()) == sliding, name
            assert len(s.metric_values("trtkv_kv_bytes_used", layer_type="sliding_attention")) == 1, name
    finally:
        for s in servers.values():
            s.stop()
    assert got == want and all(all(texts) for texts in want.values())
