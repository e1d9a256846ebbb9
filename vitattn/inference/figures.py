"""Attention figures of captioned batches: one ``<stem>.png`` per image, named the same on every run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from vitattn.bundle.runtime import LoadedModel
from vitattn.data.preprocess import denormalize
from vitattn.fileio import atomic_write
from vitattn.inference.attention_maps import attention_figure, attention_from_tokens, figure_png
from vitattn.inference.captioning import CaptionBatch
from vitattn.inference.file_list import InputImage

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["attention_figures", "caption_words", "check_figures_runtime", "figure_paths", "write_figures"]


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


def attention_figures(
    model: Any, images: Tensor, tokens: Tensor, vocab: Any, preprocess: Mapping[str, Any], titles: Sequence[str | None]
) -> list[Figure]:
    """One attention figure per row: the image as the model saw it, each word's cross-attention, the rollout.

    Args:
        model: the ``ImageCaptioner``, in eval mode.
        images: (b, C, height, width) normalised model inputs.
        tokens: (b, T') their generated captions (``generate``'s output).
        vocab: the caption vocabulary.
        preprocess: the bundle's preprocessing (its ``mean`` and ``std`` undo the normalisation).
        titles: a figure title per row.
    """
    cross, rollout = attention_from_tokens(model, images, tokens)  # (b, T', gh, gw), (b, gh, gw)
    shown = (
        denormalize(images.float(), preprocess["mean"], preprocess["std"]).clamp(0, 1).cpu()
    )  # (b, 3, height, width)
    return [
        attention_figure(shown[row], caption_words(tokens[row].tolist(), vocab), cross[row], rollout[row], title=title)
        for row, title in enumerate(titles)
    ]


def check_figures_runtime(model: LoadedModel) -> None:
    """Refuse, in one line, to draw figures with a runtime that has no attention weights to show (ONNX)."""
    if model.runtime != "torch":
        raise ValueError(
            "attention_maps= needs the PyTorch runtime; caption with the bundle or run folder, not the ONNX folder"
        )


def write_figures(bundle: LoadedModel, batch: CaptionBatch, figures: Mapping[str, Path]) -> None:
    if batch.images is None:
        return
    records = [batch.records[pos] for pos in batch.captioned]
    drawn = attention_figures(
        bundle.model, batch.images, batch.tokens, bundle.vocab, bundle.preprocess, [r.get("caption") for r in records]
    )
    for record, fig in zip(records, drawn):
        path = figures[record["image"]]
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, figure_png(fig))


def caption_words(ids: Sequence[int], vocab: Any) -> list[str]:
    """Tokens before ``<eos>`` as strings, one per position (``<unk>`` kept, subwords as their text)."""
    return vocab.tokens(ids)
