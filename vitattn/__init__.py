"""vitattn: vision transformers for classification and captioning, built from the multi-head
attention tutorial's layers (``vitattn.layers``), with Lightning systems and Hydra configs."""

__version__ = "0.1.0"

__all__ = ["Captioner", "Classifier", "__version__"]


def __getattr__(name: str):
    # The API is imported when first named, so that ``import vitattn.decoding`` (a command line's check)
    # stays free of torch.
    if name in ("Captioner", "Classifier"):
        from vitattn.inference import api

        return getattr(api, name)
    raise AttributeError(f"module 'vitattn' has no attribute {name!r}")
