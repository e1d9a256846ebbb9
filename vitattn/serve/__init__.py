"""Serving over HTTP on LitServe: ``POST /predict`` an image, get its caption (and its attention map); a ``head=coca``
model also ``POST /embed`` and ``POST /classify``. ``api`` and ``embeddings`` hold the ``LitAPI``s, ``server`` builds
the ``LitServer``, ``stop`` drains it on SIGTERM / SIGINT."""

from vitattn.serve.api import BundleAPI, CaptionAPI, decode_image_request
from vitattn.serve.embeddings import ClassifyAPI, EmbedAPI
from vitattn.serve.server import build_server, serving_apis
from vitattn.serve.stop import GracefulStop

__all__ = [
    "BundleAPI",
    "CaptionAPI",
    "ClassifyAPI",
    "EmbedAPI",
    "GracefulStop",
    "build_server",
    "decode_image_request",
    "serving_apis",
]
