"""Inference: batch captioning of image files and attention maps of generated captions.

``inputs`` lists what to caption, ``reading`` turns files into tensors (``vitattn.data.images``
reads them), ``captioning`` decodes batches, ``writers`` keeps resumable output files, ``records``
indexes what they hold, ``distributed`` runs the same on many devices and machines (Lightning
``Trainer.predict``), and ``attention_maps`` / ``figures`` draw what the model looked at.
``api`` is the Python API (``Captioner``, ``Classifier``, ``load_model``) over all of it, fed any image
kind by ``image_inputs``; ``onnx_runtime`` runs ONNX folders on ONNX Runtime.
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
