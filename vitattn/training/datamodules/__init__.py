"""LightningDataModules: built-in shapes, an ImageFolder tree, COCO-style captions, Karpathy splits, WebDataset
shards. Their batches and loaders: docs/training.md#the-datamodules.
"""

from vitattn.training.datamodules.base import ImageDataModule
from vitattn.training.datamodules.caption_files import CocoCaptionDataModule, KarpathyDataModule
from vitattn.training.datamodules.image_folder import ImageFolderDataModule
from vitattn.training.datamodules.shapes import ShapesDataModule
from vitattn.training.datamodules.webdataset import WebDatasetDataModule

__all__ = [
    "CocoCaptionDataModule",
    "ImageDataModule",
    "ImageFolderDataModule",
    "KarpathyDataModule",
    "ShapesDataModule",
    "WebDatasetDataModule",
]
