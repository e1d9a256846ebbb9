"""Captioning over HTTP on LitServe: ``POST /predict`` an image, get its caption (and its attention map).

``api`` holds the ``LitAPI`` (requests are batched across clients), ``server`` builds the ``LitServer`` with
the request bodies it accepts and the ``GET /`` page of ``index.html``, and ``stop`` makes SIGTERM / SIGINT
drain it and end every process it started.
"""

from vitattn.serve.api import CaptionAPI, decode_image_request
from vitattn.serve.server import build_server
from vitattn.serve.stop import GracefulStop

__all__ = ["CaptionAPI", "GracefulStop", "build_server", "decode_image_request"]
