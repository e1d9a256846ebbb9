"""Load timm ``VisionTransformer`` weights into our encoder.

timm fuses the query/key/value projections into one ``attn.qkv`` Linear (rows ordered q, k, v);
ours keeps the document's ``wq``, ``wk``, ``wv``, so the fused matrix is split in three. Nothing is
downloaded: the source is a timm model, a state dict, or a local ``.safetensors`` / ``.pth`` file.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from vitattn.models.vit import VisionTransformer

__all__ = ["convert_timm_state_dict", "load_timm_weights"]

log = logging.getLogger(__name__)

# timm name fragment -> ours, inside each block
_BLOCK_RENAMES = {
    "norm1.": "layernorm1.",
    "norm2.": "layernorm2.",
    "attn.proj.": "mha.dense.",
    "mlp.fc1.": "ffn.0.",
    "mlp.fc2.": "ffn.2.",
}


def convert_timm_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rename a timm ViT state dict to ours and split each ``attn.qkv`` into ``mha.wq/wk/wv``.

    Args:
        state_dict: keys as in ``timm.models.vision_transformer.VisionTransformer``.

    Returns:
        A state dict for ``vitattn.models.VisionTransformer`` (pre-norm).
    """
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if key.startswith("fc_norm.") or key.startswith("head_drop."):
            raise ValueError(
                f"{key!r}: timm models with fc_norm (global_pool='avg') are not supported; use global_pool='token'"
            )
        if ".attn.qkv." in key:
            prefix, kind = key.split(".attn.qkv.")  # kind: weight or bias
            q, k, v = value.chunk(3, dim=0)
            for name, part in zip(("wq", "wk", "wv"), (q, k, v)):
                out[f"{prefix}.mha.{name}.{kind}"] = part.clone()
            continue
        for old, new in _BLOCK_RENAMES.items():
            if key.startswith("blocks.") and f".{old}" in key:
                key = key.replace(f".{old}", f".{new}")
                break
        out[key] = value
    return out


def _read_state_dict(source: str | Path | Mapping[str, Tensor] | nn.Module) -> Mapping[str, Tensor]:
    if isinstance(source, nn.Module):
        return source.state_dict()
    if isinstance(source, Mapping):
        return source
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"timm weights file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    for wrapper in ("state_dict", "model"):  # common checkpoint wrappers
        if isinstance(state, Mapping) and wrapper in state and isinstance(state[wrapper], Mapping):
            state = state[wrapper]
    return state


def load_timm_weights(
    model: VisionTransformer, source: str | Path | Mapping[str, Tensor] | nn.Module, load_head: bool = True
) -> None:
    """Copy timm ViT weights into ``model`` (pre-norm, GELU, same width/depth/heads/patch).

    Position embeddings of another image size are resampled (timm's ``resample_abs_pos_embed``).
    A classifier head whose shape differs from ``model.head`` is skipped with a log line.

    Args:
        model: our encoder, built with ``norm_first=True, activation="gelu"``.
        source: a timm model, its state dict, or a local ``.safetensors`` / ``.pth`` file.
        load_head: also copy the classifier head when the shapes agree.
    """
    if not model.config["norm_first"]:
        raise ValueError("timm weights are pre-norm: build the model with norm_first=True")
    state = convert_timm_state_dict(_read_state_dict(source))
    own_head = model.state_dict().get("head.weight")
    if not load_head or own_head is None or state.get("head.weight", own_head).shape != own_head.shape:
        if "head.weight" in state:
            log.info("timm head %s not loaded", tuple(state["head.weight"].shape))
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any(not k.startswith("head.") for k in missing):
            raise ValueError(f"timm weights do not fit: missing {missing}, unexpected {unexpected}")
        return
    model.load_state_dict(state)
