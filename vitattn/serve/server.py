"""The ``LitServer`` of a ``CaptionAPI``, with ``GET /`` serving the page of ``index.html``."""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

import litserve as ls
from fastapi.responses import HTMLResponse, JSONResponse

from vitattn.serve.api import CaptionAPI

__all__ = ["INDEX_PAGE", "build_server"]

INDEX_PAGE = "index.html"

_FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


def build_server(
    api: CaptionAPI,
    *,
    accelerator: str = "auto",
    devices: int | str = "auto",
    workers_per_device: int = 1,
    timeout: float = 60.0,
) -> ls.LitServer:
    """A ``LitServer`` for ``api``: ``POST /predict``, ``GET /health``, and ``GET /`` the captioning page.

    Args:
        api: the captioning API (its batching settings are its own).
        accelerator: ``auto``, ``cpu`` or ``cuda``.
        devices: GPUs to use (a number or ``auto``); ignored on the CPU.
        workers_per_device: model copies per device, each with its own batches.
        timeout: seconds a request may wait for its answer before a 504.
    """
    server = ls.LitServer(
        api, accelerator=accelerator, devices=devices, workers_per_device=workers_per_device, timeout=timeout
    )
    page = files("vitattn.serve").joinpath(INDEX_PAGE).read_text(encoding="utf-8")
    # LitServe answers GET / with "litserve running"; the page takes its place.
    server.app.router.routes = [r for r in server.app.router.routes if getattr(r, "path", None) != "/"]
    server.app.add_api_route("/", lambda: HTMLResponse(page), methods=["GET"], include_in_schema=False)
    server.app.add_middleware(JSONBodyCheck, path=api.api_path)
    return server


class JSONBodyCheck:
    """ASGI middleware: a ``POST`` to ``path`` that is not a form and not JSON gets a 400 naming the problem
    (LitServe would answer it with a 500); every other request passes through untouched."""

    def __init__(self, app: Any, path: str) -> None:
        self.app = app
        self.path = path

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            return await self.app(scope, receive, send)
        content_type = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
        if content_type.startswith(_FORM_TYPES):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            json.loads(body)
        except ValueError:
            reason = "the body is neither a multipart form nor JSON; send the image as a file field 'image'"
            return await JSONResponse({"detail": reason}, status_code=400)(scope, receive, send)

        sent = False

        async def replay() -> dict:  # the body once, then the client's own messages (a disconnect)
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)
