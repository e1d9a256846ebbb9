"""vitattn: vision transformers for classification and captioning, built from the multi-head
attention tutorial's layers (``vitattn.layers``), with Lightning systems and Hydra configs."""

__version__ = "0.1.0"
