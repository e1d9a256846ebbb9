"""Attention figures of captioned batches: one ``<stem>.png`` per image, named the same on every run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vitattn.bundle import Bundle
from vitattn.data.preprocess import denormalize
from vitattn.inference.captioning import CaptionBatch
from vitattn.inference.inputs import InputImage

__all__ = ["figure_paths", "write_figures"]


def figure_paths(inputs: Sequence[InputImage], folder: Path) -> dict[str, Path]:
    """``folder/<stem>.png`` per input; later inputs with a stem already taken get ``<stem>-2.png``, ...
    Computed over all inputs, so a resumed run names each image as the first run did."""
    names: dict[str, Path] = {}
    used: set[str] = set()
    for x in inputs:
        stem = Path(x.path).stem or "image"
        name, n = stem, 1
        while name.lower() in used:
            n += 1
            name = f"{stem}-{n}"
        used.add(name.lower())
        names[x.path] = folder / f"{name}.png"
    return names


def write_figures(bundle: Bundle, batch: CaptionBatch, figures: Mapping[str, Path]) -> None:
    from vitattn.inference.attention_maps import attention_from_tokens, save_attention_figure

    if batch.images is None:
        return
    cross, rollout = attention_from_tokens(bundle.model, batch.images, batch.tokens)  # (b, T', gh, gw), (b, gh, gw)
    p = bundle.preprocess
    shown = denormalize(batch.images, p["mean"], p["std"]).clamp(0, 1).cpu()  # (b, 3, H, W) what the model saw
    vocab = bundle.vocab
    for row, pos in enumerate(batch.captioned):
        record = batch.records[pos]
        words = _words(batch.tokens[row].tolist(), vocab)
        path = figures[record["image"]]
        path.parent.mkdir(parents=True, exist_ok=True)
        save_attention_figure(shown[row], words, cross[row], rollout[row], path, title=record.get("caption"))


def _words(ids: Sequence[int], vocab: Any) -> list[str]:
    """Tokens before ``<eos>`` as strings (``<unk>`` kept so words line up with positions)."""
    words = []
    for i in ids:
        if i == vocab.eos_id or i == vocab.pad_id:
            break
        words.append(vocab.itos[i])
    return words
