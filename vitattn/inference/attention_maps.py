"""Where the captioner looks: cross-attention of each generated word, the encoder's attention rollout, and
their figures.

Dimension letters: B batch, H heads, T' generated tokens, N image tokens (class token, then gh x gw patches),
C channels; image sides are written out (height, width). ``Patches`` (``data.max_patches`` models): each image's
maps at its own grid (rows x cols), padding left out.

Captions are generated as usual (fused attention, no weights); one teacher-forced pass of the generated tokens
then runs under ``record_attention``: its position t is the step that produced word t, so its cross-attention
is the map of word t, for greedy, beam and sampled captions alike.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from vitattn.data.preprocess import denormalize, unpatchify
from vitattn.fileio import atomic_write
from vitattn.layers import Memory, record_attention
from vitattn.layers.merge import spread
from vitattn.models import ImageCaptioner
from vitattn.models.vit import Patches

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "attention_figure",
    "attention_figures",
    "attention_from_tokens",
    "attention_rollout",
    "check_figures_runtime",
    "figure_paths",
    "figure_png",
    "shown_images",
    "write_figures",
]


def attention_rollout(attentions: Sequence[Tensor], num_prefix_tokens: int = 1, trace: Sequence[Memory] = ()) -> Tensor:
    """(B, N - num_prefix_tokens) attention rollout (Abnar & Zuidema, 2020) of the class token over the patches,
    summing to 1, from each encoder layer's (B, H, N, N) weights, first to last: heads averaged, the identity
    added for the residual path, rows renormalised, the layers multiplied through. With merged tokens,
    ``trace`` (``VisionTransformer.forward_tokens``'): after each layer a merged token's row is the size-weighted
    mean of its parts' rows, as the token is of theirs, so the rollout stays over the N input tokens.
    """
    rollout = None
    for i, weights in enumerate(attentions):
        a = weights.float().mean(dim=1)  # (B, N_i, N_i)
        a = a + torch.eye(a.shape[-1], device=a.device, dtype=a.dtype)
        a = a / a.sum(dim=-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout  # (B, N_i, N)
        if trace:
            before, after = trace[i], trace[i + 1]  # sources (B, N_i, N), (B, N_i+1, N)
            # part k of merged token j holds size_i[k] of its size_i+1[j] input tokens
            merged = after.sources.float() @ before.sources.float().transpose(1, 2) / after.sizes.float().unsqueeze(-1)
            rollout = merged @ rollout  # (B, N_i+1, N)
    if rollout is None:
        raise ValueError("attention_rollout needs the weights of at least one layer")
    cls = rollout[:, 0, num_prefix_tokens:]  # (B, N - prefix)
    return cls / cls.sum(dim=-1, keepdim=True)


@torch.no_grad()
def attention_from_tokens(
    model: ImageCaptioner, images: Tensor | Patches, tokens: Tensor, layer: int = -1
) -> tuple[Tensor, Tensor] | tuple[list[Tensor], list[Tensor]]:
    """``(cross, rollout)`` of captions ``tokens`` (B, T') as ``generate`` returns them, from one recorded
    teacher-forced pass over ``images`` (B, C, height, width): (B, T', gh, gw) the cross-attention of decoder
    layer ``layer`` averaged over heads, each map summing to 1 over the patches (after ``<eos>``: padding), and
    (B, gh, gw) the encoder's rollout. ``Patches``: lists of each image's (T', rows, cols) and (rows, cols), its
    own grid, the padding (which no layer attends to) left out. ``model`` in eval mode, so that dropout leaves the
    maps alone.
    """
    dec, enc = model.decoder, model.encoder
    depth = len(dec.layers)
    if not -depth <= layer < depth:
        raise ValueError(f"layer={layer} is out of range for a decoder of depth {depth}")
    layer %= depth
    B, T = tokens.shape
    gh, gw = enc.patch_embed.grid_size
    prefix = enc.num_prefix_tokens
    bos = tokens.new_full((B, 1), dec.bos_id)
    inputs = torch.cat([bos, tokens[:, :-1]], dim=1)  # (B, T') position t produces word t
    trace: list[Memory] = []  # with merged tokens: which patches each holds, layer by layer
    with record_attention(model) as maps:
        memory = model.memory(enc.forward_tokens(images, trace))  # with merged tokens, their sources
        dec(inputs, memory)
    cross = maps[f"decoder.layers.{layer}.mha2"][0].float().mean(dim=1)  # (B, T', N'): over the merged tokens
    cross = spread(cross, memory)[..., prefix:]  # (B, T', gh*gw)
    cross = cross / cross.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(cross.dtype).tiny)
    weights = [maps[f"encoder.blocks.{i}.mha"][0] for i in range(len(enc.blocks))]
    rollout = attention_rollout(weights, prefix, trace)
    if isinstance(images, Patches):  # each image's valid patches come first, row by row (``pad_patches``)
        grids = images.grids()
        return (
            [cross[i, :, : r * c].reshape(T, r, c) for i, (r, c) in enumerate(grids)],
            [rollout[i, : r * c].reshape(r, c) for i, (r, c) in enumerate(grids)],
        )
    return cross.view(B, T, gh, gw), rollout.view(B, gh, gw)


def _as_rgb_array(image: Image.Image | np.ndarray | Tensor) -> np.ndarray:
    """(height, width, 3) floats in [0, 1] from a PIL image, a (height, width[, 3]) array or a (3, height, width)
    tensor in [0, 1]."""
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    if isinstance(image, Tensor):
        image = image.detach().float().cpu()
        image = (image.permute(1, 2, 0) if image.ndim == 3 else image).numpy()
    a = np.asarray(image, dtype=np.float32)
    if a.ndim == 2:
        a = np.repeat(a[..., None], 3, axis=-1)
    if a.max(initial=0.0) > 1.0:
        a = a / 255.0
    return np.clip(a, 0.0, 1.0)


def _upsample(heat: Tensor | np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(gh, gw) -> (height, width) bilinear, scaled to a maximum of 1 for display."""
    h = torch.as_tensor(heat, dtype=torch.float32).cpu()[None, None]  # (1, 1, gh, gw)
    h = F.interpolate(h, size=size, mode="bilinear", align_corners=False)[0, 0]  # (height, width)
    return (h / h.max().clamp_min(1e-12)).numpy()


def attention_figure(
    image: Image.Image | np.ndarray | Tensor,
    words: Sequence[str],
    cross_maps: Tensor | np.ndarray,
    rollout: Tensor | np.ndarray,
    *,
    title: str | None = None,
    max_cols: int = 6,
) -> Figure:
    """A matplotlib ``Figure``: ``image`` (PIL, (height, width, 3) array or (3, height, width) tensor in [0, 1]),
    one overlay per word of ``cross_maps`` (T', gh, gw), T' >= len(words), and the ``rollout`` (gh, gw).
    """
    # heavy: matplotlib is imported only when a figure is drawn; no pyplot: no global state, Agg chosen by savefig
    from matplotlib.figure import Figure

    if len(cross_maps) < len(words):
        raise ValueError(f"{len(words)} words but only {len(cross_maps)} cross-attention maps")
    rgb = _as_rgb_array(image)
    size = rgb.shape[:2]
    panels = [("image", None), *((w, cross_maps[i]) for i, w in enumerate(words)), ("rollout", rollout)]
    cols = min(max_cols, len(panels))
    rows = math.ceil(len(panels) / cols)
    lines = title.count("\n") + 1 if title else 0
    fig = Figure(figsize=(2.2 * cols, 2.4 * rows + 0.4 * lines))
    for k, (label, heat) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, k + 1)
        ax.imshow(rgb)
        if heat is not None:
            ax.imshow(_upsample(heat, size), cmap="jet", alpha=0.5, vmin=0.0, vmax=1.0)
        ax.set_title(label, fontsize=10)
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def figure_png(fig: Figure, dpi: int = 80) -> bytes:
    """``fig`` as PNG bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def shown_images(images: Tensor | Patches, preprocess: Mapping[str, Any]) -> list[Tensor]:
    """Each image of normalised model inputs, (b, C, height, width) or ``Patches`` (at its own grid of
    ``preprocess["patch_size"]`` patches: its own aspect), as (3, height, width) in [0, 1] on the CPU
    (``preprocess``' ``mean`` and ``std`` undone)."""
    if isinstance(images, Patches):
        P = preprocess["patch_size"]
        images = [unpatchify(x.float().cpu(), grid, P) for x, grid in zip(images.patches, images.grids())]
    return [denormalize(x.float().cpu(), preprocess["mean"], preprocess["std"]).clamp(0, 1) for x in images]


def attention_figures(
    model: Any,
    images: Tensor | Patches,
    tokens: Tensor,
    vocab: Any,
    preprocess: Mapping[str, Any],
    titles: Sequence[str | None],
) -> list[Figure]:
    """One ``attention_figure`` per image of ``images`` ((b, C, height, width) or ``Patches``: each at its own
    aspect), normalised model inputs, and their captions ``tokens`` (b, T'); ``preprocess``' ``mean`` and ``std``
    undo the normalisation (``shown_images``)."""
    cross, rollout = attention_from_tokens(model, images, tokens)  # (b, T', gh, gw), (b, gh, gw), or lists
    shown = shown_images(images, preprocess)
    return [
        attention_figure(shown[row], vocab.tokens(tokens[row].tolist()), cross[row], rollout[row], title=title)
        for row, title in enumerate(titles)
    ]


def check_figures_runtime(model: Any) -> None:
    """Refuse, in one line, to draw figures of a ``LoadedModel`` whose runtime has no attention weights (ONNX)."""
    if model.runtime != "torch":
        raise ValueError("attention maps need the PyTorch runtime; use the bundle or run folder, not the ONNX folder")


def figure_paths(inputs: Sequence[Any], folder: Path) -> dict[str, Path]:
    """``folder/<stem>.png`` per input image (``.path``); a stem already taken gets ``<stem>-2.png``, ...,
    over all inputs, so that a resumed run names each image as the first run did."""
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


def write_figures(
    model: Any, images: Tensor, tokens: Tensor, records: Sequence[Mapping[str, Any]], paths: Mapping[str, Path]
) -> None:
    """The attention figure of each captioned ``records[i]`` (its ``images[i]``, ``tokens[i]``), written atomically
    to ``paths[record["image"]]``; ``model`` is a caption ``LoadedModel``."""
    drawn = attention_figures(
        model.model, images, tokens, model.vocab, model.preprocess, [r.get("caption") for r in records]
    )
    for record, fig in zip(records, drawn):
        path = paths[record["image"]]
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, figure_png(fig))
