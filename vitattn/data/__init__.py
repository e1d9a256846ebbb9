"""Data: built-in shapes, COCO-style captions, the caption vocabulary, and LightningDataModules."""

from vitattn.data.captions import TokenizedCaptions, collate_captions
from vitattn.data.coco import CocoCaptionDataset, CocoImage, load_coco_captions, load_image
from vitattn.data.datamodules import CocoCaptionDataModule, ImageFolderDataModule, ShapesDataModule
from vitattn.data.shapes import CLASS_NAMES, ShapesDataset
from vitattn.data.transforms import (
    caption_transform,
    classification_transform,
    denormalize,
    normalize,
)
from vitattn.data.vocab import Vocabulary

__all__ = [
    "CLASS_NAMES",
    "CocoCaptionDataModule",
    "CocoCaptionDataset",
    "CocoImage",
    "ImageFolderDataModule",
    "ShapesDataModule",
    "ShapesDataset",
    "TokenizedCaptions",
    "Vocabulary",
    "caption_transform",
    "classification_transform",
    "collate_captions",
    "denormalize",
    "load_coco_captions",
    "load_image",
    "normalize",
]
