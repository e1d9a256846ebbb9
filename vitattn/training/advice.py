"""One warning line at start-up for each way the config fights the data or the trainer's limits.

Nothing here stops a run: a coarse patch grid, a vocabulary that turns most caption words into
``<unk>``, and a schedule that cannot anneal all train, only worse than they could.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from omegaconf import DictConfig

from vitattn.data.tokenizer import describe_tokenizer, unknown_share

__all__ = ["MIN_TOKENS", "UNK_WARN_SHARE", "check_fit"]

log = logging.getLogger(__name__)

MIN_TOKENS = 36  # a 6 x 6 patch grid
UNK_WARN_SHARE = 0.05


def _grid(cfg: DictConfig, img_size: int) -> str | None:
    side = img_size // cfg.model.patch_size
    if side * side >= MIN_TOKENS:
        return None
    better = next((p for p in (16, 14, 8, 7, 4, 2) if (img_size // p) ** 2 >= MIN_TOKENS and img_size % p == 0), None)
    fix = f"; try model.patch_size={better}" if better else ""
    return (
        f"model.patch_size={cfg.model.patch_size} cuts {img_size} px images into a {side}x{side} grid "
        f"({side * side} tokens, fewer than {MIN_TOKENS}): attention has little to work with{fix}"
    )


def _vocabulary(cfg: DictConfig, datamodule: Any) -> str | None:
    vocab, train = getattr(datamodule, "vocab", None), getattr(datamodule, "train_dataset", None)
    captions = getattr(datamodule, "train_captions", None) or getattr(getattr(train, "dataset", None), "captions", None)
    kind = cfg.get("tokenizer", {}).get("kind", "words")
    if vocab is None or (captions is None and vocab.unk_id is not None):
        return None
    share = unknown_share(vocab, captions or [])
    if vocab.unk_id is None:
        log.info(
            "tokenizer=%s: no caption word is outside %s (it has no unknown token)", kind, describe_tokenizer(vocab)
        )
    else:
        also = "; tokenizer=bpe has none" if kind != "bpe" else ""
        log.info("%.1f %% of caption words are outside %s%s", 100 * share, describe_tokenizer(vocab), also)
    if share <= UNK_WARN_SHARE:
        return None
    fix = (
        f"tokenizer.path={cfg.tokenizer.path} lacks these words: choose another file"
        if kind == "file"
        else f"lower data.min_word_freq={cfg.data.min_word_freq}"
        if "min_word_freq" in cfg.data
        else "use a vocabulary built from these captions (data.vocab_path=null)"
    )
    fix += "; or tokenizer=bpe, which has no unknown token"
    most = "most " if share > 0.5 else ""
    return f"{most}training caption tokens become <unk> ({100 * share:.1f} %, over {100 * UNK_WARN_SHARE:.0f} %); {fix}"


def _step_limit(trainer: DictConfig, steps_per_epoch: int) -> float:
    """Optimizer steps at which ``max_steps`` or ``max_epochs`` ends training (the first of them), or inf."""
    steps, epochs = trainer.get("max_steps") or 0, trainer.get("max_epochs") or 0
    limits = [n for n in (steps, epochs * steps_per_epoch) if n > 0]  # -1 or null: no limit
    return float(min(limits)) if limits else math.inf


def _schedule(cfg: DictConfig, datamodule: Any) -> str | None:
    trainer = cfg.trainer
    if trainer.get("fast_dev_run"):
        return None
    batches = len(datamodule.train_dataloader())
    if isinstance(trainer.get("limit_train_batches"), int):  # a float is a share of the epoch
        batches = min(batches, trainer.limit_train_batches)
    steps_per_epoch = max(1, math.ceil(batches / max(1, trainer.get("accumulate_grad_batches") or 1)))
    limit = _step_limit(trainer, steps_per_epoch)
    if not math.isfinite(limit) and not trainer.get("max_time"):
        return (
            "no trainer.max_steps, trainer.max_epochs or trainer.max_time: the learning-rate schedule has no end "
            "and stays at its peak; set one of them"
        )
    warmup = cfg.optim.get("warmup_steps", "auto")  # auto fits any run: no advice needed
    if warmup != "auto" and math.isfinite(limit) and warmup > limit // 10 and not trainer.get("max_time"):
        return (
            f"optim.warmup_steps={warmup} is more than a tenth of the {int(limit)}-step run: warmup is cut to "
            f"{max(1, int(limit) // 10)} steps; lower optim.warmup_steps or train longer"
        )
    return None


def check_fit(cfg: DictConfig, datamodule: Any) -> list[str]:
    """Warn (one line each) where the config fights the data or the limits; returns the warnings."""
    warnings = [
        w for w in (_grid(cfg, datamodule.img_size), _vocabulary(cfg, datamodule), _schedule(cfg, datamodule)) if w
    ]
    for warning in warnings:
        log.warning(warning)
    return warnings
