"""The private attributes of Lightning, LitServe and timm that vitattn reaches, each behind one adapter.

Where a public API does the job, vitattn uses it instead (Lightning's ``Timer.time_remaining``,
OmegaConf's ``DictConfig.items_ex``); what is left has no public equivalent. Each adapter checks that
the attribute is still there and otherwise raises ``UpstreamChanged`` naming the library's version,
so that an upgrade breaks here, in one line, rather than deep inside a run; ``tests/test_upstream.py``
runs every adapter against the installed versions. This module imports only third-party code, and
not Lightning (the inference side, which uses the timm adapter, does without it).
"""

from __future__ import annotations

import time
from importlib.metadata import version
from typing import Any

try:  # timm's own cache lookup for URL weights; private (timm.models._hub) and without a public alias
    from timm.models._hub import check_cached_file as _timm_check_cached_file
except ImportError:
    _timm_check_cached_file = None

__all__ = ["UpstreamChanged", "request_sigterm_stop", "set_litserve_shutdown", "timm_url_cached"]


class UpstreamChanged(RuntimeError):
    """A library no longer has the private attribute an adapter of this module relies on."""

    def __init__(self, library: str, what: str) -> None:
        super().__init__(
            f"{library} {version(library)} has no {what}; vitattn/upstream.py needs an update for this version"
        )


def request_sigterm_stop(trainer: Any, stop: bool) -> None:
    """Set or clear the flag Lightning's SIGTERM handler sets, as if the signal had (not) arrived.

    The training loop then raises ``SIGTERMException`` at the end of the step under way, the evaluation
    loop after its batch; ``trainer.received_sigterm`` (public, read-only) reads the flag back.
    """
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or not hasattr(connector, "received_sigterm"):
        raise UpstreamChanged("lightning", "Trainer._signal_connector.received_sigterm")
    connector.received_sigterm = stop


def set_litserve_shutdown(server: Any, poll_s: float = 0.05) -> None:
    """End a running ``LitServer``: set the shutdown event that ``LitServer.run`` waits on, once ``run`` has made it.

    LitServe then stops its API servers, inference workers and manager. Its public route, the
    ``/shutdown`` endpoint, would let any client with the key stop the server.
    """
    if not hasattr(server, "_shutdown_event"):  # None from LitServer.__init__ until run() creates the event
        raise UpstreamChanged("litserve", "LitServer._shutdown_event")
    while server._shutdown_event is None:
        time.sleep(poll_s)
    server._shutdown_event.set()


def timm_url_cached(url: str) -> bool:
    """Whether timm's loader would find the weights at ``url`` in its cache (``TORCH_HOME``), without the hub."""
    if _timm_check_cached_file is None:
        raise UpstreamChanged("timm", "timm.models._hub.check_cached_file")
    return bool(_timm_check_cached_file(url, check_hash=False))
