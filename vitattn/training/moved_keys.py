"""Config keys that moved to another group: a command line or an experiment still using the old key gets one
line naming the new one (light: the command line checks it before torch loads)."""

from __future__ import annotations

from vitattn.errors import ConfigError

__all__ = ["MOVED_KEYS", "check_moved_keys"]

# Keys that moved out of the model group (which holds VisionTransformer's arguments only): old -> new.
MOVED_KEYS = {
    "model.pretrained": "finetune.pretrained",
    "model.freeze_encoder_epochs": "finetune.freeze_encoder_epochs",
}


def check_moved_keys(overrides: list[str]) -> None:
    """Refuse a command-line override of a key that moved (``model.pretrained=X``), naming its new key."""
    for override in overrides:
        key, _, value = override.partition("=")
        new = MOVED_KEYS.get(key.lstrip("+~"))
        if new is not None:
            raise ConfigError(f"{key.lstrip('+~')} is now {new}: use {new}={value}")
