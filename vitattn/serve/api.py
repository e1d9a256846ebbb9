"""The captioning ``LitAPI`` and what every route of a model shares (``BundleAPI``): a request's image (what it may
be: docs/serving.md) becomes a tensor or a one-line reason; the good images of a batch are captioned together (a
``data.max_patches`` model's in groups of similar patch counts, ``length_groups``), bad ones answer HTTP 400 without
failing their batch.

Dimension letters: B batch, C channels, T' generated tokens; image sides are written out (height, width).
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import litserve as ls
import torch
from fastapi.responses import JSONResponse
from torch import Tensor

from vitattn.bundle import load_model
from vitattn.data.preprocess import ImagePatches, batch_images
from vitattn.inference.api import Captioner
from vitattn.inference.attention_maps import attention_figures, figure_png
from vitattn.inference.captioning import read_pixels
from vitattn.serve.stop import leave_interrupts_to_parent

__all__ = ["BundleAPI", "CaptionAPI", "ImageRequest", "decode_image_request", "length_groups", "MAX_PADDING"]

log = logging.getLogger(__name__)

# A generate call's padded share of its patch slots at most (issue 69's target for batches): LitServe fills a batch
# first come, first served, whatever the images' lengths, so a batch is captioned in groups of similar lengths.
MAX_PADDING = 0.1


@dataclass
class ImageRequest:
    """One decoded request: the (C, height, width) model input, or the one-line reason it could not be made."""

    image: Tensor | None = None
    error: str | None = None
    attention: bool = False


def length_groups(lengths: Sequence[int], max_padding: float = MAX_PADDING) -> list[list[int]]:
    """The indices of images of ``lengths`` patches in groups captioned together: longest first, each image joins
    the group before it while that group's padding (its slots beyond each image's own length, over all its slots)
    stays within ``max_padding``, else it starts the next. Equal lengths (square images): one group."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: request order among equals
        if groups:
            group, longest = groups[-1], lengths[groups[-1][0]]
            padded = sum(longest - lengths[j] for j in group) + longest - lengths[i]
            if padded <= max_padding * longest * (len(group) + 1):
                group.append(i)
                continue
        groups.append([i])
    return groups


def _length(image: Tensor | ImagePatches) -> int:
    return len(image.patches) if isinstance(image, ImagePatches) else 0  # a square image: all alike


def _is_upload(value: Any) -> bool:
    return hasattr(value, "file")  # a multipart upload (starlette UploadFile)


def _image_bytes(request: Any) -> bytes | str:
    """The bytes of the ``image`` field, else of the form's one file field (``curl -F file=@x.jpg``), or a one-line
    reason why there are none."""
    if not hasattr(request, "get"):
        return 'send the image as a multipart file field \'image\' or as JSON {"image": "<base64>"}'
    field = request.get("image")
    if field is None:
        pairs = request.multi_items() if hasattr(request, "multi_items") else request.items()  # a form repeats names
        uploads = [(name, value) for name, value in pairs if _is_upload(value)]
        if len(uploads) > 1:
            names = ", ".join(repr(name) for name, _ in uploads)
            return f"the form has files {names} and none named 'image'; send one file, or name it 'image'"
        field = uploads[0][1] if uploads else None
    if field is None:
        return (
            'the request has no \'image\' field; send a multipart file, JSON {"image": "<base64>"} '
            "or the raw image with Content-Type: image/..."
        )
    if _is_upload(field):
        field.file.seek(0)
        return field.file.read()
    if not isinstance(field, str):
        return "'image' must be a file or a base64 string"
    data = field.partition(",")[2] if field.startswith("data:") else field
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return "'image' is not valid base64"


def decode_image_request(request: Any, transform: Any, max_image_bytes: int) -> ImageRequest:
    """A request (form or JSON) -> an ``ImageRequest``, never raising: the image read as ``vitattn-caption``
    reads a file, with its reasons; one over ``max_image_bytes`` is refused unread.
    """
    flag = request.get("attention", "") if hasattr(request, "get") else ""
    attention = str(flag).strip().lower() in ("1", "true", "yes", "on")
    data = _image_bytes(request)
    if isinstance(data, bytes) and len(data) > max_image_bytes:
        data = f"image of {len(data)} bytes is over the limit of max_image_bytes={max_image_bytes}"
    pixels = data if isinstance(data, str) else read_pixels(io.BytesIO(data), transform)
    if isinstance(pixels, str):
        return ImageRequest(error=pixels, attention=attention)
    return ImageRequest(image=pixels, attention=attention)


class BundleAPI(ls.LitAPI):
    """What the routes of one model share: the ``model`` path (as ``load_model`` takes it, in ``precision`` and with
    ``merge_tokens``) loaded on one device in each inference worker, batches of decoded requests from LitServe
    (``max_batch_size``, ``batch_timeout`` seconds), images over ``max_image_bytes`` refused unread, torch's
    ``num_threads``, and a request's ``{"error"}`` answered 400 with its one line."""

    def __init__(
        self,
        model: str,
        max_image_bytes: int = 20_000_000,
        num_threads: int | None = None,
        precision: str = "auto",
        merge_tokens: int | Sequence[int] | None = None,
        max_batch_size: int = 8,
        batch_timeout: float = 0.05,
        api_path: str = "/predict",
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout, api_path=api_path)
        self.model_path = model
        self.max_image_bytes = max_image_bytes
        self.num_threads = num_threads
        self.precision = precision
        self.merge_tokens = merge_tokens

    def setup(self, device: str) -> None:
        leave_interrupts_to_parent()  # this runs in the inference worker: Ctrl+C is the parent's to handle
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        self.bundle = load_model(self.model_path, device, self.precision, self.merge_tokens)
        if self.bundle.task != "caption":
            raise ValueError(f"model={self.model_path} is a {self.bundle.task} model; serving needs a caption model")
        self.transform = self.bundle.transform

    # ``request`` stays unannotated: LitServe reads the annotation to choose what the endpoint parses
    def decode_request(self, request) -> ImageRequest:
        return decode_image_request(request, self.transform, self.max_image_bytes)

    def batch(self, inputs: list[Any]) -> list[Any]:
        return inputs

    def unbatch(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return output

    def encode_response(self, output: dict[str, Any]):  # no annotation: LitServe then returns a 400 as it is
        if "error" in output:
            return JSONResponse({"detail": output["error"]}, status_code=400)
        return output


class CaptionAPI(BundleAPI):
    """``POST /predict``: captions images with ``generate`` settings already resolved; the other arguments are
    ``BundleAPI``'s."""

    def __init__(self, model: str, generate: dict[str, Any] | None = None, **settings: Any) -> None:
        super().__init__(model, **settings)
        self.generate_kwargs = dict(generate or {})

    def setup(self, device: str) -> None:
        super().setup(device)
        self.captioner = Captioner(self.bundle)

    def predict(self, x: list[ImageRequest] | ImageRequest) -> list[dict[str, Any]] | dict[str, Any]:
        """Caption the batch's good images in one ``generate`` call; bad ones keep their reason."""
        requests = x if isinstance(x, list) else [x]
        outputs: list[dict[str, Any]] = [{"error": r.error} for r in requests]
        good = [i for i, r in enumerate(requests) if r.image is not None]
        if good:
            for i, result in zip(good, self._caption([requests[i] for i in good])):
                outputs[i] = result
        return outputs if isinstance(x, list) else outputs[0]

    def _caption(self, requests: list[ImageRequest]) -> list[dict[str, Any]]:
        """Each group of similar lengths (``length_groups``) in one ``generate`` call, answers in request order."""
        results: list[dict[str, Any]] = [{} for _ in requests]
        for group in length_groups([_length(r.image) for r in requests]):
            for i, result in zip(group, self._caption_group([requests[i] for i in group])):
                results[i] = result
        return results

    def _caption_group(self, requests: list[ImageRequest]) -> list[dict[str, Any]]:
        bundle = self.bundle
        images = batch_images([r.image for r in requests]).to(bundle.device)  # (B, C, height, width) or Patches
        captions, tokens = self.captioner.caption_pixels(images, **self.generate_kwargs)  # tokens (B, T')
        results = [{"caption": c, "tokens": bundle.vocab.tokens(row)} for c, row in zip(captions, tokens.tolist())]
        wanted = [i for i, r in enumerate(requests) if r.attention]
        if wanted and bundle.runtime != "torch":
            for i in wanted:
                results[i] = {
                    "error": "attention=true needs the PyTorch runtime; serve the bundle, not the ONNX folder"
                }
        elif wanted:
            titles = [captions[i] for i in wanted]
            shown = batch_images([requests[i].image for i in wanted]).to(bundle.device)  # images or Patches
            figures = attention_figures(bundle.model, shown, tokens[wanted], bundle.vocab, bundle.preprocess, titles)
            for i, fig in zip(wanted, figures):
                results[i]["attention"] = "data:image/png;base64," + base64.b64encode(figure_png(fig)).decode("ascii")
        return results
