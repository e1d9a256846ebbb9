"""``finetune.init``: a run starts from a whole trained model (a run folder, bundle or checkpoint).

The model brings what makes it that model: the encoder's and the decoder's (or the classifier's) sizes and
switches, the image size, the caption length, the tokenizer or class names, the preprocessing and every
weight. The run's config brings the rest: data, optimiser, schedule, regularisation (dropout, drop path),
the training objective (cross-entropy, or ``finetune=scst``). So two second stages, cross-entropy and
self-critical, can start from one checkpoint.

The model's sizes are written into the run's config (and so into its saved config, checkpoints and
bundle); a size given on the command line that differs from the model's is refused in one line, as are a
model of the other task, a tokenizer other than the model's, and ``finetune.pretrained`` beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, open_dict

from vitattn.bundle import Bundle, load_bundle
from vitattn.data import Vocabulary
from vitattn.errors import ConfigError, first_line

__all__ = ["InitModel", "apply_init", "check_init_classes", "command_line_keys", "read_init"]

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
    }
)


@dataclass
class InitModel:
    """A trained model a run starts from, and the preprocessing it was trained with.

    Attributes:
        source: the ``finetune.init`` value.
        bundle: the model, loaded on the CPU.
        preprocess: its preprocessing (``choose_preprocess`` gives it to the data).
        preprocess_from: how the run log names where the preprocessing comes from.
    """

    source: str
    bundle: Bundle

    @property
    def preprocess(self) -> dict[str, Any]:
        return dict(self.bundle.preprocess)

    @property
    def preprocess_from(self) -> str:
        return f"finetune.init={self.source}"

    def load_into(self, system: Any) -> None:
        """Copy every weight of the model into ``system.model`` (built from the config ``apply_init`` set)."""
        try:
            system.model.load_state_dict(self.bundle.model.state_dict(), strict=True)
        except RuntimeError as err:
            raise ConfigError(f"finetune.init={self.source}: {first_line(err)}") from None
        rank_zero_info(f"finetune.init: started from every weight of the {self.bundle.task} model {self.source}")


def read_init(source: str) -> InitModel:
    """The model ``finetune.init=source`` names, or a one-line ``ConfigError``."""
    path = Path(str(source)).expanduser()
    if not path.exists():
        raise ConfigError(f"finetune.init={source} does not exist; give a vitattn run folder, bundle or .ckpt")
    try:
        bundle = load_bundle(path)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"finetune.init={source}: {first_line(err)}") from None
    if bundle.runtime != "torch":
        raise ConfigError(f"finetune.init={source} is an ONNX folder; give the run folder or bundle it came from")
    return InitModel(str(source), bundle)


def command_line_keys() -> list[str]:
    """The keys (and groups) the command line set: the Hydra overrides of a ``vitattn-train`` run; none when
    the config was composed another way."""
    if not HydraConfig.initialized():
        return []
    return [o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task]


def apply_init(cfg: DictConfig, init: InitModel, given: list[str]) -> None:
    """Write the model's sizes, image size and caption length into ``cfg`` (in place) and log them.

    Args:
        given: the keys the command line set (``command_line_keys``); one that the model contradicts is refused.

    Raises:
        ConfigError: a model of the other task; ``finetune.pretrained`` as well; a tokenizer other than the
            model's; a size given that differs from the model's.
    """
    bundle, task = init.bundle, cfg.head.task
    if bundle.task != task:
        raise ConfigError(
            f"finetune.init={init.source} is a {bundle.task} model, not a {task} model (head={task}); start from a "
            f"{task} model, or use finetune.pretrained={init.source} to start only the encoder from it"
        )
    if cfg.finetune.get("pretrained"):
        raise ConfigError(
            f"finetune.init={init.source} and finetune.pretrained={cfg.finetune.pretrained} both say where the "
            "encoder starts; keep one"
        )
    if task == "caption":
        _refuse_other_tokenizer(cfg, init, given)
    wanted = _config_values(cfg, bundle.config["model"])
    contradicted = [
        f"{key}={_current(cfg, key)}"
        for key, value in wanted.items()
        if _given(key, given) and _current(cfg, key) != value
    ]
    if contradicted:
        theirs = " ".join(f"{key.split('=')[0]}={wanted[key.split('=')[0]]}" for key in contradicted)
        raise ConfigError(
            f"finetune.init={init.source}: its model has {theirs}, not {' '.join(contradicted)} as given; the model's "
            "sizes come from finetune.init, so drop them from the command line"
        )
    changed = []
    with open_dict(cfg):
        for key, value in wanted.items():
            if _current(cfg, key) != value:
                changed.append(f"{key} {_current(cfg, key)} -> {value}")
                _set(cfg, key, value)
    rank_zero_info(
        f"finetune.init={init.source}: the model's sizes, tokenizer and preprocessing"
        + (f"; set from it: {', '.join(changed)}" if changed else "")
    )


def _config_values(cfg: DictConfig, model: dict[str, Any]) -> dict[str, Any]:
    """The config keys and values that build ``model`` (a saved model config) again."""
    if cfg.head.task == "classification":
        encoder, decoder = model, None
    else:
        encoder, decoder = model["encoder"], model["decoder"]
    values = {"data.img_size": encoder["img_size"]}
    values.update(
        {f"model.{k}": encoder[k] for k in cfg.model if k in encoder and k not in TRAINING_KEYS | {"img_size"}}
    )
    if decoder is not None:
        values["data.max_caption_len"] = decoder["max_len"]
        values.update(
            {
                f"head.decoder.{k}": decoder[k]
                for k in cfg.head.decoder
                if k in decoder and k not in TRAINING_KEYS | {"max_len"}
            }
        )
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def _current(cfg: DictConfig, key: str) -> Any:
    value = cfg
    for part in key.split("."):
        value = value[part]
    return list(value) if hasattr(value, "__len__") and not isinstance(value, str) else value


def _set(cfg: DictConfig, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    node[last] = value


def _given(key: str, given: list[str]) -> bool:
    """Whether the command line set ``key`` itself, or the group it belongs to (``model=small`` sets model.*)."""
    group = key.split(".")[0]
    return key in given or (group == "model" and "model" in given)


def _refuse_other_tokenizer(cfg: DictConfig, init: InitModel, given: list[str]) -> None:
    theirs = init.bundle.vocab
    kind = "words" if isinstance(theirs, Vocabulary) else "subword"
    asked = [k for k in given if k == "tokenizer" or k.startswith("tokenizer.") or k == "data.vocab_path"]
    ours = cfg.tokenizer.kind if "tokenizer" in cfg else "words"
    if asked and (cfg.data.get("vocab_path") or (ours == "words") != (kind == "words")):
        raise ConfigError(
            f"finetune.init={init.source} brings its own tokenizer ({type(theirs).__name__}, {len(theirs)} tokens), "
            f"not the one {' '.join(asked)} asks for; drop {' '.join(asked)}"
        )


def check_init_classes(init: InitModel, datamodule: Any) -> None:
    """A classifier started from ``init`` is trained on the classes it has, in its order; else one line."""
    theirs = init.bundle.class_names
    if init.bundle.task == "classification" and list(datamodule.class_names) != list(theirs):
        raise ConfigError(
            f"finetune.init={init.source} classifies {list(theirs)}; the data's classes are "
            f"{list(datamodule.class_names)}; train on the same classes"
        )
