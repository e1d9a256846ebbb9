"""The ``LitServer`` of a ``CaptionAPI``, with the page of ``index.html`` at ``GET /`` and ``RequestBodies``."""

from __future__ import annotations

import base64
import json
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs

import litserve as ls
from fastapi.responses import HTMLResponse, JSONResponse

from vitattn.serve.api import CaptionAPI
from vitattn.serve.stop import GracefulStop

__all__ = ["INDEX_PAGE", "NOT_AN_IMAGE_BODY", "RequestBodies", "build_server"]

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
    """A ``LitServer`` for ``api`` on ``accelerator`` (``auto``, ``cpu``, ``cuda``) and ``devices`` GPUs,
    ``workers_per_device`` model copies each; a request waits ``timeout`` seconds before a 504. ``stop``'s 503
    gate goes in front of it all."""
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


NOT_AN_IMAGE_BODY = (
    "the body is neither a multipart form, JSON nor an image (Content-Type: image/...); "
    "send the image as a file field 'image'"
)


class RequestBodies:
    """ASGI middleware for ``POST`` to ``path``: forms pass, raw images become the JSON LitServe parses, other
    non-JSON bodies get a 400 (not LitServe's 500); every other request passes through untouched."""

    def __init__(self, app: Any, path: str) -> None:
        self.app = app
        self.path = path

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        content_type = headers.get(b"content-type", b"").decode("latin-1").lower()
        if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        if content_type.startswith(("image/", "application/octet-stream")):
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            fields = {"image": base64.b64encode(body).decode("ascii")}
            if "attention" in query:
                fields["attention"] = query["attention"][-1]
            body = json.dumps(fields).encode("ascii")
            scope = {**scope, "headers": _as_json(scope["headers"], len(body))}
        else:
            try:
                json.loads(body)
            except ValueError:
                return await JSONResponse({"detail": NOT_AN_IMAGE_BODY}, status_code=400)(scope, receive, send)
        return await self.app(scope, _replay(body, receive), send)


async def _read_body(receive: Any) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def _as_json(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in headers if k.lower() not in (b"content-type", b"content-length")]
    return [*kept, (b"content-type", b"application/json"), (b"content-length", str(length).encode())]


def _replay(body: bytes, receive: Any) -> Any:
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict:  # the body once, then the client's own messages (a disconnect)
        return messages.pop() if messages else await receive()

    return replay
