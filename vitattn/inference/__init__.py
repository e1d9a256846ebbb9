"""Inference: batch captioning of image files and attention maps of generated captions."""

from vitattn.inference.attention_maps import (
    attention_from_tokens,
    attention_rollout,
    caption_attention_maps,
    save_attention_figure,
)
from vitattn.inference.captioner import (
    CaptionSummary,
    InputImage,
    caption_images,
    caption_to_file,
    iter_caption_batches,
    list_inputs,
    load_rgb,
    read_records,
)

__all__ = [
    "CaptionSummary",
    "InputImage",
    "attention_from_tokens",
    "attention_rollout",
    "caption_attention_maps",
    "caption_images",
    "caption_to_file",
    "iter_caption_batches",
    "list_inputs",
    "load_rgb",
    "read_records",
    "save_attention_figure",
]
