"""Caption decoder and the image captioner, whose ``generate`` is ``vitattn.models.generate``'s.

Dimension letters: B batch, K beams, N image tokens, D width, T caption positions, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from vitattn.layers import DecoderLayer, LayerCache, Memory, check_heads
from vitattn.models.generate import CaptionSearch, SpecialIds
from vitattn.models.vit import Patches, VisionTransformer, init_linears_, layer_groups, trunc_normal_

__all__ = ["CaptionDecoder", "DecoderStep", "ImageCaptioner", "per_caption"]


class CaptionDecoder(nn.Module):
    """Token + position embedding, a stack of ``DecoderLayer``s, an output projection.

    Args:
        vocab_size, embed_dim, depth, num_heads, mlp_ratio, drop_rate, attn_drop_rate: V, D and timm's others.
        max_len: most caption positions, ``<bos>`` included.
        memory_dim: width of the image tokens; projected to D when it differs.
        norm_first, activation, fused_attn: as ``EncoderLayer``'s.
        pad_id, bos_id, eos_id, unk_id: special ids (``Vocabulary``'s; ``unk_id`` None: none).
        other_special_ids: the tokenizer's other special tokens; these, ``<unk>``, ``<pad>`` and ``<bos>`` are
            never generated.
        tie_embeddings: the output projection is the token embedding (GPT-2); false: its own weight and bias.
        init: ``timm`` (truncated normal, std 0.02) or ``torch`` (``nn.Linear``'s default; learns faster from
            small data, docs/learning.md).
        grad_checkpointing: recompute each layer in the backward pass.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int = 256,
        depth: int = 2,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        max_len: int = 32,
        memory_dim: int | None = None,
        drop_rate: float = 0.1,
        attn_drop_rate: float = 0.0,
        norm_first: bool = True,
        activation: str = "gelu",
        layer_norm_eps: float = 1e-6,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        unk_id: int | None = 3,
        other_special_ids: Sequence[int] = (),
        fused_attn: bool = True,
        tie_embeddings: bool = True,
        init: str = "timm",
        grad_checkpointing: bool = False,
    ) -> None:
        config = dict(locals())
        del config["self"], config["__class__"]
        super().__init__()
        check_heads(num_heads, embed_dim)
        if init not in ("timm", "torch"):
            raise ValueError(f"init={init!r} is unknown; choose timm or torch")
        if vocab_size <= max(pad_id, bos_id, eos_id, -1 if unk_id is None else unk_id, *other_special_ids):
            raise ValueError(f"vocab_size={vocab_size} must exceed the special token ids")
        config["other_special_ids"] = [int(i) for i in other_special_ids]  # a list in config.json
        self.other_special_ids = tuple(config["other_special_ids"])
        self.config = config
        self.vocab_size, self.max_len = vocab_size, max_len
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = pad_id, bos_id, eos_id, unk_id
        memory_dim = memory_dim or embed_dim
        self.memory_proj = nn.Linear(memory_dim, embed_dim) if memory_dim != embed_dim else nn.Identity()
        self.token_embed = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_id)
        self.pos_embed = nn.Parameter(torch.zeros(1, max_len, embed_dim))
        self.embed_drop = nn.Dropout(drop_rate)
        self.layers = nn.ModuleList(
            DecoderLayer(
                embed_dim,
                num_heads,
                int(embed_dim * mlp_ratio),
                rate=drop_rate,
                norm_first=norm_first,
                activation=activation,
                attn_drop=attn_drop_rate,
                layer_norm_eps=layer_norm_eps,
                fused_attn=fused_attn,
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps) if norm_first else nn.Identity()
        self.head = nn.Linear(embed_dim, vocab_size, bias=not tie_embeddings)
        self.set_grad_checkpointing(grad_checkpointing)
        self._init_weights(linears=init == "timm")
        if tie_embeddings:
            self.head.weight = self.token_embed.weight  # tied output projection

    def _init_weights(self, linears: bool) -> None:
        if self.pos_embed.is_meta:  # a copy without values (on the meta device): nothing to fill
            return
        trunc_normal_(self.pos_embed, std=0.02)
        if linears:  # else PyTorch's default Linear init
            init_linears_(self)
        trunc_normal_(self.token_embed.weight, std=0.02)
        with torch.no_grad():
            self.token_embed.weight[self.pad_id].zero_()

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each layer in the backward pass (less memory, one more forward); never with a cache."""
        self.grad_checkpointing = self.config["grad_checkpointing"] = enable

    def new_cache(self, capacity: int | None = None) -> list[LayerCache]:
        """An empty key/value cache per layer, room for ``capacity`` positions (default ``max_len``)."""
        return [LayerCache(capacity or self.max_len) for _ in self.layers]

    def forward_features(
        self, tokens: Tensor, memory: Memory, cache: list[LayerCache] | None = None, start: int = 0
    ) -> Tensor:
        """(B, t) tokens -> (B, t, D) hidden states after the final norm (``forward``'s arguments)."""
        B, t = tokens.shape
        if start + t > self.max_len:
            raise ValueError(f"caption position {start + t} exceeds max_len={self.max_len}")
        x = self.token_embed(tokens) + self.pos_embed[:, start : start + t]  # (B, t, D)
        x = self.embed_drop(x)
        # Never with a cache: running a layer again in the backward pass would append its keys/values twice.
        recompute = cache is None and self.grad_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if recompute:
                # keeps x; the backward runs the layer again
                x = checkpoint(layer, x, memory, None, use_reentrant=False)
            else:
                x = layer(x, memory, None if cache is None else cache[i])
        return self.norm(x)

    def forward(self, tokens: Tensor, memory: Memory, cache: list[LayerCache] | None = None, start: int = 0) -> Tensor:
        """(B, t, V) logits of (B, t) tokens at positions ``start ..`` over the ``Memory`` of (B, N, D) image tokens
        (``ImageCaptioner.encode``'s: with merging, their sizes).

        ``memory`` may hold (B / K, N, D), one row per K beams; ``cache`` (``new_cache()``) is extended in place.
        """
        return self.head(self.forward_features(tokens, memory, cache, start))  # (B, t, V)


class ImageCaptioner(nn.Module, CaptionSearch):
    """A ``VisionTransformer`` encoder and a ``CaptionDecoder``: ``forward`` teacher-forced, ``generate`` decodes."""

    def __init__(self, encoder: VisionTransformer, decoder: CaptionDecoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    @property
    def config(self) -> dict[str, Any]:
        return {"encoder": self.encoder.config, "decoder": self.decoder.config}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ImageCaptioner:
        """Rebuild from ``config``, the ``config`` property of a saved model (a ``CocaCaptioner``'s too). A part's
        ``ValueError`` or ``TypeError`` starts with its name (``decoder: num_heads=3 must divide embed_dim=32``): the
        parts share argument names."""
        encoder = _part("encoder", VisionTransformer, config["encoder"])
        decoder = _part("decoder", CaptionDecoder, config["decoder"])
        if "contrastive" not in config:
            return cls(encoder, decoder)
        return _part("contrastive", lambda **kwargs: cls(encoder, decoder, **kwargs), config["contrastive"])

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute the encoder's and the decoder's layers in the backward pass (timm's switch), or stop."""
        self.encoder.set_grad_checkpointing(enable)
        self.decoder.set_grad_checkpointing(enable)

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """The encoder's layers for timm's layer-wise lr decay; the decoder matches none, so it is the top layer."""
        return layer_groups("encoder.")

    def encode(self, images: Tensor | Patches) -> Memory:
        """(B, C, height, width) or ``Patches`` -> the ``Memory`` of (B, N, D) image tokens in the decoder's width,
        normalised: an encoder whose norm comes after pooling (``fc_norm``, timm's ``avg`` pool) has it applied to
        every token; padding (``Patches``) marked in its ``valid``, which the decoder's cross-attention masks."""
        return self.memory(self.encoder.forward_tokens(images))

    def memory(self, encoded: Memory) -> Memory:
        """``encode`` from the encoder's ``forward_tokens``: its tokens normalised and projected, sizes and validity
        kept."""
        return encoded._replace(tokens=self.decoder.memory_proj(self.encoder.fc_norm(encoded.tokens)))

    def forward(self, images: Tensor | Patches, tokens: Tensor, caption_image: Tensor | None = None) -> Tensor:
        """Teacher forcing: (B, C, height, width), (N, T) -> (N, T, V) next-token logits; caption ``n`` reads
        image ``caption_image[n]`` (N,), encoded once however many captions it has (default: caption n, image n)."""
        memory = per_caption(self.encode(images), caption_image)
        return self.decoder(tokens, memory)

    def start_search(
        self, images: Tensor | Patches, max_new_tokens: int, num_beams: int, use_cache: bool
    ) -> tuple[DecoderStep, int, torch.device]:
        """``CaptionSearch.start_search``: the decoder's step over the (B, N, D) image tokens."""
        memory = self.encode(images)  # (B, N, D)
        return self.decode_step(memory, max_new_tokens, use_cache), memory.tokens.shape[0], memory.tokens.device

    @property
    def max_len(self) -> int:
        return self.decoder.max_len

    @property
    def special_ids(self) -> SpecialIds:
        dec = self.decoder
        return SpecialIds(dec.pad_id, dec.bos_id, dec.eos_id, dec.unk_id, dec.other_special_ids)

    def decode_step(self, memory: Memory, max_new_tokens: int, use_cache: bool = True) -> DecoderStep:
        """The PyTorch ``DecodeStep`` over the image tokens ``memory`` (``encode``'s)."""
        return DecoderStep(self.decoder, memory, self.decoder.new_cache(max_new_tokens) if use_cache else None)


def per_caption(memory: Memory, caption_image: Tensor | None) -> Memory:
    """B images' ``Memory`` -> one row per caption: caption ``n`` reads image ``caption_image[n]`` (None: image n)."""
    if caption_image is not None and len(caption_image) != len(memory.tokens):
        memory = memory.index_select(caption_image)
    return memory


class DecoderStep:
    """``CaptionDecoder`` as a search's ``DecodeStep``: the last position's logits, with the key/value cache or
    recomputed from position 0; ``memory`` may hold one row per image for its K beams."""

    def __init__(self, decoder: CaptionDecoder, memory: Memory, cache: list[LayerCache] | None) -> None:
        # On a CPU the steps run in the weights' dtype with autocast off, fp32 even under bf16 autocast (only the
        # encoder in bf16): at one query position torch's bf16 CPU kernels are slower than fp32's
        # (docs/benchmarks.md); bf16 where FSDP's mixed precision holds the weights in bf16. A GPU steps in bf16.
        self.cpu = memory.tokens.device.type == "cpu"
        self.decoder, self.cache = decoder, cache
        self.memory = memory

    def __call__(self, tokens: Tensor) -> Tensor:
        dtype = self.decoder.head.weight.dtype  # read at each step: FSDP swaps the parameters as it gathers them
        if self.cpu and self.memory.tokens.dtype != dtype:
            self.memory = self.memory._replace(tokens=self.memory.tokens.to(dtype))
        with torch.autocast("cpu", enabled=False) if self.cpu else nullcontext():
            if self.cache is None:
                h = self.decoder.forward_features(tokens, self.memory)[:, -1:]
            else:
                start = tokens.shape[1] - 1
                h = self.decoder.forward_features(tokens[:, -1:], self.memory, self.cache, start)
        # The search's scores in fp32 even under bf16 autocast: in bf16 (3 significant digits) near-tied words swap.
        with torch.autocast(h.device.type, enabled=False):
            return self.decoder.head(h.to(dtype)).float()[:, -1]  # (B, V); fp32 but for bf16 weights

    def reorder(self, index: Tensor) -> None:
        for layer_cache in self.cache or ():
            layer_cache.reorder(index)


def _part(name: str, build: Any, kwargs: dict[str, Any]) -> Any:
    try:
        return build(**kwargs)
    except (ValueError, TypeError) as err:
        raise type(err)(f"{name}: {err}") from err
