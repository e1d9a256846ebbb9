"""The ``LitServer`` of a ``CaptionAPI``, with ``GET /`` serving the page of ``index.html``."""

from __future__ import annotations

from importlib.resources import files

import litserve as ls
from fastapi.responses import HTMLResponse

from vitattn.serve.api import CaptionAPI
from vitattn.serve.bodies import RequestBodies
from vitattn.serve.stop import GracefulStop

__all__ = ["INDEX_PAGE", "build_server"]

INDEX_PAGE = "index.html"


def build_server(
    api: CaptionAPI,
    *,
    accelerator: str = "auto",
    devices: int | str = "auto",
    workers_per_device: int = 1,
    timeout: float = 60.0,
    stop: GracefulStop | None = None,
) -> ls.LitServer:
    """A ``LitServer`` for ``api``: ``POST /predict``, ``GET /health``, and ``GET /`` the captioning page.

    Args:
        api: the captioning API (its batching settings are its own).
        accelerator: ``auto``, ``cpu`` or ``cuda``.
        devices: GPUs to use (a number or ``auto``); ignored on the CPU.
        workers_per_device: model copies per device, each with its own batches.
        timeout: seconds a request may wait for its answer before a 504.
        stop: what SIGTERM / SIGINT do (``stop.serve(server, ...)`` runs it): its 503 gate goes in front.
    """
    server = ls.LitServer(
        api, accelerator=accelerator, devices=devices, workers_per_device=workers_per_device, timeout=timeout
    )
    page = files("vitattn.serve").joinpath(INDEX_PAGE).read_text(encoding="utf-8")
    # LitServe answers GET / with "litserve running"; the page takes its place.
    server.app.router.routes = [r for r in server.app.router.routes if getattr(r, "path", None) != "/"]
    server.app.add_api_route("/", lambda: HTMLResponse(page), methods=["GET"], include_in_schema=False)
    server.app.add_middleware(RequestBodies, path=api.api_path)
    if stop is not None:
        stop.attach(server)
    return server
