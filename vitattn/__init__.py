"""vitattn: vision transformers for classification and captioning, built from the multi-head
attention tutorial's layers (``vitattn.layers``), with Lightning systems and Hydra configs.

Importing vitattn changes nothing global (no import hook, warning filter, logging handler or environment
variable; ``tests/test_imports.py`` checks it): what a command needs for its own process, its console entry
point does (``vitattn.cli``).
"""

__version__ = "0.1.0"

__all__ = ["Captioner", "Classifier", "__version__"]


def __getattr__(name: str):
    if name in ("Captioner", "Classifier"):
        # heavy: the API (torch) is imported when first named, so ``import vitattn`` stays light
        from vitattn.inference import api

        return getattr(api, name)
    raise AttributeError(f"module 'vitattn' has no attribute {name!r}")
