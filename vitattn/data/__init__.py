"""Data: built-in shapes, COCO-style captions, Karpathy splits, the caption vocabulary, and LightningDataModules.

The DataModules (``vitattn.data.datamodules``, Lightning) and ``datamodule_from_run`` (Hydra) are
imported when first named (PEP 562), so that inference, which reads images and vocabularies from
here, never imports Lightning or Hydra; ``vitattn.data.ShapesDataModule`` still resolves as a
config ``_target_``.
"""

from importlib import import_module

from vitattn.data.bad_images import find_bad_images
from vitattn.data.captions import TokenizedCaptions, collate_captions
from vitattn.data.coco import CocoCaptionDataset, CocoImage, load_coco_captions
from vitattn.data.eval_split import EvalSplit
from vitattn.data.image_folder import image_folder_split
from vitattn.data.images import BadImageError, read_image
from vitattn.data.karpathy import load_karpathy
from vitattn.data.preprocess import default_preprocess, denormalize, eval_transform
from vitattn.data.shapes import CLASS_NAMES, ShapesDataset
from vitattn.data.tokenizer import SubwordTokenizer, Tokenizer, load_tokenizer
from vitattn.data.transforms import normalize
from vitattn.data.vocab import Vocabulary

# Names that import Lightning or Hydra, and the module that holds each.
_HEAVY = {
    "CocoCaptionDataModule": "vitattn.data.datamodules",
    "ImageFolderDataModule": "vitattn.data.datamodules",
    "KarpathyDataModule": "vitattn.data.datamodules",
    "ShapesDataModule": "vitattn.data.datamodules",
    "WebDatasetDataModule": "vitattn.data.datamodules",
    "datamodule_from_run": "vitattn.data.run_data",
}

__all__ = [
    "BadImageError",
    "find_bad_images",
    "CLASS_NAMES",
    "CocoCaptionDataModule",
    "CocoCaptionDataset",
    "CocoImage",
    "ImageFolderDataModule",
    "KarpathyDataModule",
    "ShapesDataModule",
    "ShapesDataset",
    "WebDatasetDataModule",
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
    "datamodule_from_run",
    "normalize",
]


def __getattr__(name: str):
    if name in _HEAVY:
        return getattr(import_module(_HEAVY[name]), name)
    raise AttributeError(f"module 'vitattn.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
