"""ONNX folders (``vitattn-export format=onnx``): the ``onnx.json`` that describes one, and ``OnnxModel``, the
``LoadedModel`` that runs it on ONNX Runtime (on the CPU).

Dimension letters: B images, K beams, L decoder layers, H heads, d head width, P past positions,
N image tokens (fewer when the encoder merges them), V vocabulary, M patches (``data.max_patches`` models).

A caption folder holds ``encoder.onnx``, ``decoder_step.onnx`` and the tokenizer, a ``head=coca`` one also
``image_embed.onnx`` and ``text_embed.onnx``; a classifier, ``classifier.onnx``. Each graph's SHA-256 is checked
before ONNX Runtime reads it. A model trained with ``data.max_patches`` (version ``ONNX_PATCHES_VERSION``) takes
each image at its own grid, as timm's NaFlex ViT: ``PATCH_INPUTS`` in place of ``images``. The graphs' inputs and
outputs: ``onnx_export``; more in docs/captioning.md ("ONNX Runtime").
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from torch import Tensor

from vitattn.bundle.folder import LoadedModel, check_decoding, check_tokenizer, read_config, read_labels
from vitattn.data.preprocess import check_preprocess
from vitattn.errors import MissingDependencyError, brief, first_line
from vitattn.models import Embedder
from vitattn.models.generate import CaptionSearch, SpecialIds
from vitattn.models.vit import Patches

__all__ = [
    "CROSS_SIZE",
    "CROSS_VALID",
    "DECODER_KEYS",
    "OnnxCaptioner",
    "OnnxClassifier",
    "OnnxCocaCaptioner",
    "OnnxDecoderStep",
    "OnnxMemory",
    "OnnxModel",
    "GRAPHS",
    "ONNX_CONFIG_FILE",
    "ONNX_FORMAT",
    "ONNX_PATCHES_VERSION",
    "ONNX_VERSION",
    "ONNX_VERSIONS",
    "PATCH_INPUTS",
    "PRECISIONS",
    "check_onnx_config",
    "graph_file",
    "graph_names",
    "graph_path",
    "image_feed",
    "is_onnx_folder",
    "kv_names",
    "load_onnx_folder",
    "require_onnxruntime",
    "sha256",
]

log = logging.getLogger(__name__)

ONNX_FORMAT = "vitattn-onnx"
ONNX_VERSION = 2  # 2: cross-attention keys transposed and shared by the beams of an image
# 3: images at their own aspect ratio (``preprocess`` holds ``max_patches``): the image graphs take ``PATCH_INPUTS``,
# the decoder step ``CROSS_VALID``; an older vitattn, which would feed them square images, refuses the folder in one
# line. Square folders stay 2, which every vitattn since reads (as bundles: ``PATCHES_VERSION``).
ONNX_PATCHES_VERSION = 3
ONNX_VERSIONS = (ONNX_VERSION, ONNX_PATCHES_VERSION)
ONNX_CONFIG_FILE = "onnx.json"
PRECISIONS = ("fp32", "int8")
# the graphs of each kind of model (``graph_names``): a captioner, a head=coca one, a classifier
GRAPHS = {
    "caption": ("encoder", "decoder_step"),
    "coca": ("encoder", "decoder_step", "image_embed", "text_embed"),
    "classification": ("classifier",),
}
# ``encoder.onnx``'s output and ``decoder_step.onnx``'s input when the encoder merges tokens (ToMe): their sizes
CROSS_SIZE = "cross_size"
# ``encoder.onnx``'s output and ``decoder_step.onnx``'s input for images at their own grids: the (B, N) image tokens
# that are not padding, which the cross-attention masks (``Memory.valid``)
CROSS_VALID = "cross_valid"
# the image graphs' inputs for images at their own grids (timm NaFlex's names; ``Patches``): (B, M, P*P*C) float
# patches, (B, M, 2) int64 (row, column) in the image's grid, (B, M) bool validity (False: padding)
PATCH_INPUTS = ("patches", "patch_coord", "patch_valid")
DECODER_KEYS = ("depth", "num_heads", "head_dim", "max_len", "vocab_size", "pad_id", "bos_id", "eos_id")

_REEXPORT = "export it again with this vitattn: vitattn-export model=RUN format=onnx out=DIR"
_UPGRADE = f"; a newer vitattn wrote it: upgrade vitattn (pip install -U vitattn) to run it, or {_REEXPORT}"


def require_onnxruntime(export: bool = False) -> ModuleType:
    """The ``onnxruntime`` module (and, to ``export``, a check that ``onnx`` is there too), or a one-line
    ``MissingDependencyError`` saying how to install them."""
    for name in ("onnxruntime", "onnx") if export else ("onnxruntime",):
        try:
            importlib.import_module(name)  # an optional dependency: the ``onnx`` extra
        except ImportError:
            what = "ONNX folders need" if name == "onnxruntime" else "format=onnx needs"
            raise MissingDependencyError(
                f"{what} {name}, which is not installed: pip install -e '.[onnx]' (or pip install 'vitattn[onnx]')"
            ) from None
    return importlib.import_module("onnxruntime")


def kv_names(prefix: str, depth: int) -> list[str]:
    """Graph input or output names of L layers' keys and values: ``prefix_k.0, prefix_v.0, prefix_k.1, ...``."""
    return [f"{prefix}_{kv}.{i}" for i in range(depth) for kv in ("k", "v")]


def graph_names(task: str, model_config: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``GRAPHS`` of a folder of ``task`` whose model has ``model_config`` (a ``contrastive`` part: head=coca)."""
    return GRAPHS["coca" if task == "caption" and "contrastive" in model_config else task]


def graph_file(name: str) -> str:
    """The file name of graph ``name`` (one of ``GRAPHS``) in an ONNX folder."""
    return f"{name}.onnx"


def is_onnx_folder(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``vitattn-export format=onnx`` (it holds ``onnx.json``)."""
    return path.is_dir() and (path / ONNX_CONFIG_FILE).is_file()


def sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, as hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_onnx_config(directory: Path) -> dict[str, Any]:
    """``onnx.json`` of ``directory``, checked: format, version, task, preprocessing, decoder sizes, a head=coca
    model's embedding width and scale, and every graph's file and checksum. A one-line ``ValueError`` names the
    problem and the fix."""
    where = directory / ONNX_CONFIG_FILE
    config = read_config(where, "vitattn ONNX config", ONNX_FORMAT, ONNX_VERSIONS, f"; {_REEXPORT}", _UPGRADE)
    task = config["task"]
    if config.get("precision") not in PRECISIONS:
        raise ValueError(f"{where} has precision={brief(config.get('precision'))}; expected one of {list(PRECISIONS)}")
    config["preprocess"] = check_preprocess(config.get("preprocess"), f"{where}: preprocess")
    patches = config["preprocess"].get("max_patches") is not None
    if (config["version"] == ONNX_PATCHES_VERSION) != patches:  # the graphs' inputs follow the version
        needs = ONNX_PATCHES_VERSION if patches else ONNX_VERSION
        raise ValueError(
            f"{where} has version={config['version']} but its preprocess {'holds' if patches else 'has no'} "
            f"max_patches, which needs version {needs}; {_REEXPORT}"
        )
    if task == "caption":
        decoder = config.get("decoder") if isinstance(config.get("decoder"), Mapping) else {}
        bad = [k for k in DECODER_KEYS if not isinstance(decoder.get(k), int) or decoder[k] < 0]
        if bad:
            raise ValueError(f"{where}: decoder needs non-negative integers {list(DECODER_KEYS)}; {bad} are not")
        if "unk_id" not in decoder:
            raise ValueError(f"{where}: decoder has no unk_id; {_REEXPORT}")
        unk = decoder["unk_id"]
        if unk is not None and (not isinstance(unk, int) or isinstance(unk, bool) or unk < 0):
            raise ValueError(f"{where}: decoder.unk_id={brief(unk)} must be a non-negative integer or null")
    if not isinstance(config.get("model"), Mapping):
        raise ValueError(f"{where} has no 'model' mapping; {_REEXPORT}")
    names = graph_names(task, config["model"])
    if "image_embed" in names:
        embed = config.get("embed") if isinstance(config.get("embed"), Mapping) else {}
        dim, scale = embed.get("embed_dim"), embed.get("logit_scale")
        if not isinstance(dim, int) or dim < 1 or not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise ValueError(f"{where}: embed needs a positive integer embed_dim and a number logit_scale; {_REEXPORT}")
    graphs = config.get("graphs")
    if not isinstance(graphs, Mapping):
        raise ValueError(f"{where} has no 'graphs' mapping; {_REEXPORT}")
    for name in names:
        entry = graphs.get(name)
        if not isinstance(entry, Mapping) or not isinstance(entry.get("sha256"), str):
            raise ValueError(f"{where}: graphs.{name} needs 'file' and 'sha256'; {_REEXPORT}")
        path = graph_path(directory, config, name)
        if not path.is_file():
            raise FileNotFoundError(f"ONNX graph not found: {path}; {_REEXPORT}")
        if sha256(path) != entry["sha256"]:
            raise ValueError(
                f"{path} does not match the checksum in {where} (the graph was changed after export); {_REEXPORT}"
            )
    return config


def graph_path(directory: Path, config: Mapping[str, Any], name: str) -> Path:
    """The file of graph ``name`` (a file name inside ``directory``, nothing else)."""
    file = config["graphs"][name].get("file")
    if not isinstance(file, str) or Path(file).name != file or not file:
        raise ValueError(f"{directory / ONNX_CONFIG_FILE}: graphs.{name}.file={brief(file)} must be a file name")
    return directory / file


def _numpy(x: Tensor) -> np.ndarray:
    return x.detach().cpu().float().contiguous().numpy()


def image_feed(images: Tensor | Patches) -> dict[str, np.ndarray]:
    """An image graph's inputs: (B, C, height, width) square images as ``images``, or ``Patches`` (``batch_images``
    of the folder's ``eval_transform``, as the PyTorch runtime gets them) as ``PATCH_INPUTS``."""
    if isinstance(images, Patches):
        return dict(zip(PATCH_INPUTS, (_numpy(images.patches), _whole(images.coord), _whole(images.valid, bool))))
    return {"images": _numpy(images)}


def _whole(x: Tensor, dtype: type = np.int64) -> np.ndarray:
    return x.detach().cpu().numpy().astype(dtype)


class OnnxMemory(NamedTuple):
    """What ``decoder_step.onnx`` reads of B images, as ``encoder.onnx`` gives it: each decoder layer's cross-attention
    keys (B, H, d, N) and values (B, H, N, d); when the encoder merges tokens, their sizes (B, N), which the
    cross-attention weighs them by (None: unmerged); for images at their own grids, which tokens are not padding
    (B, N) (None: none padded), as ``Memory`` holds them for the PyTorch runtime."""

    cross: list[np.ndarray]
    sizes: np.ndarray | None = None
    valid: np.ndarray | None = None


class OnnxDecoderStep:
    """``decoder_step.onnx`` as a ``DecodeStep``, fed the past keys/values it returned last and ``encoder.onnx``'s
    ``memory``, a row per image; the first call's tokens say how many caption rows (K per image) there are."""

    def __init__(self, session: Any, memory: OnnxMemory) -> None:
        self.session = session
        depth = len(memory.cross) // 2
        _, self.num_heads, _, self.head_dim = memory.cross[1].shape
        self.feed = dict(zip(kv_names("cross", depth), memory.cross))
        if memory.sizes is not None:
            self.feed[CROSS_SIZE] = memory.sizes  # (B, N)
        if memory.valid is not None:
            self.feed[CROSS_VALID] = memory.valid  # (B, N)
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
    """An ONNX folder's caption model (its sessions, in ``graph_names`` order, and ``onnx.json``), decoded as
    ``ImageCaptioner``."""

    def __init__(self, sessions: Sequence[Any], config: Mapping[str, Any], other_ids: tuple[int, ...] = ()) -> None:
        self.encoder_session, self.step_session = sessions[:2]
        # what rides beside the keys and values (an output only where there is one): an encoder that merges tokens
        # passes their sizes along, one of a max_patches model which tokens are padding
        outputs = [output.name for output in self.encoder_session.get_outputs()]
        self.merged, self.padded = CROSS_SIZE in outputs, CROSS_VALID in outputs
        decoder = config["decoder"]
        self.max_len = decoder["max_len"]
        self.vocab_size = decoder["vocab_size"]
        ids = (decoder["pad_id"], decoder["bos_id"], decoder["eos_id"], decoder["unk_id"])
        self.special_ids = SpecialIds(*ids, other_ids)  # the tokenizer's other special tokens: never generated

    def encode(self, images: Tensor | Patches) -> OnnxMemory:
        """(B, C, height, width) or ``Patches`` -> the ``OnnxMemory`` of the images: cross-attention keys and
        values, token sizes or validity."""
        outputs = self.encoder_session.run(None, image_feed(images))
        if self.merged:
            return OnnxMemory(outputs[:-1], sizes=outputs[-1])
        return OnnxMemory(outputs[:-1], valid=outputs[-1]) if self.padded else OnnxMemory(outputs)

    def decode_step(self, memory: OnnxMemory, max_new_tokens: int, use_cache: bool = True) -> OnnxDecoderStep:
        """The ``DecodeStep`` over ``encode``'s output (it always caches: ``use_cache`` is PyTorch's)."""
        return OnnxDecoderStep(self.step_session, memory)

    def start_search(
        self, images: Tensor | Patches, max_new_tokens: int, num_beams: int, use_cache: bool
    ) -> tuple[OnnxDecoderStep, int, str]:
        memory = self.encode(images)
        return self.decode_step(memory, max_new_tokens), memory.cross[0].shape[0], "cpu"


class OnnxCocaCaptioner(Embedder, OnnxCaptioner):
    """An ONNX folder's head=coca model: ``OnnxCaptioner`` and, from ``image_embed.onnx`` and ``text_embed.onnx``,
    the image and text embeddings ``CocaCaptioner`` gives (``onnx.json``'s ``embed``: their width and scale)."""

    def __init__(self, sessions: Sequence[Any], config: Mapping[str, Any], other_ids: tuple[int, ...] = ()) -> None:
        super().__init__(sessions, config, other_ids)
        self.image_session, self.text_session = sessions[2:]
        self.embed_dim = config["embed"]["embed_dim"]
        self.logit_scale = torch.tensor([float(config["embed"]["logit_scale"])])  # (1,), as the model's parameter

    def embed_images(self, images: Tensor | Patches) -> Tensor:
        return torch.from_numpy(self.image_session.run(None, image_feed(images))[0])

    def embed_texts(self, tokens: Tensor) -> Tensor:
        return torch.from_numpy(self.text_session.run(None, {"tokens": tokens.cpu().numpy().astype(np.int64)})[0])


class OnnxClassifier:
    """An ONNX folder's classifier: ``model(images)`` (square images or ``Patches``) gives (B, num_classes) logits, as
    ``VisionTransformer``'s."""

    def __init__(self, session: Any, num_classes: int) -> None:
        self.session, self.num_classes = session, num_classes

    def __call__(self, images: Tensor | Patches) -> Tensor:
        return torch.from_numpy(self.session.run(None, image_feed(images))[0])


@dataclass
class OnnxModel(LoadedModel):
    """An ONNX folder loaded for inference, on the CPU; ``config`` is its ``onnx.json``."""

    runtime: ClassVar[str] = "onnx"
    model: OnnxCaptioner | OnnxCocaCaptioner | OnnxClassifier

    @property
    def device(self) -> torch.device:
        """The CPU: ONNX folders run on ONNX Runtime's CPU provider."""
        return torch.device("cpu")


def load_onnx_folder(directory: Path, device: str | torch.device = "cpu") -> OnnxModel:
    """An ONNX folder's model, run by ONNX Runtime on the CPU with torch's thread count. A missing onnxruntime, an
    ``onnx.json`` of another version, a graph changed after export or parts that disagree: one line naming the fix.
    """
    ort = require_onnxruntime()
    config = check_onnx_config(directory)
    where, task = directory / ONNX_CONFIG_FILE, config["task"]
    vocab, class_names = read_labels(directory, config, where)
    generate = config.get("generate") or {}
    if torch.device(device).type != "cpu":
        log.warning("%s runs on ONNX Runtime's CPU provider; device=%s is not used", directory, device)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()  # as many threads as the PyTorch runtime
    options.inter_op_num_threads = 1
    sessions = []
    names = graph_names(task, config["model"])
    for name in names:
        path = graph_path(directory, config, name)
        try:
            sessions.append(ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]))
        except Exception as err:  # noqa: BLE001 - onnxruntime raises its own error types for graphs it cannot run
            raise ValueError(
                f"{path} cannot be run by onnxruntime {ort.__version__}: {first_line(err)}; export it again with "
                "this vitattn (vitattn-export model=RUN format=onnx out=DIR) or install a newer onnxruntime"
            ) from None
    if task == "classification":
        model = OnnxClassifier(sessions[0], len(class_names))
    else:
        captioner = OnnxCocaCaptioner if "image_embed" in names else OnnxCaptioner
        model = captioner(sessions, config, vocab.other_special_ids)
        check_tokenizer(vocab, model.vocab_size, model.special_ids[:4], directory)
    check_decoding(model, task, generate, where)
    return OnnxModel(model, task, config["preprocess"], config, vocab, class_names, dict(generate), config["precision"])
