"""Data reading: images, the built-in shapes, COCO and Karpathy captions, tokenizers, shards. No Lightning:
the DataModules are ``vitattn.training.datamodules``."""

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
