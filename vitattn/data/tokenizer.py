"""Caption tokenizers: word-level (``Vocabulary``) or subword (Hugging Face ``tokenizers``), one interface.

``tokenizer=words`` is ``vitattn.data.vocab.Vocabulary``: COCO word tokens, rare words become ``<unk>``.
``tokenizer=bpe`` trains a byte-level BPE on the training captions (``train_bpe``): every string has an
encoding, so there is no unknown token. ``tokenizer=file`` reads a ``tokenizer.json`` (a pretrained text
model's), with ``<pad> <bos> <eos>`` added where it lacks them. Both subword kinds are ``SubwordTokenizer``,
saved as ``tokenizer.json`` where a word vocabulary is saved as ``vocab.json``; ``load_tokenizer`` reads either.

What ``bpe`` normalises (its ``tokenizer.json`` normaliser, so every runtime does the same): Unicode NFC,
lower case, each run of whitespace one space, none at the ends; punctuation, digits, accents and emoji stay.
``decode(encode(text))`` is that normalised text (``normalize_caption``), as long as ``max_len`` cuts nothing.
"""

from __future__ import annotations

import json
import os
import sys
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from vitattn.data.vocab import SPECIALS, VOCAB_FORMAT, Vocabulary
from vitattn.errors import first_line
from vitattn.fileio import atomic_write
from vitattn.metrics.tokenize import coco_tokenize
from vitattn.run_dir import TOKENIZER_FILE, VOCAB_FILE

__all__ = [
    "KINDS",
    "SUBWORD_SPECIALS",
    "SubwordTokenizer",
    "Tokenizer",
    "auto_bpe_size",
    "describe_tokenizer",
    "load_tokenizer",
    "normalize_caption",
    "tokenizer_file_name",
    "tokenizer_from_labels",
    "tokenizer_labels",
    "train_bpe",
    "unknown_share",
]

KINDS = ("words", "bpe", "file")
SUBWORD_SPECIALS = ("<pad>", "<bos>", "<eos>")
MAX_AUTO_BPE = 32000
_BYTES = 256  # the byte-level alphabet


@runtime_checkable
class Tokenizer(Protocol):
    """What training and every runtime need of a caption tokenizer."""

    pad_id: int
    bos_id: int
    eos_id: int
    unk_id: int | None  # None: every text has an encoding (byte-level BPE)

    def __len__(self) -> int: ...

    def encode(self, text: str, max_len: int | None = None) -> list[int]:
        """``[bos, ..., eos]``, at most ``max_len`` ids."""
        ...

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The caption of ``ids`` up to the first eos, special tokens left out."""
        ...

    def decode_batch(self, ids: Sequence[Sequence[int]] | torch.Tensor) -> list[str]: ...

    def tokens(self, ids: Sequence[int]) -> list[str]:
        """One display string per id before eos or pad (what attention figures label positions with)."""
        ...

    def save(self, path: str | os.PathLike) -> None: ...


def normalize_caption(text: str) -> str:
    """What ``tokenizer=bpe`` makes of a caption before encoding: NFC, lower case, single spaces, no ends."""
    return " ".join(unicodedata.normalize("NFC", text).lower().split())


def _check_range(ids: list[int], size: int) -> None:
    bad = next((i for i in ids if not 0 <= i < size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the tokenizer's {size} tokens")


class SubwordTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with ``<pad> <bos> <eos>``, as captioning uses it.

    Args:
        tokenizer: the Hugging Face tokenizer; it must hold the three special tokens.
        source: where it came from, for messages.
    """

    def __init__(self, tokenizer: Any, source: str = "tokenizer") -> None:
        ids = [tokenizer.token_to_id(t) for t in SUBWORD_SPECIALS]
        missing = [t for t, i in zip(SUBWORD_SPECIALS, ids) if i is None]
        if missing:
            raise ValueError(
                f"{source} has no {' '.join(missing)} token; use a tokenizer.json written by vitattn "
                "(tokenizer=file adds them to a pretrained one)"
            )
        tokenizer.no_padding()  # a pretrained tokenizer.json may pad or cut every encoding: captions do their own
        tokenizer.no_truncation()
        self.hf = tokenizer
        self.pad_id, self.bos_id, self.eos_id = ids
        unk = getattr(tokenizer.model, "unk_token", None)
        self.unk_id: int | None = tokenizer.token_to_id(unk) if unk else None
        self._size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self._special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special} | set(ids)

    @classmethod
    def from_file(cls, path: str | os.PathLike, add_specials: bool = False) -> SubwordTokenizer:
        """Read a ``tokenizer.json``; ``add_specials``: add ``<pad> <bos> <eos>`` where it lacks them.

        Raises:
            ValueError: the file is not a tokenizer.json that ``tokenizers`` can load (one line, with the fix).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - tokenizers raises a plain Exception for bad JSON or fields
            raise ValueError(
                f"{path} cannot be loaded as a Hugging Face tokenizer.json ({first_line(err)[:160]}); "
                "give a file written by tokenizers' Tokenizer.save, e.g. a pretrained text model's tokenizer.json"
            ) from None
        if add_specials:
            tokenizer.add_special_tokens(list(SUBWORD_SPECIALS))
        return cls(tokenizer, str(path))

    @classmethod
    def from_str(cls, text: str, source: str = "tokenizer") -> SubwordTokenizer:
        """A tokenizer from its ``tokenizer.json`` text (a checkpoint keeps it so)."""
        try:
            tokenizer = HFTokenizer.from_str(text)
        except Exception as err:  # noqa: BLE001 - as in from_file
            raise ValueError(f"{source} is not a Hugging Face tokenizer.json: {first_line(err)[:160]}") from None
        return cls(tokenizer, source)

    def __len__(self) -> int:
        return self._size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SubwordTokenizer):
            return NotImplemented
        return json.loads(self.to_str()) == json.loads(other.to_str())

    __hash__ = None

    def __repr__(self) -> str:
        return f"SubwordTokenizer({len(self)} tokens)"

    def normalize(self, text: str) -> str:
        """``text`` as the tokenizer's own normaliser leaves it (unchanged when it has none)."""
        normalizer = self.hf.normalizer
        return normalizer.normalize_str(text) if normalizer is not None else text

    def encode(self, text: str, max_len: int | None = None) -> list[int]:
        """Token ids ``[bos, t1, ..., tn, eos]``; longer than ``max_len``: the last subwords are cut, eos kept."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if max_len is not None:
            if max_len < 2:
                raise ValueError(f"max_len={max_len} must be at least 2 to hold <bos> and <eos>")
            ids = ids[: max_len - 2]
        return [self.bos_id, *ids, self.eos_id]

    def _content(self, ids: Sequence[int] | torch.Tensor) -> list[int]:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        _check_range(ids, len(self))
        return [i for i in ids if i not in self._special]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The caption of ``ids`` up to the first eos, special tokens left out."""
        return self.hf.decode(self._content(ids), skip_special_tokens=True).strip()

    def decode_batch(self, ids: Sequence[Sequence[int]] | torch.Tensor) -> list[str]:
        """``decode`` each row of ``ids`` (B, T)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return [self.decode(row) for row in ids]

    def tokens(self, ids: Sequence[int]) -> list[str]:
        """Each id before eos or pad as its text (a piece of a word; an unfinished UTF-8 byte shows as �)."""
        shown = []
        for i in ids:
            if i in (self.eos_id, self.pad_id):
                break
            text = "" if i in self._special else self.hf.decode([i], skip_special_tokens=False).strip()
            shown.append(text or self.hf.id_to_token(i) or "")
        return shown

    def to_str(self) -> str:
        """The ``tokenizer.json`` text."""
        return self.hf.to_str()

    def save(self, path: str | os.PathLike) -> None:
        """Write the ``tokenizer.json``, atomically."""
        atomic_write(path, self.hf.to_str(pretty=True) + "\n")


def auto_bpe_size(captions: Iterable[str]) -> int:
    """The BPE vocabulary ``vocab_size=auto`` trains: the 256 bytes, the specials and one merge per word seen
    at least twice in the captions (so frequent words end up whole), rounded up to 64, at most 32,000."""
    counts = Counter(word for caption in captions for word in coco_tokenize(caption))
    frequent = sum(1 for n in counts.values() if n >= 2)
    size = _BYTES + len(SUBWORD_SPECIALS) + frequent
    return min(MAX_AUTO_BPE, -(-size // 64) * 64)


def train_bpe(
    captions: Sequence[str], vocab_size: int | str = "auto", progress: bool | None = None
) -> SubwordTokenizer:
    """A byte-level BPE trained on ``captions`` (normalised as the module docstring says); no unknown token.

    Args:
        captions: the training captions.
        vocab_size: tokens in all (bytes, specials and merges); ``auto``: ``auto_bpe_size(captions)``.
        progress: show tokenizers' progress bar; None: when the output is a terminal.
    """
    if vocab_size == "auto":
        vocab_size = auto_bpe_size(captions)
    smallest = _BYTES + len(SUBWORD_SPECIALS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < smallest:
        raise ValueError(f"tokenizer.vocab_size={vocab_size!r} must be auto or at least {smallest} (bytes, specials)")
    tokenizer = HFTokenizer(models.BPE())  # no unk_token: the byte alphabet covers every string
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Lowercase(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SUBWORD_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=bool(progress) if progress is not None else sys.stderr.isatty(),
    )
    tokenizer.train_from_iterator(captions, trainer, length=len(captions))
    return SubwordTokenizer(tokenizer, "the trained BPE")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved at ``path``: a ``Vocabulary`` (``vocab.json``) or a ``SubwordTokenizer`` (any
    ``tokenizer.json``), told apart by the file name, or by content under another name.

    Raises:
        ValueError: a file that is neither (one line naming it and the fix).
    """
    path = Path(path)
    if path.name == VOCAB_FILE:
        return Vocabulary.load(path)
    if path.name == TOKENIZER_FILE:
        return SubwordTokenizer.from_file(path)
    try:
        head = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer file not found: {path}") from None
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{path} cannot be read as a tokenizer ({first_line(err)[:160]}); give a vocab.json or tokenizer.json "
            "written by vitattn, or a Hugging Face tokenizer.json with tokenizer=file"
        ) from None
    if isinstance(head, dict) and (head.get("format") == VOCAB_FORMAT or "itos" in head):
        return Vocabulary.load(path)
    return SubwordTokenizer.from_file(path)


def tokenizer_file_name(tokenizer: Tokenizer) -> str:
    """The file a run, bundle or ONNX folder keeps ``tokenizer`` in."""
    return TOKENIZER_FILE if isinstance(tokenizer, SubwordTokenizer) else VOCAB_FILE


def tokenizer_labels(tokenizer: Tokenizer) -> list[str] | str:
    """What a checkpoint keeps of ``tokenizer`` (plain types, for ``weights_only`` loading): a vocabulary's
    words in id order, or a subword tokenizer's ``tokenizer.json`` text."""
    if isinstance(tokenizer, SubwordTokenizer):
        return tokenizer.to_str()
    return list(tokenizer.words)


def tokenizer_from_labels(labels: Any, source: str = "checkpoint") -> Tokenizer:
    """The tokenizer ``tokenizer_labels`` kept: a list of words (specials first or left out) or JSON text."""
    if isinstance(labels, str):
        return SubwordTokenizer.from_str(labels, source)
    if not isinstance(labels, (list, tuple)) or not all(isinstance(w, str) for w in labels):
        raise ValueError(f"{source}: 'vocab' must be the list of words in id order or a tokenizer.json text")
    words = list(labels[len(SPECIALS) :]) if tuple(labels[: len(SPECIALS)]) == SPECIALS else list(labels)
    return Vocabulary(words)


def unknown_share(tokenizer: Tokenizer, captions: Iterable[str], limit: int = 50_000) -> float:
    """The share of the caption words (``coco_tokenize``) that ``tokenizer`` encodes with its unknown token
    (0 for a tokenizer without one); the first ``limit`` captions for a subword tokenizer with one."""
    if tokenizer.unk_id is None:
        return 0.0
    stoi = getattr(tokenizer, "stoi", None)
    total = unknown = 0
    for n, caption in enumerate(captions):
        if stoi is None and n >= limit:
            break
        for word in coco_tokenize(caption):
            total += 1
            if stoi is not None:
                unknown += word not in stoi
            else:
                unknown += tokenizer.unk_id in tokenizer.encode(word)
    return unknown / total if total else 0.0


def describe_tokenizer(tokenizer: Tokenizer) -> str:
    """``the 9,487-word vocabulary (min_word_freq=5)`` or ``the 1,024-token subword tokenizer``."""
    if isinstance(tokenizer, SubwordTokenizer):
        return f"the {len(tokenizer):,}-token subword tokenizer"
    freq = getattr(tokenizer, "min_freq", None)
    return f"the {len(tokenizer.words):,}-word vocabulary" + (f" (min_word_freq={freq})" if freq is not None else "")
