"""The Triton python-backend model (triton_repo/python_model.py) without tritonserver: imported over ``FakePbUtils``, a
stand-in ``triton_python_backend_utils`` whose responses, errors, tensors, metrics and logger record what they get,
with a stand-in engine loop. Pinned: what ``execute`` submits for a request (prompt, params, request id, callback)
and what it answers for a refused one (the error code: INVALID_ARG -> HTTP 400, UNAVAILABLE while draining, none for
an internal error); the responses the callback sends (one per token step when streaming, one whole text otherwise,
prompt included unless exclude_input_in_output; log-probabilities only when asked; COMPLETE_FINAL on the last;
nothing after a cancellation); request parameters (the generate endpoint's unknown JSON keys); the metrics pushed;
the drain protocol (the drain file, FILE.done) and finalize; where initialize finds the engine.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from trtkv.errors import TrtkvError
from trtkv.runtime.engine_loop import ShuttingDown
from trtkv.runtime.llm_engine import RequestOutput
from trtkv.runtime.sequence import SamplingParams

FINAL = 1


class TritonError:
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"

    def __init__(self, message, code=None):
        self.message, self.code = message, code


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None):
        self.tensors = {name: array for name, array in (output_tensors or [])}
        self.error = error


class Metric:
    def __init__(self, family, labels):
        self.family, self.labels, self.values = family, labels, []

    def set(self, value):
        assert self.family.kind == "gauge", f"set() on the counter {self.family.name}"
        self.values.append(value)

    def increment(self, value):
        assert value > 0, "a counter only grows"
        self.values.append((self.values[-1] if self.values else 0.0) + value)  # the counter's value after it


class MetricFamily:
    GAUGE = "gauge"
    COUNTER = "counter"
    made: list = []

    def __init__(self, name, description, kind):
        self.name, self.description, self.kind, self.metrics = name, description, kind, []
        MetricFamily.made.append(self)

    def Metric(self, labels):
        m = Metric(self, labels)
        self.metrics.append(m)
        return m


def make_stub(logged: list) -> types.ModuleType:
    stub = types.ModuleType("triton_python_backend_utils")
    stub.TritonError = TritonError
    stub.InferenceResponse = InferenceResponse
    stub.Tensor = lambda name, array: (name, array)
    stub.MetricFamily = MetricFamily
    stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    stub.Logger = SimpleNamespace(**{f"log_{k}": (lambda msg, k=k: logged.append((k, msg))) for k in ("info", "warn", "error")})
    stub.get_input_tensor_by_name = lambda request, name: (SimpleNamespace(as_numpy=lambda v=request.inputs[name]: v)
                                                           if name in request.inputs else None)
    return stub


@pytest.fixture(scope="module")
def pm():
    """python_model imported over the stub (and removed from sys.modules again afterwards)."""
    logged: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "triton_python_backend_utils", make_stub(logged))
        mp.delitem(sys.modules, "trtkv.triton_repo.python_model", raising=False)
        module = importlib.import_module("trtkv.triton_repo.python_model")
        mp.delitem(sys.modules, "trtkv.triton_repo.python_model")
        module.logged = logged
        yield module


@dataclass
class Sender:
    sent: list = field(default_factory=list)
    cancelled: bool = False

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


@dataclass
class Request:
    inputs: dict
    rid: str = "req-1"
    params: str = "{}"
    sender: Sender = field(default_factory=Sender)

    def get_response_sender(self):
        return self.sender

    def request_id(self):
        return self.rid

    def parameters(self):
        return self.params


def request(rid="req-1", params="{}", **inputs) -> Request:
    full = {"text_input": np.array([[b"hello"]], dtype=object), "max_tokens": np.array([[4]], dtype=np.int32)}
    for name, v in inputs.items():
        full[name] = v if isinstance(v, np.ndarray) else np.array([[v]], dtype=object if isinstance(v, (str, bytes)) else None)
    return Request(full, rid, params)


class FakeLoop:
    def __init__(self, error: Exception | None = None):
        self.submitted = []
        self.error = error
        self.in_flight = 0
        self.admitting = True
        self.failed_with = None
        self.drained_with = None
        self.stopped = False

    def submit(self, prompt, params, rid, callback):
        if self.error is not None:
            raise self.error
        self.submitted.append((prompt, params, rid, callback))

    def stop_admitting(self):
        self.admitting = False

    def fail_in_flight(self, message):
        self.failed_with = message
        n, self.in_flight = self.in_flight, 0
        return n

    def drain(self, grace):
        self.drained_with = grace
        return self.in_flight

    def stop(self):
        self.stopped = True


def model_with(pm, loop: FakeLoop):
    m = pm.TritonPythonModel()
    m.loop = loop
    m.engine = SimpleNamespace(_reject_lock=__import__("threading").Lock(), stats_counters={"rejected": 0})
    m.logger = pm.pb_utils.Logger
    return m


def out(text="", new_text="", ids=(), lps=(), finished=False, reason=None, error=None) -> RequestOutput:
    return RequestOutput("r", list(ids), new_text, text, finished, reason, list(lps), 3, error)


# ---------------------------------------------------------------- responses


def test_a_response_holds_the_three_outputs_with_their_shapes(pm):
    r = pm._response("héllo", [-0.5, -0.25, -1.0], True)
    assert set(r.tensors) == {"text_output", "cum_log_probs", "output_log_probs"} and r.error is None
    assert r.tensors["text_output"].dtype == object and r.tensors["text_output"].tolist() == [["héllo".encode()]]
    assert r.tensors["cum_log_probs"].dtype == np.float32 and r.tensors["cum_log_probs"].tolist() == [[-1.75]]
    assert r.tensors["output_log_probs"].dtype == np.float32 and r.tensors["output_log_probs"].tolist() == [[[-0.5, -0.25, -1.0]]]
    off = pm._response("x", [-0.5, -0.25], False)
    assert off.tensors["cum_log_probs"].tolist() == [[0.0]] and off.tensors["output_log_probs"].shape == (1, 1, 0)
    assert off.tensors["output_log_probs"].dtype == np.float32
    empty = pm._response("", [], True)
    assert empty.tensors["text_output"].tolist() == [[b""]] and empty.tensors["output_log_probs"].shape == (1, 1, 0)


@pytest.mark.parametrize("kw, code", [
    ({}, "INVALID_ARG"),
    ({"invalid_arg": True}, "INVALID_ARG"),
    ({"invalid_arg": False}, None),
    ({"code_name": "UNAVAILABLE"}, "UNAVAILABLE"),
    ({"invalid_arg": False, "code_name": "UNAVAILABLE"}, "UNAVAILABLE"),
])
def test_error_codes(pm, kw, code):
    e = pm._error("msg", **kw)
    assert (e.message, e.code) == ("msg", code)


def test_an_older_backend_gets_the_message_alone(pm, monkeypatch):
    class OldError:
        INVALID_ARG = "INVALID_ARG"

        def __init__(self, message):
            self.message, self.code = message, "old"

    monkeypatch.setattr(pm.pb_utils, "TritonError", OldError)
    assert pm._error("m").message == "m"


# ---------------------------------------------------------------- execute


def test_execute_submits_the_parsed_request_with_a_unique_id(pm):
    loop = FakeLoop()
    m = model_with(pm, loop)
    reqs = [request("abc", temperature=np.array([[0.5]], dtype=np.float32)), request("abc"), request("")]
    assert m.execute(reqs) is None
    assert [s[0] for s in loop.submitted] == ["hello"] * 3
    assert loop.submitted[0][1] == SamplingParams(max_tokens=4, temperature=0.5)
    assert loop.submitted[1][1] == SamplingParams(max_tokens=4, temperature=0.0)
    rids = [s[2] for s in loop.submitted]
    assert rids[0].startswith("abc-") and rids[1].startswith("abc-") and len(rids[0]) == len("abc-") + 8 and rids[0] != rids[1]
    assert len(rids[2]) == 32 + 1 + 8 and rids[2][32] == "-"  # no request id: a fresh uuid
    assert all(r.sender.sent == [] for r in reqs)  # the loop sends the responses
    assert m.engine.stats_counters["rejected"] == 0


@pytest.mark.parametrize("inputs, params, words", [
    ({"max_tokens": np.array([[0]], dtype=np.int32)}, "{}", "max_tokens"),
    ({"top_k": np.array([[-1]], dtype=np.int32)}, "{}", "top_k"),
    ({}, '{"ignore_eos": true}', "unknown input 'ignore_eos'"),
])
def test_a_bad_request_gets_one_invalid_arg_response_and_counts_as_rejected(pm, inputs, params, words):
    loop = FakeLoop()
    m = model_with(pm, loop)
    good, bad = request("g"), request("b", params=params, **inputs)
    m.execute([bad, good])
    assert [s[2].split("-")[0] for s in loop.submitted] == ["g"]  # the good one still runs
    [(resp, flags)] = bad.sender.sent
    assert flags == FINAL and resp.tensors == {} and resp.error.code == "INVALID_ARG" and words in resp.error.message
    assert m.engine.stats_counters["rejected"] == 1


def test_a_request_refused_by_the_engine_is_invalid_arg(pm):
    m = model_with(pm, FakeLoop(TrtkvError("prompt too long", "shorten it")))
    r = request()
    m.execute([r])
    [(resp, flags)] = r.sender.sent
    assert flags == FINAL and resp.error.code == "INVALID_ARG" and "prompt too long" in resp.error.message


def test_a_request_while_draining_is_unavailable(pm):
    m = model_with(pm, FakeLoop(ShuttingDown("the server is shutting down", "retry")))
    r = request()
    m.execute([r])
    [(resp, flags)] = r.sender.sent
    assert flags == FINAL and resp.error.code == "UNAVAILABLE" and "shutting down" in resp.error.message


def test_an_internal_failure_is_an_error_without_invalid_arg(pm):
    m = model_with(pm, FakeLoop(KeyError("boom")))
    r = request()
    m.execute([r])
    [(resp, flags)] = r.sender.sent
    assert flags == FINAL and resp.error.code is None and resp.error.message == "internal error: KeyError: 'boom'"
    assert m.engine.stats_counters["rejected"] == 0


@pytest.mark.parametrize("text", [None, "", "{}", "not json", '{"triton_enable_empty_final_response": true}',
                                  '{"sequence_id": 1, "sequence_start": true, "sequence_end": false, "priority": 2, "timeout": 9}'])
def test_triton_own_request_parameters_pass(pm, text):
    pm.check_parameters(text)


@pytest.mark.parametrize("text, words", [
    ('{"ignore_eos": true}', "unknown input 'ignore_eos':"),
    ('{"zeta": 1, "alpha": 2}', "unknown inputs 'alpha', 'zeta':"),
    ('{"max_token": 5, "priority": 1}', "unknown input 'max_token':"),
    ('{"seq_id": 1}', "unknown input 'seq_id'"),
])
def test_unknown_request_parameters_are_refused_by_name(pm, text, words):
    with pytest.raises(TrtkvError, match=words):
        pm.check_parameters(text)


# ---------------------------------------------------------------- the callback's responses


def callback(pm, *, stream=False, exclude=False, logprobs=False, prompt="P:"):
    from trtkv.triton_repo.inputs import ParsedRequest

    sender = Sender()
    m = model_with(pm, FakeLoop())
    req = ParsedRequest(prompt, SamplingParams(), stream=stream, exclude_input_in_output=exclude, return_log_probs=logprobs)
    return m._callback(sender, req), sender


def texts(sender):
    return [(None if r is None else r.tensors["text_output"][0, 0].decode(), flags) for r, flags in sender.sent]


def test_streaming_sends_one_response_per_token_step_and_flags_the_last(pm):
    cb, sender = callback(pm, stream=True, logprobs=True)
    assert cb(out(text="a", new_text="a", ids=[5], lps=[-0.5])) is True
    assert cb(out(text="a", new_text="", ids=[6], lps=[-0.25])) is True  # a held-back partial character: still a response
    assert cb(out(text="a", new_text="", ids=[], lps=[])) is True  # nothing new: nothing sent
    assert cb(out(text="abc", new_text="bc", ids=[7], lps=[-1.0], finished=True, reason="stop")) is True
    assert texts(sender) == [("a", 0), ("", 0), ("bc", FINAL)]
    assert [r.tensors["output_log_probs"].tolist() for r, _ in sender.sent] == [[[[-0.5]]], [[[-0.25]]], [[[-1.0]]]]
    assert [r.tensors["cum_log_probs"].tolist() for r, _ in sender.sent] == [[[-0.5]], [[-0.25]], [[-1.0]]]


def test_streaming_sends_a_final_response_even_without_new_tokens(pm):
    cb, sender = callback(pm, stream=True)
    cb(out(text="", finished=True, reason="stop"))  # the end id: no new token
    assert texts(sender) == [("", FINAL)]


@pytest.mark.parametrize("exclude, whole", [(False, "P:abc"), (True, "abc")])
def test_a_plain_request_gets_one_response_with_the_whole_text(pm, exclude, whole):
    cb, sender = callback(pm, exclude=exclude, logprobs=True)
    assert cb(out(text="a", new_text="a", ids=[1], lps=[-0.5])) is True
    assert cb(out(text="ab", new_text="b", ids=[2], lps=[-0.25])) is True
    assert sender.sent == []
    assert cb(out(text="abc", new_text="c", ids=[3], lps=[-1.0], finished=True, reason="length")) is True
    assert texts(sender) == [(whole, FINAL)]
    [(r, _)] = sender.sent
    assert r.tensors["output_log_probs"].tolist() == [[[-0.5, -0.25, -1.0]]] and r.tensors["cum_log_probs"].tolist() == [[-1.75]]


def test_streaming_text_never_includes_the_prompt(pm):
    cb, sender = callback(pm, stream=True, exclude=False)
    cb(out(text="a", new_text="a", ids=[1], finished=True, reason="stop"))
    assert texts(sender) == [("a", FINAL)]


@pytest.mark.parametrize("stream", [False, True])
def test_log_probabilities_only_when_asked(pm, stream):
    cb, sender = callback(pm, stream=stream, logprobs=False)
    cb(out(text="ab", new_text="ab", ids=[1, 2], lps=[-0.5, -0.5], finished=True, reason="stop"))
    [(r, _)] = sender.sent
    assert r.tensors["output_log_probs"].shape == (1, 1, 0) and r.tensors["cum_log_probs"].tolist() == [[0.0]]


@pytest.mark.parametrize("reason, error, code", [("error", "it broke", "INVALID_ARG"), ("internal", "it broke", None),
                                                 ("internal", "the server is shutting down: the request did not finish within the grace period", "UNAVAILABLE")])
def test_an_output_with_an_error_is_an_error_response_and_ends_the_request(pm, reason, error, code):
    """A refusal at admission is INVALID_ARG (HTTP 400), a request failed by the drain UNAVAILABLE (503: retry
    elsewhere), any other failure INTERNAL (500)."""
    cb, sender = callback(pm, stream=True)
    assert cb(out(finished=True, reason=reason, error=error)) is False
    [(r, flags)] = sender.sent
    assert flags == FINAL and r.error.message == error and r.error.code == code


def test_a_cancelled_request_is_closed_once_and_aborted(pm):
    cb, sender = callback(pm, stream=True)
    cb(out(text="a", new_text="a", ids=[1]))
    sender.cancelled = True
    assert cb(out(text="ab", new_text="b", ids=[2])) is False  # False: the loop aborts it
    assert sender.sent[1:] == [(None, FINAL)]  # an empty final response closes the stream
    cb2, sender2 = callback(pm, stream=True)
    sender2.cancelled = True
    assert cb2(out(text="a", new_text="a", ids=[1], finished=True, reason="stop")) is False
    assert sender2.sent == []  # already finished: the engine has ended it, nothing more to close


# ---------------------------------------------------------------- metrics


STATS = {
    "blocks_used": 3, "blocks_free": 5, "blocks_cached": 2, "prefix_hit_rate": 0.25, "prefix_hit_tokens": 40, "blocks_evicted": 1,
    "slots_used": 2, "slots_total": 8, "running": 2, "waiting": 4, "bytes_per_block": 4096, "bytes_per_slot": 8192,
    "block_size": 16, "kv_budget_bytes": 10**6, "preemptions": 7, "peak_running": 6, "finished": 11, "rejected": 3, "aborted": 2,
    "generated_tokens": 99, "kv_bytes_used_full_attention": 1234, "kv_bytes_used_sliding_attention": 56,
}


def test_metrics_push_every_gauge_and_counter_with_its_labels(pm):
    MetricFamily.made.clear()
    met = pm._Metrics("int4", "inst-0")
    met.update(STATS, force=True)
    got = {(f.name, tuple(sorted((k, v) for k, v in m.labels.items() if k not in ("kv_format", "instance")))): m.values
           for f in MetricFamily.made for m in f.metrics}
    assert all(m.labels["kv_format"] == "int4" and m.labels["instance"] == "inst-0" for f in MetricFamily.made for m in f.metrics)
    counters = {"trtkv_requests_total", "trtkv_preemptions_total", "trtkv_generated_tokens_total", "trtkv_prefix_cache_hit_tokens_total",
                "trtkv_prefix_cache_evicted_blocks_total"}
    assert {f.name for f in MetricFamily.made if f.kind == "counter"} == counters  # Prometheus: what only grows, named _total
    assert all(f.kind == "gauge" for f in MetricFamily.made if f.name not in counters)
    assert got == {
        ("trtkv_kv_blocks", (("state", "used"),)): [3.0], ("trtkv_kv_blocks", (("state", "free"),)): [5.0],
        ("trtkv_kv_blocks", (("state", "cached"),)): [2.0],
        ("trtkv_prefix_cache_hit_rate", ()): [0.25], ("trtkv_prefix_cache_hit_tokens_total", ()): [40.0],
        ("trtkv_prefix_cache_evicted_blocks_total", ()): [1.0],
        ("trtkv_kv_slots", (("state", "used"),)): [2.0], ("trtkv_kv_slots", (("state", "free"),)): [6.0],
        ("trtkv_sequences", (("state", "running"),)): [2.0], ("trtkv_sequences", (("state", "waiting"),)): [4.0],
        ("trtkv_kv_pool_info", (("field", "bytes_per_block"),)): [4096.0], ("trtkv_kv_pool_info", (("field", "bytes_per_slot"),)): [8192.0],
        ("trtkv_kv_pool_info", (("field", "tokens_per_block"),)): [16.0], ("trtkv_kv_pool_info", (("field", "budget_bytes"),)): [1e6],
        ("trtkv_preemptions_total", ()): [7.0], ("trtkv_peak_running_sequences", ()): [6.0],
        ("trtkv_requests_total", (("state", "finished"),)): [11.0], ("trtkv_requests_total", (("state", "rejected"),)): [3.0],
        ("trtkv_requests_total", (("state", "cancelled"),)): [2.0], ("trtkv_generated_tokens_total", ()): [99.0],
        ("trtkv_kv_bytes_used", (("layer_type", "full_attention"),)): [1234.0],
        ("trtkv_kv_bytes_used", (("layer_type", "sliding_attention"),)): [56.0],
    }


def test_metrics_are_pushed_at_most_every_interval_but_always_when_drained(pm, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(pm.time, "monotonic", lambda: clock[0])
    MetricFamily.made.clear()
    met = pm._Metrics("fp16")
    gen = next(m for f in MetricFamily.made for m in f.metrics if f.name == "trtkv_generated_tokens_total")
    busy = {**STATS, "running": 1, "waiting": 0}
    met.update({**busy, "generated_tokens": 1})
    assert gen.values == [1.0]
    clock[0] += pm.METRIC_INTERVAL_S / 2
    met.update({**busy, "generated_tokens": 2})  # too soon
    assert gen.values == [1.0]
    met.update({**busy, "generated_tokens": 3}, force=True)
    assert gen.values == [1.0, 3.0]
    clock[0] += pm.METRIC_INTERVAL_S
    met.update({**busy, "generated_tokens": 4})  # an interval later
    assert gen.values == [1.0, 3.0, 4.0]
    clock[0] += 0.01
    idle = {**STATS, "running": 0, "waiting": 0, "finished": 12, "generated_tokens": 5}
    met.update(idle)  # drained with a new count of finished requests: pushed at once
    assert gen.values[-1] == 5.0
    met.update({**idle, "generated_tokens": 6})  # still idle, nothing new ended: waits for the interval
    assert gen.values[-1] == 5.0
    met.update({**idle, "aborted": 3, "generated_tokens": 7})  # a cancellation ended: pushed
    assert gen.values[-1] == 7.0
    met.update({**idle, "waiting": 1, "finished": 13, "generated_tokens": 8})  # not drained: waits
    assert gen.values[-1] == 7.0


def test_each_step_offers_the_stats_to_the_metrics_without_forcing_a_push(pm):
    m = model_with(pm, FakeLoop())
    got = []
    m._drain = None
    m.metrics = SimpleNamespace(update=lambda stats, force=False: got.append((stats, force)))
    m._on_step({"x": 1})
    assert got == [({"x": 1}, False)]  # _Metrics.update decides when to push (its interval)

    def broken(stats, force=False):
        raise RuntimeError("gauge gone")

    m.metrics = SimpleNamespace(update=broken)
    m.logger = Log()
    m._on_step({"x": 2})
    assert m.metrics is None and m.logger.lines[-1][0] == "warn" and "disabled" in m.logger.lines[-1][1]
    m._on_step({"x": 3})  # no metrics: nothing to do


# ---------------------------------------------------------------- drain and finalize


class Log:
    def __init__(self):
        self.lines = []

    def log_info(self, m):
        self.lines.append(("info", m))

    def log_warn(self, m):
        self.lines.append(("warn", m))


def test_a_drain_waits_for_the_file_then_for_the_requests_in_flight(pm, tmp_path, monkeypatch):
    path = tmp_path / "drain"
    monkeypatch.setenv(pm.DRAIN_FILE_ENV, str(path))
    clock = [50.0]
    monkeypatch.setattr(pm.time, "monotonic", lambda: clock[0])
    loop, log = FakeLoop(), Log()
    loop.in_flight = 2
    d = pm._Drain(loop, log)
    d.poll()
    assert loop.admitting and d.deadline is None  # no file: nothing happens
    path.write_text("3.5\n")
    clock[0] += pm._Drain.POLL_S / 2
    d.poll()
    assert loop.admitting  # polled at most every POLL_S
    clock[0] += pm._Drain.POLL_S
    d.poll()
    assert not loop.admitting and d.deadline == pytest.approx(clock[0] + 3.5) and not d.done
    assert "2 requests in flight get 3.5 s" in log.lines[-1][1]
    loop.in_flight = 1
    clock[0] += 1.0
    d.poll()
    assert not d.done and loop.failed_with is None  # within the grace period
    loop.in_flight = 0
    d.poll()
    assert d.done and (tmp_path / "drain.done").read_text() == "drained" and loop.failed_with is None
    assert log.lines[-1][0] == "info"
    d.poll()  # done: nothing more
    assert (tmp_path / "drain.done").read_text() == "drained"


def test_a_drain_fails_what_is_left_after_the_grace_period(pm, tmp_path, monkeypatch):
    path = tmp_path / "drain"
    path.write_text("")  # created but not yet written (serve renames it into place whole): not a drain request
    monkeypatch.setenv(pm.DRAIN_FILE_ENV, str(path))
    clock = [50.0]
    monkeypatch.setattr(pm.time, "monotonic", lambda: clock[0])
    loop, log = FakeLoop(), Log()
    loop.in_flight = 3
    d = pm._Drain(loop, log)
    d.poll()
    assert loop.admitting and not d.done and loop.failed_with is None  # an empty file once failed everything at once
    path.write_text("0")  # no grace
    clock[0] += pm._Drain.POLL_S
    d.poll()
    assert d.done and (tmp_path / "drain.done").read_text() == "failed 3"
    assert "grace period" in loop.failed_with and log.lines[-1][0] == "warn" and "3 requests" in log.lines[-1][1]


def test_no_drain_file_variable_means_no_drain(pm, tmp_path, monkeypatch):
    monkeypatch.delenv(pm.DRAIN_FILE_ENV, raising=False)
    loop = FakeLoop()
    d = pm._Drain(loop, Log())
    d.poll()
    assert d.path is None and loop.admitting and not d.done


@pytest.mark.parametrize("env, grace", [(None, 10.0), ("2.5", 2.5), ("", 10.0)])
def test_finalize_drains_for_the_grace_period_and_stops_the_loop(pm, monkeypatch, env, grace):
    if env is None:
        monkeypatch.delenv(pm.DRAIN_GRACE_ENV, raising=False)
    else:
        monkeypatch.setenv(pm.DRAIN_GRACE_ENV, env)
    assert pm.DEFAULT_DRAIN_GRACE_S == 10.0
    loop = FakeLoop()
    m = model_with(pm, loop)
    m.logger = Log()
    m.finalize()
    assert loop.drained_with == grace and loop.stopped and m.logger.lines[-1][0] == "info"
    loop2 = FakeLoop()
    loop2.in_flight = 2
    m.loop, m.logger = loop2, Log()
    m.finalize()
    assert loop2.stopped and m.logger.lines[-1][0] == "warn" and "2 requests" in m.logger.lines[-1][1]
    pm.TritonPythonModel().finalize()  # never initialized: nothing to stop


# ---------------------------------------------------------------- initialize


def test_initialize_finds_the_engine_relative_to_the_version_directory_or_absolute(pm, tmp_path, monkeypatch):
    from trtkv.runtime.config import RuntimeConfig
    from trtkv.runtime.llm_engine import LLMEngine
    from trtkv.triton_repo.repository import RUNTIME_CONFIG

    (tmp_path / "1").mkdir()
    (tmp_path / "1" / RUNTIME_CONFIG).write_text(RuntimeConfig(max_seqs=3).dump_json())
    seen = []

    class Stop(Exception):
        pass

    def from_engine_dir(engine_dir, config):
        seen.append((engine_dir, config))
        raise Stop

    monkeypatch.setattr(LLMEngine, "from_engine_dir", staticmethod(from_engine_dir))
    for ref, want_dir in (("engine", tmp_path / "1" / "engine"), ("/abs/engine", "/abs/engine")):
        args = {"model_config": json.dumps({"parameters": {"engine_dir": {"string_value": ref}}}), "model_repository": str(tmp_path),
                "model_version": "1"}
        with pytest.raises(Stop):
            pm.TritonPythonModel().initialize(args)
        assert str(seen[-1][0]) == str(want_dir) and seen[-1][1] == RuntimeConfig(max_seqs=3)


def test_log_probs_are_returned_only_when_asked_for(monkeypatch):
    """Interface.py: cum_log_probs is "0 unless
    return_log_probs", output_log_probs "empty unless return_log_probs"."""
    import importlib

    stub = types.ModuleType("triton_python_backend_utils")
    stub.Tensor = lambda name, array: (name, array)
    stub.InferenceResponse = lambda output_tensors: dict(output_tensors)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    monkeypatch.delitem(sys.modules, "trtkv.triton_repo.python_model", raising=False)
    pm = importlib.import_module("trtkv.triton_repo.python_model")
    monkeypatch.delitem(sys.modules, "trtkv.triton_repo.python_model")
    off = pm._response("ab", [-0.5, -0.25], False)
    assert off["cum_log_probs"].tolist() == [[0.0]] and off["output_log_probs"].shape == (1, 1, 0)
    on = pm._response("ab", [-0.5, -0.25], True)
    assert on["cum_log_probs"].tolist() == [[-0.75]] and on["output_log_probs"].tolist() == [[[-0.5, -0.25]]]
    assert on["text_output"].tolist() == [[b"ab"]]
