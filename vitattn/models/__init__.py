"""Plain ``nn.Module`` models: the ViT encoder, the caption decoder, timm weight import."""

from vitattn.models.caption import CaptionDecoder, ImageCaptioner
from vitattn.models.timm_weights import convert_timm_state_dict, load_timm_weights
from vitattn.models.vit import PRESETS, VisionTransformer, vit_preset

__all__ = [
    "PRESETS",
    "CaptionDecoder",
    "ImageCaptioner",
    "VisionTransformer",
    "convert_timm_state_dict",
    "load_timm_weights",
    "vit_preset",
]
