"""ONNX folders: a model exported for ONNX Runtime, and the ``onnx.json`` that describes it.

A caption folder holds ``encoder.onnx`` (images -> each decoder layer's cross-attention keys,
transposed, and values, computed once per image), ``decoder_step.onnx`` (one token per caption row,
the past self-attention keys and values, and the cross ones once per image for the K beam rows of each
-> the next token's logits and the keys and values with that token added) and ``vocab.json``; a
classification folder holds ``classifier.onnx`` (images -> logits)::

    {"format": "vitattn-onnx", "version": 2, "runtime": "onnx", "task": "caption", "precision": "fp32",
     "preprocess": {...}, "generate": {"num_beams": 3}, "vocab_file": "vocab.json",
     "decoder": {"depth": 2, "num_heads": 4, "head_dim": 64, "max_len": 32, "vocab_size": 5000,
                 "pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3},
     "graphs": {"encoder": {"file": "encoder.onnx", "sha256": "..."}, "decoder_step": {...}},
     "model": {...}, "vitattn_version": "0.1.0", "opset": 17}

Each graph's SHA-256 is checked before ONNX Runtime reads it: a graph changed after export is refused.
``decoder.unk_id`` (null: a vocabulary without an unknown token) is optional: a folder written before it
was added takes its vocabulary's.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from vitattn.data.preprocess import check_preprocess
from vitattn.errors import MissingDependencyError, brief
from vitattn.fileio import read_json
from vitattn.models import TASKS

__all__ = [
    "DECODER_KEYS",
    "GRAPHS",
    "ONNX_CONFIG_FILE",
    "ONNX_FORMAT",
    "ONNX_VERSION",
    "PRECISIONS",
    "check_onnx_config",
    "graph_file",
    "graph_path",
    "is_onnx_folder",
    "kv_names",
    "require_onnxruntime",
    "sha256",
]

ONNX_FORMAT = "vitattn-onnx"
ONNX_VERSION = 2  # 2: cross-attention keys transposed and shared by the beams of an image
ONNX_CONFIG_FILE = "onnx.json"
PRECISIONS = ("fp32", "int8")
GRAPHS = {"caption": ("encoder", "decoder_step"), "classification": ("classifier",)}
DECODER_KEYS = ("depth", "num_heads", "head_dim", "max_len", "vocab_size", "pad_id", "bos_id", "eos_id")

_REEXPORT = "export it again with this vitattn: vitattn-export model=RUN format=onnx out=DIR"


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


def graph_file(name: str) -> str:
    """The file name of graph ``name`` (one of ``GRAPHS``) in an ONNX folder."""
    return f"{name}.onnx"


def is_onnx_folder(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``vitattn-export format=onnx`` (it holds ``onnx.json``)."""
    return path.is_dir() and (path / ONNX_CONFIG_FILE).is_file()


def sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_onnx_config(directory: Path) -> dict[str, Any]:
    """``onnx.json`` of ``directory``, checked: format, version, task, preprocessing, decoder sizes and
    every graph's file and checksum. A one-line ``ValueError`` names the problem and the fix."""
    where = directory / ONNX_CONFIG_FILE
    config = read_json(where, "ONNX folder config")
    if not isinstance(config, dict) or config.get("format") != ONNX_FORMAT:
        raise ValueError(f"{where} is not a vitattn ONNX config (format must be {ONNX_FORMAT!r}); {_REEXPORT}")
    if config.get("version") != ONNX_VERSION:
        raise ValueError(
            f"{where} has version={brief(config.get('version'))} (written by vitattn "
            f"{brief(config.get('vitattn_version'))}); this vitattn reads version {ONNX_VERSION}: {_REEXPORT}"
        )
    task = config.get("task")
    if task not in TASKS:
        raise ValueError(f"{where} has task={brief(task)}; expected one of {list(TASKS)}")
    if config.get("precision") not in PRECISIONS:
        raise ValueError(f"{where} has precision={brief(config.get('precision'))}; expected one of {list(PRECISIONS)}")
    config["preprocess"] = check_preprocess(config.get("preprocess"), f"{where}: preprocess")
    if task == "caption":
        decoder = config.get("decoder")
        bad = [k for k in DECODER_KEYS if not isinstance((decoder or {}).get(k), int) or decoder[k] < 0]
        if not isinstance(decoder, Mapping) or bad:
            raise ValueError(f"{where}: decoder needs non-negative integers {list(DECODER_KEYS)}; {bad} are not")
        unk = decoder.get("unk_id")
        if unk is not None and (not isinstance(unk, int) or isinstance(unk, bool) or unk < 0):
            raise ValueError(f"{where}: decoder.unk_id={brief(unk)} must be a non-negative integer or null")
        if not isinstance(config.get("generate", {}), Mapping):
            raise ValueError(f"{where}: 'generate' must be a mapping of generate() keyword arguments")
    graphs = config.get("graphs")
    if not isinstance(graphs, Mapping):
        raise ValueError(f"{where} has no 'graphs' mapping; {_REEXPORT}")
    for name in GRAPHS[task]:
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
