"""Data: built-in shapes, COCO-style captions, the caption vocabulary, and LightningDataModules."""

from vitattn.data.captions import TokenizedCaptions, collate_captions
from vitattn.data.coco import CocoCaptionDataset, CocoImage, load_coco_captions
from vitattn.data.datamodules import (
    CocoCaptionDataModule,
    EvalSplit,
    ImageFolderDataModule,
    ShapesDataModule,
    image_folder_split,
)
from vitattn.data.images import read_image
from vitattn.data.preprocess import default_preprocess, denormalize, eval_transform
from vitattn.data.run_data import datamodule_from_run
from vitattn.data.shapes import CLASS_NAMES, ShapesDataset
from vitattn.data.transforms import (
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
    "collate_captions",
    "denormalize",
    "load_coco_captions",
    "read_image",
    "EvalSplit",
    "image_folder_split",
    "default_preprocess",
    "eval_transform",
    "datamodule_from_run",
    "normalize",
]
