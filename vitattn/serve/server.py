"""The ``LitServer`` of a model's routes (``POST /predict`` and ``/classify``; ``/embed`` of a ``head=coca`` model),
with the page of ``index.html`` at ``GET /`` and ``RequestBodies``."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from importlib.resources import files
from typing import Any

import litserve as ls
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.requests import ClientDisconnect, Request

from vitattn.bundle import LoadedModel
from vitattn.inference.embeddings import embedding_model
from vitattn.serve.api import BundleAPI, CaptionAPI
from vitattn.serve.embeddings import EMBEDDING_ROUTES, ClassifyAPI, EmbedAPI
from vitattn.serve.stop import GracefulStop

__all__ = ["INDEX_PAGE", "NOT_AN_IMAGE_BODY", "RequestBodies", "build_server", "serving_apis"]

INDEX_PAGE = "index.html"


def serving_apis(api: CaptionAPI, bundle: LoadedModel) -> tuple[list[BundleAPI], str | None]:
    """The routes of ``api``'s model, ``bundle`` (loaded once to look): ``/predict`` and ``/classify``, and ``/embed``
    with ``api``'s settings when it has embeddings; else the one line ``/embed`` answers 404 with, saying why."""
    keys = ("max_image_bytes", "num_threads", "precision", "merge_tokens", "max_batch_size", "batch_timeout")
    settings = {key: getattr(api, key) for key in keys}
    classify = ClassifyAPI(api.model_path, **settings)
    try:
        embedding_model(bundle, "POST /embed", f"model={api.model_path}")
    except ValueError as err:
        return [api, classify], str(err)
    return [api, EmbedAPI(api.model_path, **settings), classify], None


def build_server(
    apis: BundleAPI | Sequence[BundleAPI],
    *,
    refused: str | None = None,
    accelerator: str = "auto",
    devices: int | str = "auto",
    workers_per_device: int = 1,
    timeout: float = 60.0,
    stop: GracefulStop | None = None,
) -> ls.LitServer:
    """A ``LitServer`` for ``apis`` (``serving_apis``'), each on its own route, on ``accelerator`` (``auto``,
    ``cpu``, ``cuda``) and ``devices`` GPUs, ``workers_per_device`` model copies of each route each; a request waits
    ``timeout`` seconds before a 504. ``refused``: ``/embed`` (and ``/classify``), when not served, answer 404
    with it. ``stop``'s 503 gate goes in front of it all."""
    apis = [apis] if isinstance(apis, BundleAPI) else list(apis)
    server = ls.LitServer(
        apis, accelerator=accelerator, devices=devices, workers_per_device=workers_per_device, timeout=timeout
    )
    page = files("vitattn.serve").joinpath(INDEX_PAGE).read_text(encoding="utf-8")
    # LitServe answers GET / with "litserve running"; the page takes its place.
    server.app.router.routes = [r for r in server.app.router.routes if getattr(r, "path", None) != "/"]
    server.app.add_api_route("/", lambda: HTMLResponse(page), methods=["GET"], include_in_schema=False)
    served = [api.api_path for api in apis]
    for path in EMBEDDING_ROUTES:
        if path not in served and refused is not None:
            server.app.add_api_route(path, _not_found(refused), methods=["POST"], include_in_schema=False)
    server.app.add_middleware(RequestBodies, paths=served)
    if stop is not None:
        stop.attach(server)
    return server


def _not_found(line: str) -> Any:
    async def not_found() -> JSONResponse:
        return JSONResponse({"detail": line}, status_code=404)

    return not_found


NOT_AN_IMAGE_BODY = (
    "the body is neither a multipart form, JSON nor an image (Content-Type: image/...); "
    "send the image as a file field 'image'"
)


class RequestBodies:
    """ASGI middleware for ``POST`` to one of ``paths``: forms pass, raw images become the JSON LitServe parses (the
    query's fields, ``?attention=true`` or ``?labels=a,b``, beside the image), other non-JSON bodies get a 400 (not
    LitServe's 500); every other request passes through untouched."""

    def __init__(self, app: Any, paths: Sequence[str]) -> None:
        self.app = app
        self.paths = set(paths)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        request = Request(scope, receive)
        content_type = request.headers.get("content-type", "").lower()
        if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
            return await self.app(scope, receive, send)
        try:
            body = await request.body()
        except ClientDisconnect:  # nobody to answer
            return None
        if content_type.startswith(("image/", "application/octet-stream")):
            body = json.dumps({**request.query_params, "image": base64.b64encode(body).decode("ascii")}).encode("ascii")
            headers = MutableHeaders(scope=scope)
            headers["content-type"], headers["content-length"] = "application/json", str(len(body))
        else:
            try:
                json.loads(body)
            except ValueError:
                return await JSONResponse({"detail": NOT_AN_IMAGE_BODY}, status_code=400)(scope, receive, send)
        return await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive: Any) -> Any:
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict:  # the body once, then the client's own messages (a disconnect)
        return messages.pop() if messages else await receive()

    return replay
