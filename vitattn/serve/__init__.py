"""Captioning over HTTP on LitServe: ``POST /predict`` an image, get its caption (and its attention map).

``api`` holds the ``LitAPI`` (requests are batched across clients), ``server`` builds the ``LitServer``
with the ``GET /`` page of ``index.html``.
"""

from vitattn.serve.api import CaptionAPI, decode_image_request
from vitattn.serve.server import build_server

__all__ = ["CaptionAPI", "build_server", "decode_image_request"]
