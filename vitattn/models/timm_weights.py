"""timm ``VisionTransformer`` weights into our encoder, and timm's pretrained names; nothing downloads.

timm fuses q/k/v into one ``attn.qkv`` (rows q, k, v); ours keeps the document's ``wq``, ``wk``, ``wv``. Files
are read as timm reads them (``load_state_dict``; its JAX loader for ``.npz``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
from timm.data import resolve_data_config
from timm.layers import Mlp
from timm.models import get_pretrained_cfg, load_checkpoint, load_state_dict, split_model_name_tag
from timm.models.vision_transformer import Attention, Block
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch import Tensor, nn

from vitattn.errors import first_line
from vitattn.layers.transformer import ACTIVATIONS
from vitattn.models.vit import VisionTransformer
from vitattn.upstream import timm_url_cached

__all__ = [
    "convert_timm_state_dict",
    "load_encoder_state",
    "load_timm_weights",
    "pretrained_timm_model",
    "quiet_timm",
    "read_timm_file",
    "timm_file_data_config",
    "timm_model_config",
    "timm_pretrained_cfg",
    "TIMM_SUFFIXES",
    "weights_config",
]

log = logging.getLogger(__name__)

TIMM_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".npz")

# timm name fragment -> ours, inside each block
_BLOCK_RENAMES = {
    "norm1.": "layernorm1.",
    "norm2.": "layernorm2.",
    "attn.proj.": "mha.dense.",
    "mlp.fc1.": "ffn.0.",
    "mlp.fc2.": "ffn.2.",
}

_ACTIVATIONS = {cls.__name__: name for name, cls in ACTIVATIONS.items()}  # timm's GELU, QuickGELU, ReLU: ours


@contextmanager
def quiet_timm() -> Iterator[None]:
    """timm's INFO lines (``Loaded ... from checkpoint``) off for the block: a load here logs its own one line."""
    logger = logging.getLogger("timm")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def convert_timm_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A timm ViT state dict in our names: ``attn.qkv`` split into ``mha.wq/wk/wv``, ``pre_logits`` dropped (timm's)."""
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if key.startswith("pre_logits."):
            continue
        if ".attn.qkv." in key:
            prefix, kind = key.split(".attn.qkv.")  # kind: weight or bias
            for name, part in zip(("wq", "wk", "wv"), value.chunk(3, dim=0)):
                out[f"{prefix}.mha.{name}.{kind}"] = part.clone()
            continue
        for old, new in _BLOCK_RENAMES.items():
            if key.startswith("blocks.") and f".{old}" in key:
                key = key.replace(f".{old}", f".{new}")
                break
        out[key] = value
    return out


def weights_config(state: Mapping[str, Tensor]) -> dict[str, Any]:
    """The ``VisionTransformer`` arguments that an encoder state dict (ours) fixes by its shapes and keys.

    Raises:
        ValueError: not a ViT with a class token, square patches and a square grid of positions.
    """
    for key in ("patch_embed.proj.weight", "cls_token", "pos_embed", "blocks.0.ffn.0.weight"):
        if key not in state:
            raise ValueError(f"the weights have no {key}: not a ViT with a class token in timm's or vitattn's layout")
    width, in_chans, p_h, p_w = state["patch_embed.proj.weight"].shape  # (D, C, P, P)
    if p_h != p_w:
        raise ValueError(f"the weights have {p_h}x{p_w} patches; vitattn's encoder takes square patches")
    grid = math.isqrt(state["pos_embed"].shape[1] - 1)
    if grid * grid + 1 != state["pos_embed"].shape[1]:
        raise ValueError(
            f"pos_embed has {state['pos_embed'].shape[1]} positions, not a square grid plus the class token "
            "(timm's no_embed_class, as in DeiT III, is not supported)"
        )
    return dict(
        embed_dim=width,
        depth=1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks.")),
        mlp_ratio=state["blocks.0.ffn.0.weight"].shape[0] / width,
        patch_size=p_h,
        in_chans=in_chans,
        qkv_bias="blocks.0.mha.wq.bias" in state,
        norm_pre="norm_pre.weight" in state,
        fc_norm="fc_norm.weight" in state,
    )


def timm_model_config(model: nn.Module) -> dict[str, Any]:
    """What a timm ViT's structure fixes beyond its weights (heads, activation, LayerNorm epsilon, pre-norm).

    Raises:
        ValueError: a timm model our encoder cannot copy (distillation token, registers, layer scale, ...).
    """
    if not isinstance(model, TimmViT):
        raise ValueError(f"{type(model).__name__} is not a timm VisionTransformer")
    block = model.blocks[0]
    act = _ACTIVATIONS.get(type(block.mlp.act).__name__) if type(block.mlp) is Mlp else None
    if getattr(block.mlp.act, "approximate", "none") != "none":
        act = None
    unsupported = {
        "a distillation token (DeiT distilled)": getattr(model, "dist_token", None) is not None,
        "no class token": not model.has_class_token,
        "register tokens": model.num_reg_tokens > 0,
        "position embeddings without the class token (no_embed_class)": model.no_embed_class,
        f"global_pool={model.global_pool!r}": model.global_pool not in ("token", "avg", ""),
        f"{type(block).__name__} blocks": type(block) is not Block or type(block.attn) is not Attention,
        "layer scale (init_values)": not isinstance(block.ls1, nn.Identity),
        f"the activation {type(block.mlp.act).__name__}": act is None,
    }
    found = [what for what, present in unsupported.items() if present]
    if found:
        raise ValueError(f"{type(model).__name__} has {', '.join(found)}: not supported by vitattn's encoder")
    return dict(num_heads=block.attn.num_heads, activation=act, layer_norm_eps=block.norm1.eps, norm_first=True)


def read_timm_file(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A local timm weights file as (state dict in our layout, the arguments it fixes beyond its shapes).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file cannot be read, or is not in timm's ViT layout.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"timm weights file not found: {path}")
    if path.suffix.lower() == ".npz":
        return _read_npz(path)
    try:
        with quiet_timm():  # safetensors or weights_only torch.load; EMA / state_dict / model wrappers unwrapped
            raw = load_state_dict(str(path))
    except Exception as err:  # noqa: BLE001 - safetensors and torch raise their own types for unreadable files
        raise ValueError(f"{path} cannot be read as timm weights: {first_line(err)}") from None
    if any(k.startswith(("visual.", "module.visual.")) for k in raw):
        raise ValueError(
            f"{path} is an OpenAI / OpenCLIP checkpoint, not timm's layout: name the timm model it belongs to, "
            f"e.g. vit_base_patch32_clip_quickgelu_224.openai@{path}"
        )
    state = convert_timm_state_dict(raw)
    known: dict[str, Any] = {"norm_first": True}
    if "norm_pre.weight" in state:
        known["layer_norm_eps"] = 1e-5
    return state, known


def _read_npz(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    try:
        with np.load(path, allow_pickle=False) as w:
            shapes = {k: w[k].shape for k in w.files}
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} cannot be read as a .npz file: {first_line(err)}") from None
    prefix = next((p for p in ("", "opt/target/", "params/") if f"{p}embedding/kernel" in shapes), None)
    block = f"{prefix}Transformer/encoderblock_0/"
    if prefix is None or f"{prefix}cls" not in shapes or f"{block}LayerNorm_0/scale" not in shapes:
        raise ValueError(
            f"{path} is not an original ViT .npz (embedding, cls, Transformer/encoderblock_N): "
            "name the timm model it belongs to, NAME@FILE"
        )
    patch_h, patch_w, in_chans, width = shapes[f"{prefix}embedding/kernel"]  # (P, P, C, D)
    depth = sum(
        1 for k in shapes if k.startswith(f"{prefix}Transformer/encoderblock_") and k.endswith("LayerNorm_0/scale")
    )
    heads = shapes[f"{block}MultiHeadDotProductAttention_1/query/kernel"][1]  # (D, H, d)
    hidden = shapes[f"{block}MlpBlock_3/Dense_0/kernel"][1]  # (D, hidden)
    grid = math.isqrt(shapes[f"{prefix}Transformer/posembed_input/pos_embedding"][1] - 1)
    head = shapes.get(f"{prefix}head/kernel", (width, 0))[-1]
    model = TimmViT(
        img_size=grid * patch_h,
        patch_size=patch_h,
        in_chans=in_chans,
        embed_dim=width,
        depth=depth,
        num_heads=heads,
        mlp_ratio=hidden / width,
        num_classes=head,
        weight_init="skip",
    )
    with torch.no_grad(), quiet_timm():
        try:
            load_checkpoint(model, str(path))  # timm's _load_weights for .npz
        except (KeyError, ValueError, RuntimeError) as err:
            raise ValueError(f"{path} cannot be read by timm's .npz loader: {first_line(err)}") from None
    return convert_timm_state_dict(model.state_dict()), timm_model_config(model)


def load_encoder_state(model: VisionTransformer, state: Mapping[str, Tensor]) -> list[str]:
    """Copy an encoder state dict (ours) into ``model``, positions resampled, a head of another size left;
    returns what was resampled, skipped or left new, for the log.

    Raises:
        ValueError: keys or shapes that do not fit the model.
    """
    own = model.state_dict()
    notes = []
    head, own_head = state.get("head.weight"), own.get("head.weight")
    if head is not None and (own_head is None or head.shape != own_head.shape):
        notes.append(f"skipped head ({head.shape[0]} classes; the model has {model.num_classes or 'none'})")
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
    elif head is None and own_head is not None:
        notes.append(f"new head ({model.num_classes} classes)")
    pos, own_pos = state.get("pos_embed"), own["pos_embed"]
    if pos is not None and pos.shape != own_pos.shape:
        old, new = math.isqrt(pos.shape[1] - 1), model.patch_embed.grid_size[0]
        notes.append(f"resampled pos_embed {old}x{old} -> {new}x{new}")
    wrong = [
        f"{k} {tuple(v.shape)} (model {tuple(own[k].shape)})"
        for k, v in state.items()
        if k in own and k != "pos_embed" and v.shape != own[k].shape
    ]
    missing = sorted(k for k in own.keys() - state.keys() if not k.startswith("head."))
    unexpected = sorted(state.keys() - own.keys())
    for what, keys in (
        ("have the wrong shape", wrong),
        ("are missing", missing),
        ("have no place in vitattn's encoder", unexpected),
    ):
        if keys:
            more = f" (+{len(keys) - 4} more)" if len(keys) > 4 else ""
            raise ValueError(f"the weights do not fit the encoder: {', '.join(keys[:4])}{more} {what}")
    model.load_state_dict(state, strict=False)
    return notes


def load_timm_weights(model: VisionTransformer, source: str | Path | Mapping[str, Tensor] | nn.Module) -> None:
    """Copy timm ViT weights (a timm model, its state dict, a ``TIMM_SUFFIXES`` file) into a ``norm_first`` model."""
    if not model.config["norm_first"]:
        raise ValueError("timm weights are pre-norm: build the model with norm_first=True")
    if isinstance(source, nn.Module):
        state = convert_timm_state_dict(source.state_dict())
    elif isinstance(source, Mapping):
        state = convert_timm_state_dict(source)
    else:
        state, _ = read_timm_file(source)
    for note in load_encoder_state(model, state):
        log.info("timm weights: %s", note)


def timm_pretrained_cfg(name: str, downloadable: bool = True) -> Any:
    """timm's ``PretrainedCfg`` of ``name`` (``arch`` or ``arch.tag``; None for an architecture without any).

    Raises:
        ValueError: not a timm model, an unknown tag, or (``downloadable``) no weights timm can fetch.
    """
    arch, _ = split_model_name_tag(name)
    if not timm.is_model(arch):
        raise ValueError(f"{name} is not a timm model name (e.g. vit_base_patch16_224.augreg2_in21k_ft_in1k)")
    tags = ", ".join(timm.list_pretrained(f"{arch}.*")[:6]) or "none"
    try:
        cfg = get_pretrained_cfg(name, allow_unregistered=not downloadable)
    except RuntimeError:
        raise ValueError(f"{name} has no pretrained weights in timm; its pretrained tags: {tags}") from None
    if downloadable and not (cfg.hf_hub_id or cfg.url):
        raise ValueError(f"{name} has no downloadable weights in timm; give its file: {name}@/path/to/weights")
    return cfg


def pretrained_timm_model(name: str, file: str | Path | None = None) -> nn.Module:
    """timm's pretrained model ``name`` with its weights from timm's cache or a local ``file``; never a download.

    Raises:
        ValueError: an unknown name or tag; weights not cached and no file (one line with the fix); unloadable.
    """
    cfg = timm_pretrained_cfg(name)
    local = file if file is not None else _cached_file(cfg)
    if local is None:
        raise ValueError(
            f"{name}: its weights are not in timm's cache and vitattn does not download; fetch them beforehand "
            f"where the network is reachable (timm.create_model('{name}', pretrained=True)), "
            f"or load a local copy with timm's pretrained_cfg_overlay=dict(file='/path/to/model.safetensors'), "
            f"in vitattn finetune.init={name}@/path/to/model.safetensors"
        )
    overlay = dict(file=str(local), custom_load=Path(local).suffix.lower() == ".npz")
    try:
        with quiet_timm():  # pretrained with a file: timm loads that file (its filters, head and input adaptation)
            return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay)
    except Exception as err:  # noqa: BLE001 - the hub, torch and timm raise many types; the user gets one line
        where = f" from {file}" if file is not None else ""
        raise ValueError(f"{name}: timm cannot load its pretrained weights{where}: {first_line(err)}") from None


def _cached_file(cfg: Any) -> str | None:
    """The file of ``cfg``'s weights in timm's cache (where its loader looks for them), or None."""
    if cfg.hf_hub_id:
        # optional: huggingface_hub comes with timm (vitattn does not declare it); only where the hub is asked
        from huggingface_hub import try_to_load_from_cache

        repo, _, revision = cfg.hf_hub_id.partition("@")
        names = [cfg.hf_hub_filename] if cfg.hf_hub_filename else ["pytorch_model.bin"]
        names = [n[: -len(".bin")] + ".safetensors" for n in names if n.endswith(".bin")] + names  # timm's safe first
        names += ["model.safetensors", "open_clip_model.safetensors"]
        found = (try_to_load_from_cache(repo, n, revision=revision or None) for n in names)
        return next((path for path in found if isinstance(path, str)), None)
    return timm_url_cached(cfg.url)


def timm_file_data_config(path: str | Path) -> tuple[str, dict[str, Any]] | None:
    """``(name, data config)`` from the ``config.json`` timm's ``push_to_hub`` writes beside a weights file, or None."""
    config_file = Path(path).parent / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    pretrained_cfg = config.get("pretrained_cfg") if isinstance(config, dict) else None
    if not isinstance(pretrained_cfg, dict) or not pretrained_cfg.get("mean") or not pretrained_cfg.get("std"):
        return None
    name = ".".join(str(x) for x in (config.get("architecture"), pretrained_cfg.get("tag")) if x)
    return name or str(config_file), resolve_data_config(pretrained_cfg=pretrained_cfg)
