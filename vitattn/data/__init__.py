"""Data: built-in shapes, COCO-style captions, Karpathy splits, the caption vocabulary, and LightningDataModules."""

from vitattn.data.bad_images import find_bad_images
from vitattn.data.captions import TokenizedCaptions, collate_captions
from vitattn.data.coco import CocoCaptionDataset, CocoImage, load_coco_captions
from vitattn.data.datamodules import (
    CocoCaptionDataModule,
    EvalSplit,
    ImageFolderDataModule,
    KarpathyDataModule,
    ShapesDataModule,
    WebDatasetDataModule,
    image_folder_split,
)
from vitattn.data.images import BadImageError, read_image
from vitattn.data.karpathy import load_karpathy
from vitattn.data.preprocess import default_preprocess, denormalize, eval_transform
from vitattn.data.run_data import datamodule_from_run
from vitattn.data.shapes import CLASS_NAMES, ShapesDataset
from vitattn.data.transforms import (
    normalize,
)
from vitattn.data.vocab import Vocabulary

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
    "TokenizedCaptions",
    "Vocabulary",
    "collate_captions",
    "denormalize",
    "load_coco_captions",
    "load_karpathy",
    "read_image",
    "EvalSplit",
    "image_folder_split",
    "default_preprocess",
    "eval_transform",
    "datamodule_from_run",
    "normalize",
]
