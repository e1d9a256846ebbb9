"""Turning caption datasets into token batches: ``TokenizedCaptions`` and ``collate_captions``."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from vitattn.data.tokenizer import Tokenizer
from vitattn.data.vocab import PAD_ID


class TokenizedCaptions(Dataset):
    """Adds token ids to a caption dataset's items.

    The wrapped dataset yields dicts ``{"image", "caption", "references", "image_id"}``; this one
    yields ``{"image", "tokens", "references", "image_id"}``, ``tokens`` (T,) long ``bos ... eos``.

    Args:
        dataset: a caption dataset (``ShapesDataset`` with task "caption", ``CocoCaptionDataset``).
        vocab: the vocabulary to encode with.
        max_len: longest token sequence, bos and eos included.
        sample_caption: encode a random reference each time (training on COCO); otherwise always
            the item's ``caption``.
    """

    def __init__(self, dataset: Dataset, vocab: Tokenizer, max_len: int, sample_caption: bool = False):
        self.dataset, self.vocab, self.max_len = dataset, vocab, max_len
        self.sample_caption = sample_caption

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.dataset[index]
        caption = item["caption"]
        if self.sample_caption:
            # torch's RNG: seeded per worker by the DataLoader and by Lightning's seed_everything
            caption = item["references"][torch.randint(len(item["references"]), ()).item()]
        tokens = self.vocab.encode(caption, max_len=self.max_len)
        return {
            "image": item["image"],
            "tokens": torch.tensor(tokens, dtype=torch.long),
            "references": item["references"],
            "image_id": item["image_id"],
        }


def collate_captions(items: list[dict[str, Any]], pad_id: int = PAD_ID) -> dict[str, Any]:
    """Batch ``TokenizedCaptions`` items.

    Returns:
        ``images`` (B, 3, height, width) (uint8 from the DataModules), ``tokens`` (B, T) long right-padded with
        ``pad_id``, ``image_ids`` (B,) long, ``references`` a list of B lists of caption strings.
    """
    return {
        "images": torch.stack([item["image"] for item in items]),  # (B, 3, height, width)
        "tokens": pad_sequence([item["tokens"] for item in items], batch_first=True, padding_value=pad_id),  # (B, T)
        "image_ids": torch.tensor([item["image_id"] for item in items], dtype=torch.long),  # (B,)
        "references": [list(item["references"]) for item in items],
    }
