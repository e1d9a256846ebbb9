"""Word-level caption vocabulary, stored as plain JSON."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from vitattn.errors import brief
from vitattn.fileio import atomic_write, read_json
from vitattn.metrics.tokenize import coco_tokenize

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIALS))
VOCAB_FORMAT = "vitattn.vocabulary"
_VERSION = 1


AUTO_MAX_UNKNOWN = 0.02


def auto_min_freq(counts: Counter[str], max_unknown: float = AUTO_MAX_UNKNOWN) -> int:
    """The largest word-count threshold in 5..1 whose rarer words make at most ``max_unknown`` of all tokens."""
    total = sum(counts.values()) or 1
    for threshold in (5, 4, 3, 2):
        if sum(n for n in counts.values() if n < threshold) / total <= max_unknown:
            return threshold
    return 1


class Vocabulary:
    """Maps caption words to ids and back; ids 0-3 are ``<pad> <bos> <eos> <unk>``.

    Args:
        words: the ordinary words in id order; they get ids from ``len(SPECIALS)`` on.
    """

    def __init__(self, words: Sequence[str]) -> None:
        self.itos: list[str] = [*SPECIALS, *words]
        self.stoi: dict[str, int] = {word: i for i, word in enumerate(self.itos)}
        self.min_freq: int | None = None  # the threshold it was built with (for messages); None when loaded
        if len(self.stoi) != len(self.itos):
            repeated = sorted(w for w, n in Counter(self.itos).items() if n > 1)
            raise ValueError(f"vocabulary words must be unique and not special; repeated: {brief(repeated, 300)}")

    @classmethod
    def build(cls, captions: Iterable[str], min_freq: int | str = 1) -> Vocabulary:
        """Vocabulary of the words seen at least ``min_freq`` times, most frequent first.

        ``min_freq="auto"``: the largest threshold up to COCO's 5 that leaves at most
        ``AUTO_MAX_UNKNOWN`` of the captions' tokens as ``<unk>`` (5 on COCO, 1 on a small dataset
        of names). Ties are broken alphabetically, so the same captions always give the same ids.
        """
        counts = Counter(word for caption in captions for word in coco_tokenize(caption))
        if min_freq == "auto":
            min_freq = auto_min_freq(counts)
        if not isinstance(min_freq, int) or min_freq < 1:
            raise ValueError(f"min_freq={min_freq!r} must be at least 1 or auto")
        words = [w for w in counts if counts[w] >= min_freq and w not in SPECIALS]
        vocab = cls(sorted(words, key=lambda w: (-counts[w], w)))
        vocab.min_freq = min_freq
        return vocab

    @property
    def words(self) -> list[str]:
        """The ordinary words in id order: what ``Vocabulary(words)`` rebuilds this from."""
        return self.itos[len(SPECIALS) :]

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def bos_id(self) -> int:
        return BOS_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    @property
    def unk_id(self) -> int:
        return UNK_ID

    def __len__(self) -> int:
        return len(self.itos)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Vocabulary):
            return NotImplemented
        return self.itos == other.itos

    __hash__ = None  # mutable lists inside; equal vocabularies need not hash alike

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} tokens)"

    def encode(self, text: str, max_len: int | None = None) -> list[int]:
        """Token ids ``[bos, w1, ..., wn, eos]``; unknown words map to ``unk_id``.

        Args:
            text: a raw caption; tokenised with ``coco_tokenize``.
            max_len: longest result, bos and eos included; longer captions lose words, keep eos.
        """
        ids = [self.stoi.get(word, self.unk_id) for word in coco_tokenize(text)]
        if max_len is not None:
            if max_len < 2:
                raise ValueError(f"max_len={max_len} must be at least 2 to hold <bos> and <eos>")
            ids = ids[: max_len - 2]
        return [self.bos_id, *ids, self.eos_id]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Words for ``ids`` up to the first eos, special tokens left out."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        words = []
        for i in ids:
            if i == self.eos_id:
                break
            if not 0 <= i < len(self.itos):
                raise ValueError(f"token id {i} is outside the vocabulary of {len(self)} tokens")
            if i >= len(SPECIALS):
                words.append(self.itos[i])
        return " ".join(words)

    def decode_batch(self, ids: Sequence[Sequence[int]] | torch.Tensor) -> list[str]:
        """``decode`` each row of ``ids`` (B, T)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return [self.decode(row) for row in ids]

    def tokens(self, ids: Sequence[int]) -> list[str]:
        """The word of each id before eos or pad (``<unk>`` kept, so words line up with positions)."""
        words = []
        for i in ids:
            if i in (self.eos_id, self.pad_id):
                break
            words.append(self.itos[i])
        return words

    def save(self, path: str | os.PathLike) -> None:
        """Write the vocabulary as JSON (specials included, in id order), atomically."""
        payload = {"format": VOCAB_FORMAT, "version": _VERSION, "itos": self.itos}
        atomic_write(path, json.dumps(payload, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocabulary:
        """Read a vocabulary written by ``save``."""
        payload = read_json(path, "vocabulary file")
        itos = payload.get("itos") if isinstance(payload, dict) else None
        if not isinstance(itos, list) or not all(isinstance(w, str) for w in itos):
            raise ValueError(f"vocabulary file {path} needs an 'itos' list of strings")
        if tuple(itos[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(
                f"vocabulary file {path} starts with {brief(itos[: len(SPECIALS)], 300)}, expected {list(SPECIALS)}"
            )
        try:
            return cls(itos[len(SPECIALS) :])
        except ValueError as err:  # repeated words
            raise ValueError(f"vocabulary file {path}: {err}") from None
