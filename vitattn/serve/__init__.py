"""Captioning over HTTP on LitServe: ``POST /predict`` an image, get its caption (and its attention map).
``api`` holds the ``LitAPI``, ``server`` builds the ``LitServer``, ``stop`` drains it on SIGTERM / SIGINT."""

from vitattn.serve.api import CaptionAPI, decode_image_request
from vitattn.serve.server import build_server
from vitattn.serve.stop import GracefulStop

__all__ = ["CaptionAPI", "GracefulStop", "build_server", "decode_image_request"]
