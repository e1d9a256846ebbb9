"""``finetune.init``: the weights a run starts from, a whole vitattn ``model`` or an ``encoder`` (``init_kind``).

``read_start`` reads them once; ``resolve`` returns what they fix in the run's config (sizes, switches and the
preprocessing the data leaves unset), which the plan writes in before it is checked, saved and built
(``training.plan``); the plan holds them, and ``training.build.load_start`` copies them into the built system.
The kinds and what each brings: docs/finetuning.md.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_only
from timm.data import resolve_model_data_config
from torch import Tensor

from vitattn.bundle import Bundle, load_bundle
from vitattn.bundle.folder import CONFIG_FILE, WEIGHTS_FILE, is_bundle_folder, is_bundle_weights
from vitattn.bundle.hub import describe_folder, hub_folder, is_hub_name
from vitattn.data import Vocabulary
from vitattn.data.preprocess import describe, from_timm, preprocess_taken
from vitattn.data.tokenizer import Tokenizer
from vitattn.errors import ConfigError, first_line
from vitattn.models.timm_weights import (
    TIMM_SUFFIXES,
    convert_timm_state_dict,
    pretrained_timm_model,
    read_timm_file,
    timm_file_data_config,
    timm_model_config,
    timm_pretrained_cfg,
    weights_config,
)
from vitattn.models.vit import PRESETS, preset_config

__all__ = [
    "EncoderWeights",
    "ModelWeights",
    "read_start",
    "log_preprocess",
    "preprocess_keys",
    "source_kind",
]

log = logging.getLogger(__name__)


@rank_zero_only
def _info(line: str) -> None:
    log.info(line)  # vitattn's logger, which reaches the root logger's handlers; Lightning's may not propagate


# Model keys that are training choices, not what the weights are: the run's config keeps its own.
TRAINING_KEYS = frozenset(
    {
        "drop_rate",
        "pos_drop_rate",
        "attn_drop_rate",
        "drop_path_rate",
        "fused_attn",
        "pos_embed_init",
        "init",
        "grad_checkpointing",
        "merge_tokens",  # the weights run at any merge (ToMe); what this run trains with is its own
    }
)


# Keys the weights fix that the config must already agree with: changing them changes what the model is.
_REFUSED = ("in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio")
# Switches set from the weights (and logged) when the config says otherwise.
_SET = ("patch_size", "qkv_bias", "norm_first", "activation", "layer_norm_eps", "norm_pre")
_VITATTN_KEYS = ("num_heads", "norm_first", "activation", "layer_norm_eps")
# The weights files of a timm model on the Hub (timm's push_to_hub names its safetensors file as a bundle does),
# in the order timm's loader prefers them.
_TIMM_HUB_FILES = (WEIGHTS_FILE, "pytorch_model.bin")


@dataclass
class ModelWeights:
    """``finetune.init_kind=model``: a whole trained vitattn model, loaded on the CPU (``bundle``)."""

    source: str
    bundle: Bundle

    def __post_init__(self) -> None:
        self.preprocess, self.preprocess_from = dict(self.bundle.preprocess), f"finetune.init={self.source}"
        # the model's tokenizer: a captioner's run never builds one from its captions
        self.vocab: Tokenizer | None = self.bundle.vocab if self.bundle.task == "caption" else None

    def resolve(self, values: dict[str, Any], given: list[str]) -> dict[str, Any]:
        """The model's sizes, image size and caption length where the config ``values`` (the plan's plain keys, by
        their dotted names) differ, logged, and its preprocessing where the data takes it (``preprocess_keys``):
        what the plan writes into the config.

        Args:
            given: the keys the command line set (``resolve``'s overrides); one that the model contradicts is refused.

        Raises:
            ConfigError: a model of the other task; a tokenizer other than the model's; a size given that differs.
        """
        bundle, task = self.bundle, values["head.task"]
        if bundle.task != task:
            raise ConfigError(
                f"finetune.init={self.source} is a {bundle.task} model, not a {task} model (head={task}); start from "
                f"a {task} model, or add finetune.init_kind=encoder to start only the encoder from it"
            )
        if bundle.task == "caption":
            _refuse_other_tokenizer(values, self, given)
        wanted = _config_values(values, bundle.config["model"], bundle.task)
        current = {key: values.get(key) for key in wanted}
        contradicted = [key for key, value in wanted.items() if _given(key, given) and current[key] != value]
        if contradicted:
            theirs = " ".join(f"{key}={wanted[key]}" for key in contradicted)
            ours = " ".join(f"{key}={current[key]}" for key in contradicted)
            raise ConfigError(
                f"finetune.init={self.source}: its model has {theirs}, not {ours} as given; the "
                "model's sizes come from finetune.init, so drop them from the command line"
            )
        changed = {key: value for key, value in wanted.items() if current[key] != value}
        _info(
            f"finetune.init={self.source}: the model's sizes, tokenizer and preprocessing"
            + (f"; set from it: {', '.join(f'{k} {current[k]} -> {v}' for k, v in changed.items())}" if changed else "")
        )
        return changed | preprocess_keys(values, self.preprocess)


@dataclass
class EncoderWeights:
    """``finetune.init_kind=encoder``: encoder weights and the ``VisionTransformer`` keyword arguments they fix."""

    source: str  # the finetune.init value
    what: str  # how the log line names the source
    state: dict[str, Tensor]  # the encoder state dict in vitattn's layout (with its classifier head, if any)
    known: dict[str, Any]  # the VisionTransformer keyword arguments the weights fix
    notes: list[str] = field(default_factory=list)  # what the log line adds (e.g. timm's note on QuickGELU)
    changes: list[str] = field(default_factory=list)  # the switches ``fit`` set: ``key old -> new``
    preprocess: dict[str, Any] | None = None  # what the weights were trained with; None: unknown
    preprocess_from: str = ""  # where that comes from, or why it is unknown, as the run log says it

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
                f"finetune.init={self.source}: its patch_size={encoder['patch_size']} does not divide "
                f"data.img_size={encoder['img_size']}; use a multiple of {encoder['patch_size']}"
            )

    vocab = None  # the run's own tokenizer

    def resolve(self, values: dict[str, Any], given: list[str]) -> dict[str, Any]:
        """The switches the weights show, as the ``model.*`` keys whose config ``values`` (the plan's plain keys)
        differ, and their preprocessing where the data takes it (``preprocess_keys``): what the plan writes into the
        config that is checked and saved."""
        model = {key.removeprefix("model."): v for key, v in values.items() if key.startswith("model.")}
        encoder = {**copy.deepcopy(model), "img_size": values["data.img_size"]}
        self.fit(encoder)
        fitted = {k: encoder[k] for k in model if k != "img_size" and k in encoder and model[k] != encoder[k]}
        return {f"model.{k}": v for k, v in fitted.items()} | preprocess_keys(values, self.preprocess)

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
        raise ConfigError(f"finetune.init={self.source}: the weights have {theirs}; set {fix}{hint}")


def preprocess_keys(values: dict[str, Any], preprocess: dict[str, Any] | None) -> dict[str, Any]:
    """The ``data.*`` keys of the weights' ``preprocess`` that the config ``values`` (the plan's plain keys) leave
    null and the data takes (``preprocess_taken``)."""
    data = {key.removeprefix("data."): v for key, v in values.items() if key.startswith("data.")}
    taken = preprocess_taken(data, preprocess)
    return {f"data.{k}": list(v) if isinstance(v, (list, tuple)) else v for k, v in taken.items()}


def _uses_fc_norm(encoder: dict[str, Any]) -> bool:
    return encoder["global_pool"] == "avg" if encoder["fc_norm"] is None else encoder["fc_norm"]


def _plain(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


def read_start(source: str, kind: str = "model") -> ModelWeights | EncoderWeights:
    """The weights ``finetune.init=source`` names, of ``kind`` (``finetune.init_kind``), read once.

    Raises:
        ConfigError: an unknown kind or source; weights that cannot be read, are not a supported ViT, or are
            neither cached nor reachable (timm names, offline).
    """
    if kind not in ("model", "encoder"):
        raise ConfigError(f"finetune.init_kind={kind!r} is unknown; choose model (a whole vitattn model) or encoder")
    if kind == "model":
        return _read_model(str(source))
    what, where, file = source_kind(source)
    try:
        if what == "vitattn":
            return _read_vitattn(source, Path(where))
        if what == "timm-file":
            return _read_timm_file(source, Path(where))
        return _read_timm_name(source, str(where), file)
    except (ValueError, FileNotFoundError) as err:
        if isinstance(err, ConfigError):
            raise
        message = first_line(err, limit=600).removeprefix(f"{where}: ")  # timm_hub's lines start with the name
        raise ConfigError(f"finetune.init={source}: {message}") from None


def _read_model(source: str) -> ModelWeights:
    path = Path(source).expanduser()
    if is_hub_name(source):
        path = source  # load_bundle fetches it
    elif not path.exists():
        hint = "; a timm encoder needs finetune.init_kind=encoder" if "/" not in source else ""
        raise ConfigError(f"finetune.init={source} does not exist; give a vitattn run folder, bundle or .ckpt{hint}")
    elif path.suffix.lower() in TIMM_SUFFIXES and not is_bundle_weights(path):
        raise ConfigError(f"finetune.init={source} is a timm weights file, an encoder: add finetune.init_kind=encoder")
    try:
        bundle = load_bundle(path)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"finetune.init={source}: {first_line(err)}") from None
    if bundle.runtime != "torch":
        raise ConfigError(f"finetune.init={source} is an ONNX folder; give the run folder or bundle it came from")
    return ModelWeights(source, bundle)


def source_kind(source: str) -> tuple[str, Path | str, Path | None]:
    """What a ``finetune.init`` value names, without reading weights: ``(kind, where, file)``.

    ``kind`` is ``vitattn`` (a run folder, bundle or .ckpt at ``where``), ``timm-file`` (a weights file) or
    ``timm-name`` (``where`` a timm name; ``file`` its local weights for ``NAME@FILE``, else None). A
    ``hf-hub:`` name is fetched (``hub_folder``): a vitattn bundle, or the weights of a timm model pushed there.

    Raises:
        ConfigError: nothing at that path and no timm model of that name; an unknown tag; a Hub name that is
            malformed, unreachable or neither.
    """
    text = str(source)
    if is_hub_name(text):
        return _hub_kind(text)
    path = Path(text).expanduser()
    if path.exists():
        if path.is_dir() or path.suffix == ".ckpt" or path.name == CONFIG_FILE or is_bundle_weights(path):
            return "vitattn", path, None
        if path.suffix.lower() in TIMM_SUFFIXES:
            return "timm-file", path, None
        raise ConfigError(
            f"finetune.init={text} is not a weights file; give a {', '.join(TIMM_SUFFIXES)} file, "
            "a timm model name, or a vitattn run folder, bundle or .ckpt"
        )
    name, at, file = text.partition("@")
    try:
        timm_pretrained_cfg(name, downloadable=not at)
    except ValueError as err:
        if "not a timm model" in str(err) and not at:
            raise ConfigError(
                f"finetune.init={text} is neither an existing file or folder nor a timm model name "
                "with a pretrained tag (e.g. vit_base_patch16_224.augreg2_in21k_ft_in1k)"
            ) from None
        raise ConfigError(f"finetune.init={text}: {first_line(err)}") from None
    if at and not Path(file).expanduser().is_file():
        raise ConfigError(f"finetune.init={text}: {file} does not exist; give the weights file of {name}")
    return "timm-name", name, Path(file).expanduser() if at else None


def _hub_kind(name: str) -> tuple[str, Path, None]:
    try:
        folder = hub_folder(name)
    except ValueError as err:
        raise ConfigError(f"finetune.init={first_line(err)}") from None
    if is_bundle_folder(folder):
        return "vitattn", folder, None
    held = describe_folder(folder)
    weights = next((folder / n for n in _TIMM_HUB_FILES if (folder / n).is_file()), None)
    if held.startswith("a timm model") and weights is not None:
        return "timm-file", weights, None
    raise ConfigError(
        f"finetune.init={name} holds {held}; give a vitattn bundle or a timm model ({' or '.join(_TIMM_HUB_FILES)})"
    )


def _read_vitattn(source: str, path: Path) -> EncoderWeights:
    bundle = load_bundle(path.parent if is_bundle_weights(path) else path)
    encoder = bundle.model.encoder if bundle.task == "caption" else bundle.model
    state = {k: v.detach() for k, v in encoder.state_dict().items()}
    known = {**weights_config(state), **{k: encoder.config[k] for k in _VITATTN_KEYS}}
    what = f"the vitattn {bundle.task} model {path}"
    return EncoderWeights(source, what, state, known, preprocess=dict(bundle.preprocess), preprocess_from=what)


def _read_timm_file(source: str, path: Path) -> EncoderWeights:
    state, known = read_timm_file(path)
    weights = EncoderWeights(source, f"timm file {path}", state, {**weights_config(state), **known})
    found = timm_file_data_config(path)
    if found is None:
        weights.preprocess_from = f"{path} is a bare weights file whose family cannot be known"
    else:
        name, data_config = found
        weights.preprocess = from_timm(data_config)
        weights.preprocess_from = f"timm's pretrained config of {name} (the config.json beside {path.name})"
    return weights


def _read_timm_name(source: str, name: str, file: Path | None) -> EncoderWeights:
    model = pretrained_timm_model(name, file)
    state = convert_timm_state_dict(model.state_dict())
    known = {**weights_config(state), **timm_model_config(model)}
    cfg = model.pretrained_cfg
    notes = [f"timm: {n}" for n in (cfg.get("notes") or ())]
    what = f"timm {name}" + (f" from {file}" if file else "")
    tagged = f"{cfg['architecture']}.{cfg['tag']}" if cfg.get("architecture") and cfg.get("tag") else name
    preprocess = from_timm(resolve_model_data_config(model))
    origin = f"timm's pretrained config of {tagged}"
    return EncoderWeights(source, what, state, known, notes, preprocess=preprocess, preprocess_from=origin)


def _config_values(values: dict[str, Any], model: dict[str, Any], task: str) -> dict[str, Any]:
    """The config keys and values that build ``model`` (a saved model config) again, of those in ``values``."""
    encoder, decoder = (model, None) if task == "classification" else (model["encoder"], model["decoder"])
    skip = TRAINING_KEYS | {"img_size", "max_len"}  # the data's keys, below
    wanted = {"data.img_size": encoder["img_size"]}
    wanted |= _values_of(values, "model.", encoder, skip)
    if decoder is not None:
        wanted["data.max_caption_len"] = decoder["max_len"]
        wanted |= _values_of(values, "head.decoder.", decoder, skip)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in wanted.items()}


def _values_of(values: dict[str, Any], prefix: str, part: dict[str, Any], skip: frozenset[str]) -> dict[str, Any]:
    names = {key: key.removeprefix(prefix) for key in values if key.startswith(prefix)}
    return {key: part[name] for key, name in names.items() if name in part and name not in skip}


def _given(key: str, given: list[str]) -> bool:
    """Whether the command line set ``key`` itself, or the group it belongs to (``model=small`` sets model.*)."""
    return key in given or (key.startswith("model.") and "model" in given)


def _refuse_other_tokenizer(values: dict[str, Any], init: ModelWeights, given: list[str]) -> None:
    theirs = init.bundle.vocab
    asked = [k for k in given if k == "tokenizer" or k.startswith("tokenizer.") or k == "data.vocab_path"]
    ours = values["tokenizer.kind"] or "words"  # no tokenizer group: the data builds a word vocabulary
    if asked and (values.get("data.vocab_path") or (ours == "words") != isinstance(theirs, Vocabulary)):
        raise ConfigError(
            f"finetune.init={init.source} brings its own tokenizer ({type(theirs).__name__}, {len(theirs)} tokens), "
            f"not the one {' '.join(asked)} asks for; drop {' '.join(asked)}"
        )


def log_preprocess(datamodule: Any, why: str) -> None:
    """One line: the preprocessing the built data uses, and where each part comes from (the plan's)."""
    _info(f"preprocessing: {describe(datamodule.preprocess)}: {why}")
