"""What evaluation scores: one split's image files and ids (or ready batches) and, for captions, the references.

The DataModules give one (``evaluation_split``), and so does a user's COCO file or ImageFolder tree; it
lives here, away from the DataModules (Lightning), so that evaluating a bundle on a user's files needs none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["SPLITS", "EvalSplit"]


SPLITS = ("val", "test")  # the splits evaluation scores; training data never is


@dataclass
class EvalSplit:
    """One split as evaluation sees it.

    Attributes:
        source: what the images are, for reports (a folder, a file, a generated split).
        files: image files with ``ids`` (caption image ids, or class labels for classification);
            the caller reads them, so that an unreadable file is counted, not fatal.
        ids: one per file.
        loader: batches ready for the model, when the images are not files (the built-in data).
        references: caption task: image id -> reference captions.
        synthetic: references list every correct caption, so exact match is meaningful.
    """

    source: str
    files: list[str] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    loader: DataLoader | None = None
    references: dict[Any, list[str]] | None = None
    synthetic: bool = False
