"""``finetune.pretrained``: the encoder of a run starts from pretrained weights.

A source is one of:

- a local timm weights file: ``.safetensors``, ``.pth``, ``.bin``, ``.npz`` (read as timm reads it);
- a timm model name with a pretrained tag (``vit_base_patch16_224.augreg2_in21k_ft_in1k``), loaded by
  timm's pretrained machinery and cache, or ``NAME@FILE``: that model's weights from a local file
  (timm's ``pretrained_cfg_overlay=dict(file=FILE)``), for any layout timm's own filter reads;
- a vitattn run folder, bundle or ``.ckpt``: its encoder (a classifier trained here first, say).

The switches the weights show (patch size, ``norm_pre``, ``fc_norm`` and the pooling it implies,
``qkv_bias``; from a timm name or a vitattn source also the activation, LayerNorm epsilon and
``norm_first``) are set in the model config, which the run saves, so checkpoints and bundles rebuild
the same encoder without the source. A width, depth, head count, MLP ratio or channel count that
contradicts the weights is refused with one line naming the keys to change. Loading logs one line.

The weights also bring the preprocessing they were trained with (``PretrainedEncoder.preprocess``): timm's
``resolve_model_data_config`` for a timm name (or the ``config.json`` of timm's hub layout beside a file), a
vitattn model's own ``preprocess``; a bare file's is unknown. ``choose_preprocess`` gives it to the run's
data before its setup, so training, validation, test and the bundle (and so the ONNX folder and the server)
use it, ``data.*`` keys set in the config winning, and logs one line: what was chosen and why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from timm.data import resolve_model_data_config
from torch import Tensor

from vitattn.bundle import load_bundle
from vitattn.bundle.folder import is_bundle_weights
from vitattn.data.preprocess import WEIGHTS_KEYS, describe, from_timm
from vitattn.errors import ConfigError, first_line
from vitattn.models import VisionTransformer
from vitattn.models.timm_weights import (
    convert_timm_state_dict,
    load_encoder_state,
    pretrained_timm_model,
    read_timm_file,
    timm_file_data_config,
    timm_model_config,
    weights_config,
)
from vitattn.models.vit import PRESETS, preset_config
from vitattn.training.config import check_source
from vitattn.training.datamodules.base import ImageDataModule

__all__ = ["PretrainedEncoder", "choose_preprocess", "read_pretrained"]

# Keys the weights fix that the config must already agree with: changing them changes what the model is.
_REFUSED = ("in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio")
# Switches set from the weights (and logged) when the config says otherwise.
_SET = ("patch_size", "qkv_bias", "norm_first", "activation", "layer_norm_eps", "norm_pre")
_VITATTN_KEYS = ("num_heads", "norm_first", "activation", "layer_norm_eps")


@dataclass
class PretrainedEncoder:
    """Encoder weights read from a source, and the ``VisionTransformer`` keyword arguments they fix.

    Attributes:
        source: the ``finetune.pretrained`` value.
        what: how the log line names it (``timm file x.safetensors``, ``timm vit_base_patch16_224.augreg...``).
        state: the encoder state dict in vitattn's layout (with its classifier head, if any).
        known: ``VisionTransformer`` keyword arguments the source fixes.
        notes: what the log line adds (e.g. timm's note on QuickGELU).
        changes: the switches ``fit`` set, ``key old -> new``.
        preprocess: the preprocessing the weights were trained with (a ``preprocess`` mapping); None: unknown.
        preprocess_from: where it comes from (or why it is unknown), as the run log says it.
    """

    source: str
    what: str
    state: dict[str, Tensor]
    known: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)
    preprocess: dict[str, Any] | None = None
    preprocess_from: str = ""

    def fit(self, encoder: dict[str, Any]) -> None:
        """Set the switches the weights show in ``encoder`` (VisionTransformer kwargs, in place).

        Raises:
            ConfigError: a width, depth, head count, MLP ratio or channel count that contradicts the
                weights; a patch size from the weights that does not divide the image size.
        """
        self._refuse_contradictions(encoder)
        if "activation" not in self.known and self.known["norm_pre"]:
            self.notes.append(
                f"activation {encoder['activation']} from the config, not the weights "
                "(OpenAI CLIP weights need model.activation=quick_gelu)"
            )
        for key in _SET:
            if key in self.known and encoder[key] != self.known[key]:
                self._set(encoder, key, self.known[key])
        wanted = self.known["fc_norm"]
        if wanted and not _uses_fc_norm(encoder) and encoder["global_pool"] == "cls":
            self._set(encoder, "global_pool", "avg")  # timm's fc_norm goes with average pooling
        if wanted != _uses_fc_norm(encoder):
            self._set(encoder, "fc_norm", wanted)
        if encoder["img_size"] % encoder["patch_size"]:
            raise ConfigError(
                f"finetune.pretrained={self.source}: its patch_size={encoder['patch_size']} does not divide "
                f"data.img_size={encoder['img_size']}; use a multiple of {encoder['patch_size']}"
            )

    def load_into(self, encoder: VisionTransformer) -> None:
        """Copy the weights into ``encoder`` (built from the fitted config) and log one line."""
        try:
            notes = load_encoder_state(encoder, self.state)
        except ValueError as err:
            raise ConfigError(f"finetune.pretrained={self.source}: {first_line(err)}") from None
        set_from = f"; set from the weights: {', '.join(self.changes)}" if self.changes else ""
        extra = "; ".join(notes + self.notes)
        rank_zero_info(
            f"pretrained encoder: loaded {len(self.state)} tensors of {self.what}{set_from}"
            + (f"; {extra}" if extra else "")
        )

    def _set(self, encoder: dict[str, Any], key: str, value: Any) -> None:
        self.changes.append(f"model.{key} {_plain(encoder[key])} -> {_plain(value)}")
        encoder[key] = value

    def _refuse_contradictions(self, encoder: dict[str, Any]) -> None:
        def differs(key: str) -> bool:
            if key == "mlp_ratio":  # the hidden width is what the weights hold
                width = encoder["embed_dim"]
                return int(width * encoder[key]) != round(width * self.known[key])
            return encoder[key] != self.known[key]

        wrong = [k for k in _REFUSED if k in self.known and differs(k)]
        if not wrong:
            return
        theirs = " ".join(f"{k}={_plain(self.known[k])}" for k in _REFUSED if k in self.known)
        fix = " ".join(f"model.{k}={_plain(self.known[k])}" for k in wrong)
        sizes = [n for n in PRESETS if all(preset_config(n)[k] == self.known[k] for k in ("embed_dim", "depth"))]
        hint = f" (or model={sizes[0]})" if sizes and "in_chans" not in wrong else ""
        raise ConfigError(f"finetune.pretrained={self.source}: the weights have {theirs}; set {fix}{hint}")


def _uses_fc_norm(encoder: dict[str, Any]) -> bool:
    return encoder["global_pool"] == "avg" if encoder["fc_norm"] is None else encoder["fc_norm"]


def _plain(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


def read_pretrained(source: str) -> PretrainedEncoder:
    """Read the encoder weights that ``finetune.pretrained=source`` names.

    Raises:
        ConfigError: an unknown source; weights that cannot be read, are not a supported ViT, or are
            neither cached nor reachable (timm names, offline).
    """
    kind, where, file = check_source(source)
    try:
        if kind == "vitattn":
            return _read_vitattn(source, Path(where))
        if kind == "timm-file":
            return _read_timm_file(source, Path(where))
        return _read_timm_name(source, str(where), file)
    except (ValueError, FileNotFoundError) as err:
        if isinstance(err, ConfigError):
            raise
        message = first_line(err, limit=600).removeprefix(f"{where}: ")  # timm_hub's lines start with the name
        raise ConfigError(f"finetune.pretrained={source}: {message}") from None


def _read_vitattn(source: str, path: Path) -> PretrainedEncoder:
    bundle = load_bundle(path.parent if is_bundle_weights(path) else path)
    encoder = bundle.model.encoder if bundle.task == "caption" else bundle.model
    state = {k: v.detach() for k, v in encoder.state_dict().items()}
    known = {**weights_config(state), **{k: encoder.config[k] for k in _VITATTN_KEYS}}
    what = f"the vitattn {bundle.task} model {path}"
    return PretrainedEncoder(source, what, state, known, preprocess=dict(bundle.preprocess), preprocess_from=what)


def _read_timm_file(source: str, path: Path) -> PretrainedEncoder:
    state, known = read_timm_file(path)
    weights = PretrainedEncoder(source, f"timm file {path}", state, {**weights_config(state), **known})
    found = timm_file_data_config(path)
    if found is None:
        weights.preprocess_from = f"{path} is a bare weights file whose family cannot be known"
    else:
        name, data_config = found
        weights.preprocess = from_timm(data_config)
        weights.preprocess_from = f"timm's pretrained config of {name} (the config.json beside {path.name})"
    return weights


def _read_timm_name(source: str, name: str, file: Path | None) -> PretrainedEncoder:
    model = pretrained_timm_model(name, file)
    known = timm_model_config(model)
    state = convert_timm_state_dict(model.state_dict())
    notes = [f"timm: {n}" for n in (model.pretrained_cfg.get("notes") or ())]
    what = f"timm {name}" + (f" from {file}" if file else "")
    cfg = model.pretrained_cfg
    tagged = f"{cfg['architecture']}.{cfg['tag']}" if cfg.get("architecture") and cfg.get("tag") else name
    return PretrainedEncoder(
        source,
        what,
        state,
        {**weights_config(state), **known},
        notes,
        preprocess=from_timm(resolve_model_data_config(model)),
        preprocess_from=f"timm's pretrained config of {tagged}",
    )


def choose_preprocess(datamodule: ImageDataModule, pretrained: PretrainedEncoder | None) -> dict[str, Any]:
    """Give ``datamodule`` (before its setup) the preprocessing ``pretrained`` was trained with, where the config
    sets no ``data.*`` key, and log one line: the preprocessing chosen and where each part comes from.

    Returns:
        The run's ``preprocess``.
    """
    known = pretrained is not None and pretrained.preprocess is not None
    taken = list(datamodule.use_weights_preprocess(pretrained.preprocess)) if known else []
    config = [k for k in WEIGHTS_KEYS if k in datamodule.preprocess_overrides]
    parts = []
    if config:
        parts.append((", ".join(f"data.{k}" for k in config), "from the config"))
    if taken:
        parts.append((", ".join(taken), f"the pretrained weights' own, from {pretrained.preprocess_from}"))
    rest = [k for k in WEIGHTS_KEYS if k not in config and k not in taken]
    if rest:
        parts.append((", ".join(rest), _data_default(pretrained, rest)))
    last = len(parts) - 1
    why = "; ".join(f"{'the rest' if i == last else keys}: {source}" for i, (keys, source) in enumerate(parts))
    chosen = datamodule.preprocess
    rank_zero_info(f"preprocessing: {describe(chosen)}: {parts[0][1] if not last else why}")
    return chosen


def _data_default(pretrained: PretrainedEncoder | None, rest: list[str]) -> str:
    if pretrained is None:
        return "the data's own (no finetune.pretrained)"
    if pretrained.preprocess is not None:
        return "the data's own"
    stats = [k for k in ("mean", "std") if k in rest]
    if not stats:
        return f"the data's own: {pretrained.preprocess_from}"
    fix = " ".join(f"data.{k}=[...]" for k in stats)
    return (
        f"the data's own, ImageNet's {' and '.join(stats)}: {pretrained.preprocess_from}; "
        f"if its weights were trained with others, set {fix}"
    )
