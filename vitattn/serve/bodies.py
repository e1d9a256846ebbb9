"""What a ``POST /predict`` body may be, before LitServe parses it.

LitServe parses a form or JSON; anything else fails inside it as a 500. This ASGI middleware lets forms
through, turns a raw image body (``curl --data-binary @x.jpg -H 'Content-Type: image/jpeg'``) into the
JSON ``{"image": "<base64>"}`` that ``decode_image_request`` reads (``?attention=true`` in the URL asks for
the attention figure), passes JSON on, and answers any other body with a 400 naming the problem.
"""

from __future__ import annotations

import base64
import json
from typing import Any
from urllib.parse import parse_qs

from fastapi.responses import JSONResponse

__all__ = ["NOT_AN_IMAGE_BODY", "RequestBodies"]

_FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
_RAW_TYPES = ("image/", "application/octet-stream")

NOT_AN_IMAGE_BODY = (
    "the body is neither a multipart form, JSON nor an image (Content-Type: image/...); "
    "send the image as a file field 'image'"
)


class RequestBodies:
    """ASGI middleware for ``POST`` to ``path``: forms pass, raw images become JSON, other non-JSON bodies
    get a 400; every other request passes through untouched."""

    def __init__(self, app: Any, path: str) -> None:
        self.app = app
        self.path = path

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        content_type = headers.get(b"content-type", b"").decode("latin-1").lower()
        if content_type.startswith(_FORM_TYPES):
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        if content_type.startswith(_RAW_TYPES):
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
    sent = False

    async def replay() -> dict:  # the body once, then the client's own messages (a disconnect)
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
