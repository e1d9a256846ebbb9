"""An ONNX folder (``vitattn-export format=onnx``) run by ONNX Runtime: ``OnnxModel``, the ``onnx`` runtime of
``vitattn.bundle.runtime.LoadedModel`` (``vitattn.bundle.Bundle`` is the other).

Dimension letters: B images, K beams, L decoder layers, H heads, d head width, P past positions,
N image tokens, V vocabulary, T' generated tokens.

``OnnxCaptioner.generate`` takes ``ImageCaptioner.generate``'s arguments and decodes with the same
search loops (``vitattn.models.search``); only the step differs: ``OnnxDecoderStep`` runs
``decoder_step.onnx`` with the past keys/values it keeps. The cross-attention keys/values come from
``encoder.onnx``, once per image; the step graph shares them among the K beams of an image.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vitattn.bundle.onnx_folder import ONNX_CONFIG_FILE, check_onnx_config, graph_path, kv_names, require_onnxruntime
from vitattn.bundle.runtime import LoadedModel
from vitattn.data.tokenizer import load_tokenizer
from vitattn.errors import brief, first_line
from vitattn.models.search import CaptionSearch, SpecialIds
from vitattn.run_dir import VOCAB_FILE

__all__ = ["OnnxCaptioner", "OnnxClassifier", "OnnxDecoderStep", "OnnxModel", "load_onnx_folder"]

log = logging.getLogger(__name__)


def _numpy(x: Tensor) -> np.ndarray:
    return x.detach().cpu().float().contiguous().numpy()


class OnnxDecoderStep:
    """``decoder_step.onnx`` as a ``DecodeStep``: it feeds the past keys/values of the previous call and
    keeps the present ones it returns.

    Args:
        session: the decoder step's ``InferenceSession``.
        cross: 2L arrays, ``encoder.onnx``'s: each layer's cross-attention keys (B, H, d, N) and values
            (B, H, N, d), one row per image; the first call's tokens say how many caption rows (K per
            image, consecutive) there are.
    """

    def __init__(self, session: Any, cross: Sequence[np.ndarray]) -> None:
        self.session = session
        depth = len(cross) // 2
        _, self.num_heads, _, self.head_dim = cross[1].shape
        self.feed = dict(zip(kv_names("cross", depth), cross))
        self.past_names = kv_names("past", depth)
        self.past: list[np.ndarray] | None = None  # (B * K, H, P, d) each, from the first call

    def __call__(self, tokens: Tensor) -> Tensor:
        if self.past is None:
            empty = np.zeros((tokens.shape[0], self.num_heads, 0, self.head_dim), dtype=np.float32)
            self.past = [empty] * len(self.past_names)
        feed = {**self.feed, **dict(zip(self.past_names, self.past))}
        feed["tokens"] = tokens[:, -1:].cpu().numpy().astype(np.int64)  # (B, 1)
        logits, *self.past = self.session.run(None, feed)
        return torch.from_numpy(logits)  # (B, V)

    def reorder(self, index: Tensor) -> None:
        rows = index.cpu().numpy()
        self.past = [p[rows] for p in self.past]


class OnnxCaptioner(CaptionSearch):
    """An ONNX folder's caption model, decoded by ``CaptionSearch`` as ``ImageCaptioner`` is.

    Args:
        encoder: ``encoder.onnx``'s session.
        step: ``decoder_step.onnx``'s session.
        decoder: ``onnx.json``'s ``decoder`` sizes and special ids (``unk_id`` optional).
    """

    def __init__(self, encoder: Any, step: Any, decoder: Mapping[str, int]) -> None:
        self.encoder_session, self.step_session = encoder, step
        self.max_len = decoder["max_len"]
        self.vocab_size = decoder["vocab_size"]
        self.special_ids = SpecialIds(decoder["pad_id"], decoder["bos_id"], decoder["eos_id"], decoder.get("unk_id"))

    def encode(self, images: Tensor) -> list[np.ndarray]:
        """(B, C, height, width) -> 2L arrays: each decoder layer's cross-attention keys (B, H, d, N) and values
        (B, H, N, d)."""
        return self.encoder_session.run(None, {"images": _numpy(images)})

    def decode_step(self, cross: Sequence[np.ndarray], max_new_tokens: int, use_cache: bool = True) -> OnnxDecoderStep:
        """The ``DecodeStep`` over ``encode``'s output, for K caption rows per image (the step always
        caches: ``use_cache`` is PyTorch's)."""
        return OnnxDecoderStep(self.step_session, cross)

    def start_search(
        self, images: Tensor, max_new_tokens: int, num_beams: int, use_cache: bool
    ) -> tuple[OnnxDecoderStep, int, str]:
        """``CaptionSearch.start_search``: ``decoder_step.onnx`` over ``encoder.onnx``'s keys/values."""
        cross = self.encode(images)
        return self.decode_step(cross, max_new_tokens), cross[0].shape[0], "cpu"


class OnnxClassifier:
    """An ONNX folder's classifier: ``model(images)`` gives (B, num_classes) logits, as ``VisionTransformer``'s."""

    def __init__(self, session: Any, num_classes: int) -> None:
        self.session, self.num_classes = session, num_classes

    def __call__(self, images: Tensor) -> Tensor:
        return torch.from_numpy(self.session.run(None, {"images": _numpy(images)})[0])


@dataclass
class OnnxModel(LoadedModel):
    """An ONNX folder loaded for inference: the ``onnx`` runtime of ``LoadedModel``, on the CPU.

    Attributes:
        model: ``OnnxCaptioner`` (caption) or ``OnnxClassifier`` (classification).
        config: the whole ``onnx.json`` content; the other fields as ``LoadedModel``'s.
        precision: what the folder was exported in, ``fp32`` or ``int8`` (never autocast).
    """

    model: OnnxCaptioner | OnnxClassifier

    @property
    def runtime(self) -> str:
        """``onnx``."""
        return "onnx"

    @property
    def device(self) -> torch.device:
        """The CPU: ONNX folders run on ONNX Runtime's CPU provider."""
        return torch.device("cpu")


def load_onnx_folder(directory: Path, device: str | torch.device = "cpu") -> OnnxModel:
    """An ONNX folder's model, run by ONNX Runtime on the CPU with torch's thread count.

    Raises:
        MissingDependencyError: onnxruntime is not installed (the message says how to install it).
        ValueError: ``onnx.json`` is from another format version, a graph was changed after export, or
            the parts disagree (each a one-line message naming the fix).
    """
    ort = require_onnxruntime()
    config = check_onnx_config(directory)
    if torch.device(device).type != "cpu":
        log.warning("%s runs on ONNX Runtime's CPU provider; device=%s is not used", directory, device)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()  # as many threads as the PyTorch runtime
    options.inter_op_num_threads = 1
    sessions = {}
    for name in ("encoder", "decoder_step") if config["task"] == "caption" else ("classifier",):
        path = graph_path(directory, config, name)
        try:
            sessions[name] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as err:  # noqa: BLE001 - onnxruntime raises its own error types for graphs it cannot run
            raise ValueError(
                f"{path} cannot be run by onnxruntime {ort.__version__}: {first_line(err)}; export it again with "
                "this vitattn (vitattn-export model=RUN format=onnx out=DIR) or install a newer onnxruntime"
            ) from None
    preprocess, generate = config["preprocess"], dict(config.get("generate") or {})
    if config["task"] == "classification":
        names = config.get("class_names")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{directory / ONNX_CONFIG_FILE} has no 'class_names' list of strings")
        model = OnnxClassifier(sessions["classifier"], len(names))
        return OnnxModel(model, "classification", preprocess, config, None, names, generate, config["precision"])
    name = config.get("vocab_file", VOCAB_FILE)
    if not isinstance(name, str) or Path(name).name != name or not name:
        raise ValueError(
            f"{directory / ONNX_CONFIG_FILE} has vocab_file={brief(name)}; it must be a file name inside the folder"
        )
    vocab = load_tokenizer(directory / name)
    decoder = {"unk_id": vocab.unk_id, **config["decoder"]}  # a folder written before unk_id: its vocabulary's
    ids = (vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.unk_id)
    if len(vocab) != decoder["vocab_size"] or ids != tuple(decoder[f"{k}_id"] for k in ("pad", "bos", "eos", "unk")):
        raise ValueError(
            f"{directory}: the tokenizer {name} ({len(vocab)} tokens, special ids {ids}) does not fit the decoder "
            f"(vocab_size={decoder['vocab_size']}); export the folder again"
        )
    model = OnnxCaptioner(sessions["encoder"], sessions["decoder_step"], decoder)
    try:
        model.check_generate(
            **{k: v for k, v in generate.items() if k in inspect.signature(model.check_generate).parameters}
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"{directory / ONNX_CONFIG_FILE}: generate: {first_line(err)}") from None
    return OnnxModel(model, "caption", preprocess, config, vocab, None, generate, config["precision"])
