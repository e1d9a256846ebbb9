"""Data: built-in shapes, COCO-style captions, Karpathy splits, the caption vocabulary, and LightningDataModules.

The DataModules (``vitattn.training.datamodules``, Lightning) and ``datamodule_from_run`` (Hydra) are
imported when first named (PEP 562), so that inference, which reads images and vocabularies from
here, never imports Lightning or Hydra; ``vitattn.training.datamodules.ShapesDataModule`` still resolves as a
config ``_target_``.
"""

from vitattn.data.bad_images import find_bad_images
from vitattn.data.coco import CocoCaptionDataset, CocoImage, load_coco_captions, load_karpathy
from vitattn.data.images import BadImageError, EvalSplit, image_folder_split, read_image
from vitattn.data.preprocess import default_preprocess, denormalize, eval_transform, normalize
from vitattn.data.shapes import CLASS_NAMES, ShapesDataset
from vitattn.data.tokenizer import (
    SubwordTokenizer,
    TokenizedCaptions,
    Tokenizer,
    Vocabulary,
    collate_captions,
    load_tokenizer,
)

__all__ = [
    "BadImageError",
    "find_bad_images",
    "CLASS_NAMES",
    "CocoCaptionDataset",
    "CocoImage",
    "ShapesDataset",
    "SubwordTokenizer",
    "TokenizedCaptions",
    "Tokenizer",
    "Vocabulary",
    "collate_captions",
    "denormalize",
    "load_coco_captions",
    "load_karpathy",
    "load_tokenizer",
    "read_image",
    "EvalSplit",
    "image_folder_split",
    "default_preprocess",
    "eval_transform",
    "normalize",
]


def __dir__() -> list[str]:
    return sorted(__all__)
