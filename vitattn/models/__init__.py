"""Plain ``nn.Module`` models: the ViT encoder, the caption decoder and generate, CoCa's embeddings; timm weights:
``timm_weights``."""

from vitattn.models.caption import CaptionDecoder, ImageCaptioner
from vitattn.models.coca import CocaCaptioner, Embedder, captioner_from_config
from vitattn.models.vit import PRESETS, VisionTransformer, vit_preset

TASKS = ("caption", "classification")  # what a vitattn model is trained for: a caption or a class per image

__all__ = [
    "PRESETS",
    "TASKS",
    "CaptionDecoder",
    "CocaCaptioner",
    "Embedder",
    "ImageCaptioner",
    "VisionTransformer",
    "captioner_from_config",
    "vit_preset",
]
