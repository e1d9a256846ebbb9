"""The private attributes of Lightning, LitServe and timm that vitattn reaches, each behind one adapter.

Each has no public equivalent; an adapter raises ``UpstreamChanged`` naming the library's version when the
attribute is gone, so an upgrade breaks here in one line (``tests/test_upstream.py`` runs each one).
"""

from __future__ import annotations

import os
import time
from importlib.metadata import version
from typing import Any
from urllib.parse import urlparse

__all__ = ["UpstreamChanged", "request_sigterm_stop", "set_litserve_shutdown", "timm_url_cached"]


class UpstreamChanged(RuntimeError):
    """A library no longer has the private attribute an adapter of this module relies on."""

    def __init__(self, library: str, what: str) -> None:
        super().__init__(
            f"{library} {version(library)} has no {what}; vitattn/upstream.py needs an update for this version"
        )


def request_sigterm_stop(trainer: Any, stop: bool) -> None:
    """Set or clear the flag Lightning's SIGTERM handler sets: training stops after the step under way."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or not hasattr(connector, "received_sigterm"):
        raise UpstreamChanged("lightning", "Trainer._signal_connector.received_sigterm")
    connector.received_sigterm = stop


def set_litserve_shutdown(server: Any, poll_s: float = 0.05) -> None:
    """End a running ``LitServer`` by the event its ``run`` waits on (its ``/shutdown`` route would let any
    client with the key stop it); waits until ``run`` has made the event."""
    if not hasattr(server, "_shutdown_event"):  # None from LitServer.__init__ until run() creates the event
        raise UpstreamChanged("litserve", "LitServer._shutdown_event")
    while server._shutdown_event is None:
        time.sleep(poll_s)
    server._shutdown_event.set()


def timm_url_cached(url: str) -> str | None:
    """The file where timm's loader keeps the weights at ``url`` (``TORCH_HOME``), or None when it is not there."""
    from timm.models import _hub  # timm's own cache lookup; only the weight import asks

    check_cached_file = getattr(_hub, "check_cached_file", None)
    get_cache_dir = getattr(_hub, "get_cache_dir", None)
    if check_cached_file is None or get_cache_dir is None:
        raise UpstreamChanged("timm", "timm.models._hub.check_cached_file")
    if not check_cached_file(url, check_hash=False):
        return None
    return os.path.join(get_cache_dir(), os.path.basename(urlparse(url).path))
