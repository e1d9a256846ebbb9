"""timm model names with a pretrained tag: weights through timm's own pretrained machinery and cache.

vitattn never downloads: it finds the weights' file in timm's cache (the Hugging Face hub cache, or torch
hub's for the few weights behind a URL) or takes a local copy (``NAME@FILE``), and has timm load that file
(``pretrained_cfg_overlay=dict(file=...)``: timm's loader then reads the file and asks neither the hub nor
a URL). Uncached weights give one line that says how to fetch them beforehand or give a file.

The preprocessing the weights were trained with is timm's data config (``resolve_model_data_config``); a bare
file has one when timm's hub layout keeps its ``config.json`` beside it (``timm_file_data_config``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import timm
from timm.data import resolve_data_config
from timm.models import get_pretrained_cfg, split_model_name_tag
from torch import nn

from vitattn.errors import first_line
from vitattn.models.timm_weights import quiet_timm
from vitattn.upstream import timm_url_cached

__all__ = ["pretrained_timm_model", "timm_file_data_config", "timm_pretrained_cfg"]


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
    """timm's pretrained model ``name`` with its weights from timm's cache or ``file``; never a download.

    Args:
        name: a timm model name, with a pretrained tag or timm's default one.
        file: a local copy of the weights (timm's ``pretrained_cfg_overlay=dict(file=...)``); ``.npz``
            files go through the model's own JAX loader, as timm's ``custom_load`` does.

    Raises:
        ValueError: an unknown name or tag; the weights are not cached and no file is given (one line with
            the fix); timm cannot load them.
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
    """``(name, data config)`` of a weights file from the ``config.json`` beside it in timm's hub layout
    (``architecture`` and ``pretrained_cfg``, as ``timm.models.push_to_hub`` writes them); None without one.

    The data config is ``timm.data.resolve_data_config``'s: ``input_size``, ``interpolation``, ``mean``, ``std``,
    ``crop_pct``, ``crop_mode``.
    """
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
