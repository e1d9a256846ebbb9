"""Inference: the Python API (``api``), image files and shards captioned into resumable outputs
(``captioning``; a whole run as plain values, ``jobs``), what to caption (``file_list``) and where the model looked
(``attention_maps``).
"""

from vitattn.inference.attention_maps import attention_figure, attention_from_tokens, attention_rollout, figure_png
from vitattn.inference.captioning import (
    CaptionSummary,
    caption_files,
    caption_images,
    caption_shards,
    generate_tokens,
)
from vitattn.inference.file_list import InputImage, InputList, list_inputs

__all__ = [
    "CaptionSummary",
    "InputImage",
    "InputList",
    "attention_figure",
    "attention_from_tokens",
    "attention_rollout",
    "caption_files",
    "caption_images",
    "caption_shards",
    "figure_png",
    "generate_tokens",
    "list_inputs",
]
