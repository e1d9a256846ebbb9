"""Image and text embeddings of a ``head=coca`` model (an ``Embedder``: a ``CocaCaptioner`` or its ONNX folder), for
zero-shot classification and retrieval: which loaded models have them, and texts tokenised for the text tower with
every cut counted.

Dimension letters: B images, N texts, T tokens, E embedding width; image sides are written out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from vitattn.bundle import LoadedModel
from vitattn.data.tokenizer import Tokenizer
from vitattn.models import Embedder
from vitattn.precision import precision_autocast

__all__ = ["embed_pixels", "embed_texts", "embedding_model", "encode_texts"]

log = logging.getLogger(__name__)


def embedding_model(bundle: LoadedModel, what: str, where: str = "this") -> Embedder:
    """The ``Embedder`` of ``bundle`` (a ``head=coca`` model, PyTorch or ONNX), or a one-line ``ValueError`` saying
    why ``what`` (e.g. "zero-shot classification") cannot run on it: a classifier, a ``head=caption`` captioner."""
    if bundle.task == "classification":
        raise ValueError(
            f"{where} is a classification model, which has no text embeddings; {what} needs a head=coca model"
        )
    if not isinstance(bundle.model, Embedder):
        folder = " (an ONNX folder of the captioner only)" if bundle.runtime != "torch" else ""
        raise ValueError(
            f"{where} is a head=caption model{folder} without image and text embeddings; {what} needs a head=coca model"
        )
    return bundle.model


def encode_texts(vocab: Tokenizer, texts: Sequence[str], max_len: int) -> Tensor:
    """(N, T) ids of ``texts``, ``<bos> ... <eos>`` right-padded, T <= ``max_len`` (the decoder's). Longer texts are
    cut to ``max_len`` tokens (their last words dropped, ``<eos>`` kept), with a warning that counts them."""
    if not texts:
        return torch.empty(0, 2, dtype=torch.long)
    full = [vocab.encode(text) for text in texts]
    cut = sum(len(ids) > max_len for ids in full)
    if cut:
        log.warning(
            "%d of %d texts are longer than the decoder's max_len=%d tokens (<bos> and <eos> included); their last "
            "words were cut",
            cut,
            len(texts),
            max_len,
        )
    rows = [torch.tensor(ids if len(ids) <= max_len else [*ids[: max_len - 1], vocab.eos_id]) for ids in full]
    return pad_sequence(rows, batch_first=True, padding_value=vocab.pad_id)  # (N, T)


def embed_texts(bundle: LoadedModel, texts: Sequence[str], batch_size: int = 256) -> Tensor:
    """(N, E) unit-length embeddings of ``texts``, on the CPU in fp32 (``encode_texts`` warns of any cut)."""
    model = embedding_model(bundle, "embedding texts")
    tokens = encode_texts(bundle.vocab, texts, model.max_len)  # (N, T)
    with torch.inference_mode(), precision_autocast(bundle.precision, bundle.device):
        rows = [
            model.embed_texts(tokens[i : i + batch_size].to(bundle.device)).float().cpu()
            for i in range(0, len(tokens), batch_size)
        ]
    return torch.cat(rows) if rows else torch.empty(0, model.embed_dim)


def embed_pixels(bundle: LoadedModel, pixels: Tensor) -> Tensor:
    """(B, C, height, width) model inputs -> (B, E) unit-length image embeddings, on the CPU in fp32."""
    model = embedding_model(bundle, "embedding images")
    with torch.inference_mode(), precision_autocast(bundle.precision, bundle.device):
        return model.embed_images(pixels.to(bundle.device)).float().cpu()
