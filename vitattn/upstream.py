"""The private attributes of Lightning, LitServe and timm that vitattn reaches, each behind one adapter.

Where a public API does the job, vitattn uses it instead (Lightning's ``Timer.time_remaining``,
OmegaConf's ``DictConfig.items_ex``); what is left has no public equivalent. Each adapter checks that
the attribute is still there and otherwise raises ``UpstreamChanged`` naming the library's version,
so that an upgrade breaks here, in one line, rather than deep inside a run; ``tests/test_upstream.py``
runs every adapter against the installed versions. This module imports only the standard library at
its top (the console entry points run ``defer_wandb_in_timm`` from here before anything imports timm).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import time
from importlib.metadata import version
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

__all__ = [
    "UpstreamChanged",
    "defer_wandb_in_timm",
    "request_sigterm_stop",
    "set_litserve_shutdown",
    "timm_url_cached",
]

_TIMM_SUMMARY = "timm.utils.summary"


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


def timm_url_cached(url: str) -> str | None:
    """The file where timm's loader keeps the weights at ``url`` (``TORCH_HOME``), or None when it is not there."""
    from timm.models import _hub  # timm's own cache lookup, private and without a public alias; see module doc

    check_cached_file = getattr(_hub, "check_cached_file", None)
    get_cache_dir = getattr(_hub, "get_cache_dir", None)
    if check_cached_file is None or get_cache_dir is None:
        raise UpstreamChanged("timm", "timm.models._hub.check_cached_file")
    if not check_cached_file(url, check_hash=False):
        return None
    return os.path.join(get_cache_dir(), os.path.basename(urlparse(url).path))


def defer_wandb_in_timm() -> None:
    """Keep ``import timm`` from importing wandb; timm's summary module gets wandb when it first uses it.

    Every ``import timm`` reaches ``timm.utils.summary``, which imports wandb, when installed, for timm's own
    training script (``update_summary(log_wandb=True)``): a large part of a short command's start-up
    (``docs/benchmarks.md``, "A first caption"), for a module vitattn never calls (its wandb logger is
    Lightning's, which imports wandb itself). While that one module runs, ``import wandb`` fails as if wandb
    were absent, which timm expects; the module's ``wandb`` name then imports wandb on first use. Does
    nothing once timm's summary or wandb is imported.

    It installs a ``sys.meta_path`` finder (removed once timm's summary is imported), so only a process's
    own entry point calls it: the console commands' ``main`` functions (``vitattn.cli``), never
    ``import vitattn``. A program that imports vitattn may call it first thing, for its own process.
    """
    if _TIMM_SUMMARY in sys.modules or "wandb" in sys.modules:
        return
    if not any(isinstance(finder, _TimmSummaryFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TimmSummaryFinder())


class _TimmSummaryFinder(importlib.abc.MetaPathFinder):
    """Finds ``timm.utils.summary`` as the other finders do, and wraps its loader in ``_WithoutWandb``."""

    def find_spec(self, name, path, target=None):
        if name != _TIMM_SUMMARY:
            return None
        sys.meta_path.remove(self)  # once: later imports of it come from sys.modules
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or "wandb" in sys.modules or importlib.util.find_spec("wandb") is None:
            return spec
        spec.loader = _WithoutWandb(spec.loader)
        return spec


class _WithoutWandb(importlib.abc.Loader):
    """Runs a module with ``import wandb`` raising ``ImportError``; binds its ``wandb`` to an import-on-use proxy."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        sys.modules["wandb"] = None  # the import system's "not importable" mark
        try:
            self._loader.exec_module(module)
        finally:
            if "wandb" in sys.modules and sys.modules["wandb"] is None:
                del sys.modules["wandb"]
        module.wandb = _ImportedOnUse("wandb")

    def __getattr__(self, name: str):  # get_source, get_filename, ... of the wrapped loader
        return getattr(self._loader, name)


class _ImportedOnUse:
    """Stands for a module and imports it at the first attribute asked of it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)
