"""A server that stops: SIGTERM or SIGINT lets the requests in flight finish, answers new ones 503, then ends
every process LitServe started, so that the port is free again; a second signal stops at once. Why and how:
docs/serving.md ("How the server stops").
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from vitattn.upstream import set_litserve_shutdown

__all__ = ["SHUTTING_DOWN", "GracefulStop", "leave_interrupts_to_parent"]

log = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down; send the request to another server or retry later"


def leave_interrupts_to_parent() -> None:
    """In a child process of the server, ignore SIGINT: Ctrl+C reaches the whole process group, and the
    parent must first let the requests in flight finish before it ends this process."""
    if mp.parent_process() is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class GracefulStop:
    """How a ``LitServer`` stops on SIGTERM / SIGINT: drain (requests in flight get ``timeout`` seconds), then
    ``end_server`` (in a thread of the parent; default: set LitServe's shutdown event).
    """

    def __init__(self, timeout: float, end_server: Callable[[Any], None] = set_litserve_shutdown) -> None:
        self.timeout = timeout
        self.end_server = end_server
        # shared with the forked API servers: read and written under one lock, so that a request either
        # counts as in flight before the parent reads the count or sees the flag and gets its 503
        self._lock = mp.Lock()
        self._draining = mp.RawValue("b", 0)
        self._in_flight = mp.RawValue("i", 0)
        self._pid: int | None = None
        self._server: Any = None
        self._previous: dict[int, Any] = {}

    def attach(self, server: Any) -> None:
        """Put the 503 gate in front of ``server``'s app (outermost: call after every other middleware)."""
        server.app.add_middleware(StopGate, stop=self)
        # seconds uvicorn and LitServe give an API server to close once nothing is in flight (LitServe's default: 30)
        server.uvicorn_graceful_timeout = 5.0  # public attribute; read by ``run``

    def serve(self, server: Any, **run_kwargs: Any) -> None:
        """``server.run(**run_kwargs)`` with SIGTERM and SIGINT stopping it cleanly; returns once it has stopped."""
        self._pid, self._server = os.getpid(), server
        self._previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        # Python's advice before forking: what exists now stays out of every later collection, so the
        # forked API servers share these pages, and the exit skips a seconds-long sweep of torch's objects.
        gc.freeze()
        try:
            server.run(**run_kwargs)
        finally:
            for s, handler in self._previous.items():
                signal.signal(s, handler)

    def enter(self) -> bool:
        """A request arrives: count it in flight and return True, or False while the server is stopping."""
        with self._lock:
            if self._draining.value:
                return False
            self._in_flight.value += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._in_flight.value -= 1

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight.value

    def begin(self, reason: str) -> None:
        """Refuse new requests from now on; end the server (in a thread) once none is in flight or at timeout."""
        with self._lock:
            self._draining.value = 1
        log.info(
            "%s: answering new requests 503, waiting for %d in flight (at most timeout=%g s), then stopping",
            reason,
            self.in_flight(),
            self.timeout,
        )
        threading.Thread(target=self._drain_then_end, name="vitattn-stop", daemon=True).start()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a forked child inherited this handler: do what it did before
            return self._as_before(signum, frame)
        name = signal.Signals(signum).name
        if not self._draining.value:
            return self.begin(name)
        log.warning("%s again: stopping without waiting for requests in flight", name)
        raise KeyboardInterrupt  # LitServe then ends its processes at once

    def _as_before(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def _drain_then_end(self) -> None:
        deadline = time.monotonic() + self.timeout + 1.0  # LitServe's 504 comes at timeout; 1 s to write it
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.in_flight():
            log.warning("%d requests still in flight; stopping anyway", self.in_flight())
        self.end_server(self._server)


class StopGate:
    """ASGI middleware: counts the requests in flight for ``GracefulStop`` and answers 503 while it stops."""

    def __init__(self, app: Any, stop: GracefulStop) -> None:
        self.app = app
        self.stop = stop

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # once per API server process, as it starts
            leave_interrupts_to_parent()
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.stop.enter():
            refusal = JSONResponse({"detail": SHUTTING_DOWN}, status_code=503, headers={"Connection": "close"})
            return await refusal(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            self.stop.leave()
