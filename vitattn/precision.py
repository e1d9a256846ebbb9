"""Inference precision, ``precision=auto|fp32|bf16``, and whether this CPU has bf16 matrix units.

``bf16`` runs the model under ``torch.autocast`` in bfloat16 (search scores and attention softmax stay fp32);
``auto`` is bf16 on GPUs with bf16 units (compute capability 8.0 on) and on CPUs with ``amx_bf16`` (Intel
Sapphire Rapids on) or ``avx512_bf16`` (and AMD Zen 4 on), fp32 elsewhere. ONNX folders run in fp32. Torch is
imported only to detect or autocast.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

__all__ = [
    "NATIVE_BF16_ENV",
    "PRECISIONS",
    "check_precision",
    "cpu_bf16_units",
    "cuda_bf16",
    "native_bf16",
    "precision_autocast",
    "resolve_precision",
]

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16")

# 0: take this CPU as one without bf16 units (auto is fp32); 1: as one with them. Unset: detect.
NATIVE_BF16_ENV = "VITATTN_NATIVE_BF16"

_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # native bf16 matrix instructions

_NAME = {True: "bf16", False: "fp32"}


def check_precision(precision: Any) -> str:
    """``precision`` if it is one of ``PRECISIONS``, else a one-line ``ValueError`` naming it."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown; choose auto, fp32 or bf16")
    return precision


def cpu_bf16_units() -> list[str]:
    """This CPU's native bf16 matrix instructions that torch can use (``amx_bf16``, ``avx512_bf16``), by torch's
    checks (every supported torch has them); none without oneDNN, which runs torch's bf16 CPU matrix products."""
    import torch  # heavy: only to detect

    if not torch.backends.mkldnn.is_available():
        return []
    checks = {"amx_bf16": torch.cpu._is_amx_tile_supported, "avx512_bf16": torch.cpu._is_avx512_bf16_supported}
    return [name for name, check in checks.items() if check()]


@functools.cache
def native_bf16() -> bool:
    """Whether ``auto`` takes this CPU for one with bf16 units: detected once per process and logged in one line
    (``VITATTN_NATIVE_BF16=0`` or ``1`` decides instead)."""
    forced = os.environ.get(NATIVE_BF16_ENV)
    if forced not in (None, "0", "1"):
        raise ValueError(f"{NATIVE_BF16_ENV}={forced!r} must be 0 (fp32) or 1 (bf16), or unset (detect)")
    if forced is None:
        units = cpu_bf16_units()
        listed = ", ".join(units) or f"none of {', '.join(_BF16_FLAGS)}"
        found, why = bool(units), f"bf16 matrix instructions on this CPU: {listed}"
    else:
        found, why = forced == "1", f"{NATIVE_BF16_ENV}={forced}"
    log.info("precision=auto: %s, so inference runs in %s", why, _NAME[found])
    return found


def cuda_bf16(device: Any = None) -> bool:
    """Whether the CUDA ``device`` (None: the current one) has native bf16 units: compute capability 8.0 or more
    (Ampere and later); a V100 or T4 would only emulate bf16."""
    import torch  # heavy: only to detect

    return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 8


def resolve_precision(precision: str, device: Any) -> str:
    """``fp32`` or ``bf16``: what ``precision`` runs on ``device`` (a ``torch.device`` or its name); ``auto`` is
    bf16 on a GPU with ``cuda_bf16`` and on a CPU with ``native_bf16``, fp32 elsewhere."""
    check_precision(precision)
    if precision != "auto":
        return precision
    kind = getattr(device, "type", str(device).split(":")[0])
    return _NAME[(kind == "cuda" and cuda_bf16(device)) or (kind == "cpu" and native_bf16())]


def precision_autocast(precision: str, device: Any) -> contextlib.AbstractContextManager:
    """bf16 ``torch.autocast`` on ``device`` when ``precision`` is bf16 (or ``auto`` resolving to it there), else
    nothing: fp32, or a ``LoadedModel``'s ``int8`` (an ONNX folder's own)."""
    import torch  # heavy: only when a model runs

    if precision == "auto":
        precision = resolve_precision(precision, device)
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(getattr(device, "type", str(device).split(":")[0]), dtype=torch.bfloat16)
