"""One long-lived thread driving an ``LLMEngine`` for a server: submit from any thread, get callbacks per step.

``submit`` tokenizes and validates in the caller's thread (so a bad request fails at once), then hands
the sequence to the loop thread, which is the only thread that touches the scheduler, the cache and
the engine. Callbacks run on the loop thread, once per step in which a request produced something,
the last one with ``finished=True``; a callback returning ``False`` (the client went away) aborts
the request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from typing import Callable

from trtkv.errors import TrtkvError
from trtkv.runtime.llm_engine import LLMEngine, RequestOutput
from trtkv.runtime.sequence import SamplingParams

log = logging.getLogger(__name__)


class ShuttingDown(TrtkvError):
    """A request arrived while the loop drains (a server answers 503: retry elsewhere)."""
Callback = Callable[[RequestOutput], "bool | None"]


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[dict], None] | None = None, idle_wait: float = 0.05):
        self.engine = engine
        self.on_step = on_step
        self.idle_wait = idle_wait
        self._inbox: queue.Queue = queue.Queue()
        self._callbacks: dict[str, Callback] = {}
        self._stop = threading.Event()
        self._draining = False
        self._thread = threading.Thread(target=self._run, name="trtkv-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str, callback: Callback):
        """Validate and queue a request; raises ``TrtkvError`` (to send back as a 400) when it is invalid."""
        if self._draining:
            raise ShuttingDown("the server is shutting down and admits no new requests", "retry on another replica or after the restart")
        seq = self.engine.make_sequence(prompt, params, request_id)
        self._inbox.put(("add", seq, callback))
        return seq

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def stop_admitting(self) -> None:
        """From now on ``submit`` refuses requests ("the server is shutting down")."""
        self._draining = True

    @property
    def in_flight(self) -> int:
        return len(self._callbacks) + self._inbox.qsize()

    def fail_in_flight(self, message: str) -> int:
        """Fail every request in flight with ``message``; call on the loop thread (e.g. from ``on_step``). How many."""
        self._drain(block=False)
        n = len(self._callbacks)
        self._fail_all(message)
        return n

    def drain(self, grace: float) -> int:
        """Admit nothing new and let the requests in flight finish for up to ``grace`` seconds; how many are left."""
        self._draining = True
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.alive and (self._callbacks or not self._inbox.empty()):
            time.sleep(0.05)
        return len(self._callbacks)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ loop thread
    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, obj, cb = item
            if kind == "add":
                try:
                    self.engine.add_sequence(obj)
                    self._callbacks[obj.request_id] = cb
                except Exception as exc:
                    self._safe_call(cb, RequestOutput(obj.request_id, [], "", "", True, "error", error=str(exc)))
            elif kind == "abort":
                if self.engine.abort(obj):
                    self._callbacks.pop(obj, None)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _safe_call(self, cb: Callback | None, out: RequestOutput) -> bool:
        if cb is None:
            return True
        try:
            return cb(out) is not False
        except Exception:
            log.error("response callback failed:\n%s", traceback.format_exc())
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work())
            if not self.engine.has_work():
                self._report()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.error("engine step failed:\n%s", traceback.format_exc())
                self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                continue
            for out in outputs:
                cb = self._callbacks.get(out.request_id)
                keep = self._safe_call(cb, out)
                if out.finished:
                    self._callbacks.pop(out.request_id, None)
                elif not keep:
                    self.engine.abort(out.request_id)
                    self._callbacks.pop(out.request_id, None)
            self._report()
        self._fail_all("the server is shutting down")

    def _report(self) -> None:
        if self.on_step is None:
            return
        try:
            self.on_step(self.engine.stats())
        except Exception:
            log.error("on_step failed:\n%s", traceback.format_exc())

    def _fail_all(self, message: str) -> None:
        for rid, cb in list(self._callbacks.items()):
            self.engine.abort(rid)
            self._safe_call(cb, RequestOutput(rid, [], "", "", True, "internal", error=message))
        self._callbacks.clear()
