"""Caption tokenizers behind one interface: word-level (``Vocabulary``, ``vocab.json``) or subword (Hugging
Face ``tokenizers``, ``SubwordTokenizer``, ``tokenizer.json``: a trained byte-level BPE or a pretrained
model's), and captions as token batches (``TokenizedCaptions``, ``collate_captions``). See docs/data.md."""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice, takewhile
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from vitattn.data.preprocess import batch_images
from vitattn.errors import brief, first_line
from vitattn.fileio import atomic_write, read_json
from vitattn.metrics.tokenize import coco_tokenize
from vitattn.run_dir import TOKENIZER_FILE, VOCAB_FILE

__all__ = [
    "auto_bpe_size",
    "auto_min_freq",
    "check_bpe_size",
    "check_captions_per_image",
    "collate_captions",
    "describe_tokenizer",
    "draw_captions",
    "KINDS",
    "load_tokenizer",
    "SPECIALS",
    "SUBWORD_SPECIALS",
    "SubwordTokenizer",
    "TokenizedCaptions",
    "Tokenizer",
    "tokenizer_file_name",
    "tokenizer_from_labels",
    "tokenizer_labels",
    "train_bpe",
    "unknown_share",
    "Vocabulary",
]

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIALS))
VOCAB_FORMAT = "vitattn.vocabulary"
_VERSION = 1
AUTO_MAX_UNKNOWN = 0.02
KINDS = ("words", "bpe", "file")
SUBWORD_SPECIALS = ("<pad>", "<bos>", "<eos>")
MAX_AUTO_BPE = 32000
_BYTES = 256  # the byte-level alphabet


def auto_min_freq(counts: Counter[str], max_unknown: float = AUTO_MAX_UNKNOWN) -> int:
    """The largest word-count threshold in 5..1 whose rarer words make at most ``max_unknown`` of all tokens."""
    total = sum(counts.values()) or 1
    for threshold in (5, 4, 3, 2):
        if sum(n for n in counts.values() if n < threshold) / total <= max_unknown:
            return threshold
    return 1


@runtime_checkable
class Tokenizer(Protocol):
    """What training and every runtime need of a caption tokenizer."""

    pad_id: int
    bos_id: int
    eos_id: int
    unk_id: int | None  # None: every text has an encoding (byte-level BPE)
    other_special_ids: tuple[int, ...]  # special tokens besides these four ([CLS], <|endoftext|>): never generated

    def __len__(self) -> int: ...

    def encode(self, text: str, max_len: int | None = None) -> list[int]:
        """``[bos, ..., eos]``, at most ``max_len`` ids."""
        ...

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The caption of ``ids`` up to the first eos, special tokens left out."""
        ...

    def decode_batch(self, ids: Sequence[Sequence[int]] | torch.Tensor) -> list[str]:
        """``decode`` each row of ``ids`` (B, T)."""
        return [self.decode(row) for row in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]

    def tokens(self, ids: Sequence[int]) -> list[str]:
        """One display string per id before eos or pad (what attention figures label positions with)."""
        ...

    def save(self, path: str | os.PathLike) -> None: ...


class Vocabulary(Tokenizer):
    """Caption words to ids and back; ids 0-3 are ``<pad> <bos> <eos> <unk>``, ``words`` follow in id order."""

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID
    other_special_ids = ()

    def __init__(self, words: Sequence[str]) -> None:
        self.itos: list[str] = [*SPECIALS, *words]
        self.stoi: dict[str, int] = {word: i for i, word in enumerate(self.itos)}
        self.min_freq: int | None = None  # the threshold it was built with (for messages); None when loaded
        if len(self.stoi) != len(self.itos):
            repeated = sorted(w for w, n in Counter(self.itos).items() if n > 1)
            raise ValueError(f"vocabulary words must be unique and not special; repeated: {brief(repeated, 300)}")

    @classmethod
    def build(cls, captions: Iterable[str], min_freq: int | str = 1) -> Vocabulary:
        """The words seen at least ``min_freq`` times, most frequent first (ties alphabetical: the same captions
        give the same ids); ``auto``: the largest threshold up to 5 leaving at most ``AUTO_MAX_UNKNOWN`` ``<unk>``."""
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
        """``[bos, w1, ..., wn, eos]`` of ``coco_tokenize(text)``, unknown words ``unk_id``; at most ``max_len`` ids
        (words cut, eos kept)."""
        return _framed(self, [self.stoi.get(word, self.unk_id) for word in coco_tokenize(text)], max_len)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        ids = _before_eos(self, ids, "the vocabulary of")
        return " ".join(self.itos[i] for i in ids if i >= len(SPECIALS))

    def tokens(self, ids: Sequence[int]) -> list[str]:
        """The word of each id before eos or pad (``<unk>`` kept, so words line up with positions)."""
        return [self.itos[i] for i in _shown(self, ids)]

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


def _framed(tokenizer: Tokenizer, ids: list[int], max_len: int | None) -> list[int]:
    if max_len is not None and max_len < 2:
        raise ValueError(f"max_len={max_len} must be at least 2 to hold <bos> and <eos>")
    return [tokenizer.bos_id, *(ids if max_len is None else ids[: max_len - 2]), tokenizer.eos_id]


def _before_eos(tokenizer: Tokenizer, ids: Sequence[int] | torch.Tensor, what: str) -> list[int]:
    """``ids`` up to the first eos, each checked to be one of the tokenizer's (``what`` names it)."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    ids = ids[: ids.index(tokenizer.eos_id)] if tokenizer.eos_id in ids else ids
    bad = next((i for i in ids if not 0 <= i < len(tokenizer)), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside {what} {len(tokenizer)} tokens")
    return ids


def _shown(tokenizer: Tokenizer, ids: Sequence[int]) -> Iterator[int]:
    """The ids before the first eos or pad."""
    return takewhile(lambda i: i not in (tokenizer.eos_id, tokenizer.pad_id), ids)


class SubwordTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` holding ``<pad> <bos> <eos>``; ``source`` names it in messages."""

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
        self.unk_id = _unknown_id(tokenizer)
        self._size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self._special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special} | set(ids)
        self.other_special_ids = tuple(sorted(self._special - {*ids, self.unk_id}))

    @classmethod
    def from_file(cls, path: str | os.PathLike, add_specials: bool = False) -> SubwordTokenizer:
        """Read a ``tokenizer.json``, adding ``<pad> <bos> <eos>`` where it lacks them with ``add_specials``.

        Raises:
            ValueError: not a tokenizer.json that ``tokenizers`` can load (one line, with the fix).
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
        return json.loads(self.hf.to_str()) == json.loads(other.hf.to_str())

    __hash__ = None

    def __repr__(self) -> str:
        return f"SubwordTokenizer({len(self)} tokens)"

    def encode(self, text: str, max_len: int | None = None) -> list[int]:
        """Token ids ``[bos, t1, ..., tn, eos]``; longer than ``max_len``: the last subwords are cut, eos kept."""
        return _framed(self, self.hf.encode(text, add_special_tokens=False).ids, max_len)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        content = [i for i in _before_eos(self, ids, "the tokenizer's") if i not in self._special]
        return self.hf.decode(content, skip_special_tokens=True).strip()

    def tokens(self, ids: Sequence[int]) -> list[str]:
        """Each id before eos or pad as its text (a piece of a word; an unfinished UTF-8 byte shows as �)."""
        shown = []
        for i in _shown(self, ids):
            text = "" if i in self._special else self.hf.decode([i], skip_special_tokens=False).strip()
            shown.append(text or self.hf.id_to_token(i) or "")
        return shown

    def save(self, path: str | os.PathLike) -> None:
        """Write the ``tokenizer.json``, atomically."""
        atomic_write(path, self.hf.to_str(pretty=True) + "\n")


def _unknown_id(tokenizer: Any) -> int | None:
    """The unknown token's id of any ``tokenizers`` model: WordPiece, BPE and WordLevel name it (``unk_token``),
    Unigram (SentencePiece's) gives its id (``unk_id``); None: the model has none (byte-level BPE)."""
    model = json.loads(tokenizer.to_str())["model"]
    if model.get("type") == "Unigram":
        return model.get("unk_id")
    unk = model.get("unk_token")
    return tokenizer.token_to_id(unk) if unk else None


def auto_bpe_size(captions: Iterable[str]) -> int:
    """The BPE vocabulary ``vocab_size=auto`` trains: the 256 bytes, the specials and one merge per word seen
    at least twice in the captions (so frequent words end up whole), rounded up to 64, at most 32,000."""
    counts = Counter(word for caption in captions for word in coco_tokenize(caption))
    frequent = sum(1 for n in counts.values() if n >= 2)
    size = _BYTES + len(SUBWORD_SPECIALS) + frequent
    return min(MAX_AUTO_BPE, -(-size // 64) * 64)


def check_bpe_size(vocab_size: Any) -> int | str:
    """``tokenizer.vocab_size``: ``auto``, or at least the 256 bytes and the specials."""
    smallest = _BYTES + len(SUBWORD_SPECIALS)
    whole = isinstance(vocab_size, int) and not isinstance(vocab_size, bool)
    if vocab_size != "auto" and not (whole and vocab_size >= smallest):
        raise ValueError(f"tokenizer.vocab_size={vocab_size!r} must be auto or at least {smallest} (bytes, specials)")
    return vocab_size


def train_bpe(captions: Sequence[str], vocab_size: int | str = "auto") -> SubwordTokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (``auto``: ``auto_bpe_size``) trained on ``captions``, NFC, lower
    case, single spaces; no unknown token. Tokenizers' progress bar shows on a terminal."""
    vocab_size = auto_bpe_size(captions) if check_bpe_size(vocab_size) == "auto" else vocab_size
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
        show_progress=sys.stderr.isatty(),
    )
    tokenizer.train_from_iterator(captions, trainer, length=len(captions))
    return SubwordTokenizer(tokenizer, "the trained BPE")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The ``Vocabulary`` or ``SubwordTokenizer`` saved at ``path``, by its file name, else by its content.

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
        return tokenizer.hf.to_str()
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
    if stoi is None:  # each word encoded: the first ``limit`` captions
        captions = islice(captions, limit)
    total = unknown = 0
    for word in (word for caption in captions for word in coco_tokenize(caption)):
        total += 1
        unknown += word not in stoi if stoi is not None else tokenizer.unk_id in tokenizer.encode(word)
    return unknown / total if total else 0.0


def describe_tokenizer(tokenizer: Tokenizer) -> str:
    """``the 9,487-word vocabulary (min_word_freq=5)`` or ``the 1,024-token subword tokenizer``."""
    if isinstance(tokenizer, SubwordTokenizer):
        return f"the {len(tokenizer):,}-token subword tokenizer"
    freq = getattr(tokenizer, "min_freq", None)
    return f"the {len(tokenizer.words):,}-word vocabulary" + (f" (min_word_freq={freq})" if freq is not None else "")


def check_captions_per_image(value: Any) -> int | str:
    """``data.captions_per_image``: a whole number of at least 1, or ``all``."""
    if value == "all" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"data.captions_per_image={value!r} must be a whole number of at least 1, or all")


def draw_captions(references: Sequence[str], k: int | str, rng: random.Random) -> list[str]:
    """``k`` of an image's references: drawn without replacement, then (fewer than ``k``) every one and repeats
    drawn at random, so each image weighs the same; ``all``: every one, in order."""
    if k == "all":
        return list(references)
    if len(references) >= k:
        return rng.sample(list(references), k)
    return [*references, *rng.choices(list(references), k=k - len(references))]


class TokenizedCaptions(Dataset):
    """A caption dataset's items with ``tokens`` (T,) long ``bos ... eos`` (at most ``max_len``) in place of
    ``caption``. ``per_image``: take that many of the references (``draw_captions``; ``tokens`` then a tuple),
    drawn from the index and the epoch's seed that ``EpochSampler(draws=True)`` hands out with it, so a resumed
    epoch draws the same; None: the item's own ``caption``."""

    def __init__(self, dataset: Dataset, vocab: Tokenizer, max_len: int, per_image: int | str | None = None):
        self.dataset, self.vocab, self.max_len = dataset, vocab, max_len
        self.per_image = per_image
        self.draws = per_image is not None  # its sampler hands out ``(index, epoch seed)``

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int | tuple[int, int]) -> dict[str, Any]:
        index, seed = index if isinstance(index, tuple) else (index, 0)
        item = self.dataset[index]
        if self.per_image is None:
            tokens: Any = self._tokens(item["caption"])
        else:
            drawn = draw_captions(item["references"], self.per_image, random.Random(f"{seed}/{index}"))
            tokens = tuple(self._tokens(caption) for caption in drawn)
        references, image_id = item["references"], item["image_id"]
        return {"image": item["image"], "tokens": tokens, "references": references, "image_id": image_id}

    def _tokens(self, caption: str) -> torch.Tensor:
        return torch.tensor(self.vocab.encode(caption, max_len=self.max_len), dtype=torch.long)


def collate_captions(items: list[dict[str, Any]], pad_id: int = PAD_ID) -> dict[str, Any]:
    """``images`` (B, 3, height, width), or ``Patches`` where items hold ``ImagePatches`` (``batch_images``);
    ``tokens`` (N, T) right-padded with ``pad_id``, every caption of every item (one per item, or a tuple of several);
    ``caption_image`` (N,) the image of each; ``image_ids`` (B,); ``references``."""
    rows = [tokens if isinstance(tokens, tuple) else (tokens,) for tokens in (item["tokens"] for item in items)]
    images = [item["image"] for item in items]
    return {
        "images": batch_images(images),  # (B, 3, height, width), or Patches
        "tokens": pad_sequence([t for r in rows for t in r], batch_first=True, padding_value=pad_id),  # (N, T)
        "caption_image": torch.tensor([i for i, r in enumerate(rows) for _ in r], dtype=torch.long),  # (N,)
        "image_ids": torch.tensor([item["image_id"] for item in items], dtype=torch.long),  # (B,)
        "references": [list(item["references"]) for item in items],
    }
