"""The decoupled Triton python-backend model that hosts the trtkv runtime (loaded through the repository's model.py).

``initialize`` loads the engine and starts one ``EngineLoop`` thread. ``execute`` validates each request
(a bad one gets an INVALID_ARG error response, i.e. HTTP 400, at once), submits it and returns; the
loop thread sends the responses: one per token-step with ``stream=true`` (the new text), otherwise
one with the whole text, the last flagged COMPLETE_FINAL. Pool usage is exported as custom metrics
(gauges ``trtkv_kv_blocks{state=used|free|cached}``, ``trtkv_kv_slots``, ``trtkv_sequences{state=running|waiting}``,
``trtkv_kv_pool_info``, ``trtkv_peak_running_sequences``; counters ``trtkv_requests_total{state=finished|rejected|cancelled}``,
``trtkv_preemptions_total``, ``trtkv_generated_tokens_total``, ``trtkv_prefix_cache_hit_tokens_total``,
``trtkv_prefix_cache_evicted_blocks_total``) labelled with the KV format.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by the python backend

from trtkv.errors import TrtkvError
from trtkv.runtime.config import RuntimeConfig
from trtkv.runtime.engine_loop import ShuttingDown
from trtkv.triton_repo.inputs import ParsedRequest, parse_request
from trtkv.triton_repo.repository import RUNTIME_CONFIG
from trtkv.triton_repo.server import DRAIN_FILE_ENV, DRAIN_GRACE_ENV

METRIC_INTERVAL_S = 0.25
SHUTDOWN_FAILURE = "the server is shutting down: the request did not finish within the grace period"
DEFAULT_DRAIN_GRACE_S = 10.0  # without `trtkv serve --grace` (e.g. the repository in NVIDIA's container)


def _error(message: str, invalid_arg: bool = True, code_name: str | None = None):
    code = getattr(pb_utils.TritonError, code_name or "INVALID_ARG", None) if invalid_arg or code_name else None
    try:
        return pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    except TypeError:  # older python backends take only the message
        return pb_utils.TritonError(message)


def _response(text: str, logprobs: list[float], want_logprobs: bool):
    lps = np.asarray(logprobs if want_logprobs else [], dtype=np.float32)
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object)),
            pb_utils.Tensor("cum_log_probs", np.array([[float(lps.sum())]], dtype=np.float32)),
            pb_utils.Tensor("output_log_probs", lps.reshape(1, 1, -1)),
        ]
    )


class _Metrics:
    # the stats that only grow: Prometheus counters (``_total``), pushed as the increase since the last push
    COUNTERS = ("prefix_hit_tokens", "blocks_evicted", "preemptions", "finished", "rejected", "aborted", "generated_tokens")

    def __init__(self, kv_format: str, instance: str = ""):
        self._families = []  # a MetricFamily must outlive its Metrics: keep every one

        def fam(name, desc, kind=pb_utils.MetricFamily.GAUGE):
            f = pb_utils.MetricFamily(name=name, description=desc, kind=kind)
            self._families.append(f)
            return f

        def counter(name, desc):
            return fam(name, desc, pb_utils.MetricFamily.COUNTER)

        lab = {"kv_format": kv_format, "instance": instance}  # one series per model instance (--instances): each has its own pool
        blocks = fam("trtkv_kv_blocks", "KV pool blocks of the trtkv runtime by state")
        slots = fam("trtkv_kv_slots", "sequence slots (fp16 open blocks) by state")
        seqs = fam("trtkv_sequences", "sequences in the trtkv scheduler by state")
        requests = counter("trtkv_requests_total", "requests finished, rejected or cancelled")
        info = fam("trtkv_kv_pool_info", "KV pool geometry: bytes per block, bytes per slot, tokens per block, budget")
        self.g = {
            "blocks_used": blocks.Metric(labels={**lab, "state": "used"}),
            "blocks_free": blocks.Metric(labels={**lab, "state": "free"}),
            "blocks_cached": blocks.Metric(labels={**lab, "state": "cached"}),  # prefix cache: sealed, unreferenced, evictable
            "prefix_hit_rate": fam("trtkv_prefix_cache_hit_rate", "prompt tokens reused from the prefix cache / prompt tokens, since start").Metric(labels=lab),
            "prefix_hit_tokens": counter("trtkv_prefix_cache_hit_tokens_total", "prompt tokens reused from the prefix cache").Metric(labels=lab),
            "blocks_evicted": counter("trtkv_prefix_cache_evicted_blocks_total", "cached blocks evicted for new allocations").Metric(labels=lab),
            "slots_used": slots.Metric(labels={**lab, "state": "used"}),
            "slots_free": slots.Metric(labels={**lab, "state": "free"}),
            "running": seqs.Metric(labels={**lab, "state": "running"}),
            "waiting": seqs.Metric(labels={**lab, "state": "waiting"}),
            "bytes_per_block": info.Metric(labels={**lab, "field": "bytes_per_block"}),
            "bytes_per_slot": info.Metric(labels={**lab, "field": "bytes_per_slot"}),
            "block_size": info.Metric(labels={**lab, "field": "tokens_per_block"}),
            "kv_budget_bytes": info.Metric(labels={**lab, "field": "budget_bytes"}),
            "preemptions": counter("trtkv_preemptions_total", "sequences preempted").Metric(labels=lab),
            "peak_running": fam("trtkv_peak_running_sequences", "most sequences running at once since start").Metric(labels=lab),
            "finished": requests.Metric(labels={**lab, "state": "finished"}),
            "rejected": requests.Metric(labels={**lab, "state": "rejected"}),
            "aborted": requests.Metric(labels={**lab, "state": "cancelled"}),
            "generated_tokens": counter("trtkv_generated_tokens_total", "tokens generated").Metric(labels=lab),
        }
        kv_bytes = fam("trtkv_kv_bytes_used", "KV bytes the running sequences hold (sealed blocks + open blocks) by layer type")
        self.g |= {
            f"kv_bytes_used_{t}": kv_bytes.Metric(labels={**lab, "layer_type": t}) for t in ("full_attention", "sliding_attention")
        }
        self._counted = {key: 0.0 for key in self.COUNTERS}  # what each counter has been increased to
        self._last = 0.0
        self._pushed_finished = -1

    def update(self, s: dict, force: bool = False) -> None:
        """Push at most every METRIC_INTERVAL_S, and always once the engine drains, so a scrape
        after the last response sees the final counters instead of a value up to one interval old."""
        now = time.monotonic()
        ended = (s["finished"], s["aborted"])
        drained = s["running"] == 0 and s["waiting"] == 0 and ended != self._pushed_finished
        if not (force or drained) and now - self._last < METRIC_INTERVAL_S:
            return
        self._last = now
        self._pushed_finished = ended
        s = {**s, "slots_free": s["slots_total"] - s["slots_used"]}
        for key, metric in self.g.items():
            if key in self._counted:
                grown = float(s[key]) - self._counted[key]
                if grown > 0:
                    metric.increment(grown)
                    self._counted[key] = float(s[key])
            else:
                metric.set(float(s[key]))


class _Drain:
    """A drain requested by ``trtkv serve`` (SIGTERM): it writes the grace period into $TRTKV_DRAIN_FILE.
    Polled from the loop thread: once the file appears, no request is admitted; the requests in flight
    finish, or are failed with an error when the grace period ends; the outcome goes into FILE.done
    ("drained" or "failed N") and the log, and then serve stops tritonserver, whose models are idle."""

    POLL_S = 0.1

    def __init__(self, loop, logger):
        self.loop = loop
        self.logger = logger
        self.path = os.environ.get(DRAIN_FILE_ENV) or None
        self.deadline: float | None = None
        self.done = False
        self._next_poll = 0.0

    def poll(self) -> None:
        if self.path is None or self.done:
            return
        now = time.monotonic()
        if self.deadline is None:
            if now < self._next_poll:
                return
            self._next_poll = now + self.POLL_S
            try:  # serve renames the file into place whole; an empty or unreadable one is not a request (yet)
                grace = float(Path(self.path).read_text().strip())
            except (OSError, ValueError):
                return
            self.loop.stop_admitting()
            self.deadline = now + grace
            self.logger.log_info(f"trtkv: shutdown: draining, {self.loop.in_flight} requests in flight get {grace:g} s")
        if self.loop.in_flight and now < self.deadline:
            return
        failed = self.loop.fail_in_flight(SHUTDOWN_FAILURE) if self.loop.in_flight else 0
        outcome = f"failed {failed}" if failed else "drained"
        if failed:
            self.logger.log_warn(f"trtkv: shutdown: {failed} requests still running after the grace period were failed with an error")
        else:
            self.logger.log_info("trtkv: shutdown: drained, every request in flight finished")
        Path(self.path + ".done").write_text(outcome)
        self.done = True


class TritonPythonModel:
    def initialize(self, args):
        self.logger = pb_utils.Logger
        cfg = json.loads(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        engine_dir = Path(cfg["parameters"]["engine_dir"]["string_value"])
        if not engine_dir.is_absolute():
            engine_dir = version_dir / engine_dir
        try:  # the settings the repository wrote (trtkv.triton_repo.repository), validated before the engine loads
            config = RuntimeConfig.load(version_dir / RUNTIME_CONFIG)
        except TrtkvError as exc:
            self.logger.log_error(f"trtkv: {exc}")  # one line naming the file and the field, ahead of Triton's own report
            raise

        from trtkv.runtime.engine_loop import EngineLoop
        from trtkv.runtime.llm_engine import LLMEngine

        self.engine = LLMEngine.from_engine_dir(engine_dir, config)
        stats = self.engine.stats()
        self.logger.log_info(f"trtkv: {engine_dir} ({stats['kv_format']}): {self.engine.describe_cache()}")
        self.logger.log_info(f"trtkv: {self.engine.describe_engine()}")
        self.metrics = None
        try:
            self.metrics = _Metrics(self.engine.manifest.kv_format.name, args.get("model_instance_name", ""))
            self.metrics.update(stats, force=True)
        except Exception as exc:
            self.logger.log_warn(f"trtkv: custom metrics unavailable: {exc}")
        self._lock = threading.Lock()
        self._drain = None
        self.loop = EngineLoop(self.engine, on_step=self._on_step)
        self._drain = _Drain(self.loop, self.logger)

    def _on_step(self, stats: dict) -> None:
        if self._drain is not None:
            self._drain.poll()
        if self.metrics is not None:
            try:
                self.metrics.update(stats)
            except Exception as exc:
                self.logger.log_warn(f"trtkv: metrics update failed, disabled: {exc}")
                self.metrics = None

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = self._parse(request)
                rid = request.request_id() or uuid.uuid4().hex
                rid = f"{rid}-{uuid.uuid4().hex[:8]}"
                self.loop.submit(parsed.prompt, parsed.params, rid, self._callback(sender, parsed))
            except ShuttingDown as exc:  # draining: UNAVAILABLE (gRPC), so clients retry elsewhere; HTTP generate shows 400
                sender.send(pb_utils.InferenceResponse(error=_error(str(exc), code_name="UNAVAILABLE")), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except TrtkvError as exc:
                sender.send(pb_utils.InferenceResponse(error=_error(str(exc))), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:
                sender.send(
                    pb_utils.InferenceResponse(error=_error(f"internal error: {type(exc).__name__}: {exc}", invalid_arg=False)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
        return None

    def _parse(self, request) -> ParsedRequest:
        """Inputs -> ParsedRequest; a refused request is counted in ``trtkv_requests_total{state="rejected"}`` like a pool refusal."""
        try:
            check_parameters(request.parameters())
            return parse_request(lambda name, r=request: _get(r, name))
        except TrtkvError:
            with self.engine._reject_lock:
                self.engine.stats_counters["rejected"] += 1
            raise

    def _callback(self, sender, req: ParsedRequest):
        FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        logprobs: list[float] = []

        def on_output(out) -> bool:
            cancelled = getattr(sender, "is_cancelled", None)
            if cancelled is not None and cancelled():
                if not out.finished:
                    sender.send(flags=FINAL)
                return False
            if out.error is not None:  # a refusal at admission: INVALID_ARG (400); a shutdown: UNAVAILABLE (503); else INTERNAL
                code = "UNAVAILABLE" if out.error.startswith("the server is shutting down") else None
                sender.send(pb_utils.InferenceResponse(error=_error(out.error, invalid_arg=out.finish_reason == "error", code_name=code)), flags=FINAL)
                return False
            logprobs.extend(out.new_logprobs)
            if req.stream:
                # one response per generated token-step, even when its text is held back (a partial
                # UTF-8 character): clients count tokens and time them; the text follows with the next one
                if out.new_token_ids or out.new_text or out.finished:
                    resp = _response(out.new_text, out.new_logprobs, req.return_log_probs)
                    sender.send(resp, flags=FINAL if out.finished else 0)
            elif out.finished:
                text = out.text if req.exclude_input_in_output else req.prompt + out.text
                sender.send(_response(text, logprobs, req.return_log_probs), flags=FINAL)
            return True

        return on_output

    def finalize(self):
        """Shutdown (SIGTERM, unload): admit nothing new, let requests in flight finish within the grace
        period, fail the rest with an error response; one log line says which."""
        loop = getattr(self, "loop", None)
        if loop is not None:
            grace = float(os.environ.get(DRAIN_GRACE_ENV) or DEFAULT_DRAIN_GRACE_S)
            left = loop.drain(grace)
            if left:
                self.logger.log_warn(f"trtkv: shutdown: {left} requests still running after the {grace:g} s grace period were failed with an error")
            else:
                self.logger.log_info("trtkv: shutdown: drained, every request in flight finished")
            loop.stop()


PASSED_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout")  # Triton's own request fields


def check_parameters(text: str | None) -> None:
    """Refuse request parameters: the HTTP generate endpoints turn every JSON key that is not a declared
    input (``ignore_eos``, ``lora_task_id``, a typo) into one, which would otherwise be ignored silently."""
    try:
        params = json.loads(text or "{}")
    except ValueError:
        return
    unknown = sorted(k for k in params if not k.startswith("triton_") and k not in PASSED_PARAMETERS)
    if unknown:
        raise TrtkvError(
            f"unknown input{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: not part of the ensemble interface",
            "leave it out (see docs/serving.md for the inputs trtkv accepts)",
        )


def _get(request, name: str):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()
