"""Inference: captioning image files and shards, classifying, and attention maps of generated captions.

``loader`` loads any model path as a ``LoadedModel`` (``vitattn.bundle.runtime``: a PyTorch ``Bundle``, or
``onnx_runtime``'s ``OnnxModel``). ``file_list`` lists the image files to caption, ``file_dataset`` reads them
as model inputs in loader workers (``vitattn.data.images`` decodes), ``captioning`` decodes batches,
``writers`` keeps resumable output files and ``records`` indexes what they hold; ``shard_captioning`` captions
WebDataset shards, one output per shard. ``processes`` starts several captioning processes (Lightning Fabric),
which ``distributed`` (files) and ``shard_captioning`` share. ``attention_maps`` / ``figures`` draw what the
model looked at. ``api`` is the Python API (``Captioner``, ``Classifier``) over all of it, fed any image kind
(paths, PIL, numpy, tensors) by ``image_like``.
"""

from vitattn.data.images import read_image
from vitattn.inference.attention_maps import (
    attention_figure,
    attention_from_tokens,
    attention_rollout,
    caption_attention_maps,
    figure_png,
    save_attention_figure,
)
from vitattn.inference.captioning import CaptionBatch, caption_images, generate_tokens, iter_caption_batches
from vitattn.inference.file_list import InputImage, InputList, list_inputs
from vitattn.inference.records import RecordIndex, read_records
from vitattn.inference.writers import OUTPUT_FORMATS, CaptionSummary, caption_to_file

__all__ = [
    "OUTPUT_FORMATS",
    "CaptionBatch",
    "CaptionSummary",
    "InputImage",
    "attention_figure",
    "InputList",
    "RecordIndex",
    "attention_from_tokens",
    "attention_rollout",
    "caption_attention_maps",
    "caption_images",
    "caption_to_file",
    "figure_png",
    "generate_tokens",
    "iter_caption_batches",
    "list_inputs",
    "read_image",
    "read_records",
    "save_attention_figure",
]
