"""vitattn: vision transformers for classification and captioning, built from the multi-head attention
tutorial's layers (``vitattn.layers``). Importing it changes nothing global (``tests/test_imports.py``)."""

__version__ = "0.1.0"

__all__ = ["Captioner", "Classifier", "__version__"]


def __getattr__(name: str):
    if name in ("Captioner", "Classifier"):
        # heavy: the API (torch) is imported when first named, so ``import vitattn`` stays light
        from vitattn.inference import api

        return getattr(api, name)
    raise AttributeError(f"module 'vitattn' has no attribute {name!r}")
