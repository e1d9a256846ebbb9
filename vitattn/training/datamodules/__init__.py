"""LightningDataModules: built-in shapes, an ImageFolder tree, COCO-style captions, Karpathy splits, WebDataset
shards.

Classification batches are ``(images, labels)``: (B, 3, height, width) uint8 and (B,) long. Caption batches
are dicts from ``collate_captions``: ``images`` (B, 3, height, width) uint8, ``tokens`` (B, T) padded
``bos ... eos``, ``image_ids`` (B,) and ``references`` (B lists of strings). Loaders use plain
shuffling so that Lightning can swap in its ``DistributedSampler`` under DDP; ``image_ids`` identify
the samples it repeats to even out the ranks. The images are normalised on the device
(``ImageDataModule.on_after_batch_transfer``).
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
