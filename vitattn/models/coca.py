"""CoCa (Yu et al. 2022): the image captioner with a contrastive pair of embeddings, for training, zero-shot
classification and retrieval. The image embedding is the encoder's pooled feature, projected; the text embedding
the class token of a small text tower of its own over the decoder's token embedding, so the caption decoder, its
key/value cache and every search stay as they are (why: docs/captioning.md#coca).

Dimension letters: B images, N texts, T caption positions, D width, E embedding width.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitattn.layers import EncoderLayer, Memory, check_heads
from vitattn.models.caption import CaptionDecoder, ImageCaptioner, per_caption
from vitattn.models.generate import CaptionSearch
from vitattn.models.vit import Patches, VisionTransformer, trunc_normal_

__all__ = ["CONTRASTIVE_PARTS", "CocaCaptioner", "Embedder", "TextEncoder", "captioner_from_config"]

# what a ``CocaCaptioner`` has beyond its ``ImageCaptioner``: the text tower, both projections, the logit scale and bias
CONTRASTIVE_PARTS = ("image_proj", "logit_bias", "logit_scale", "text", "text_proj")


class TextEncoder(nn.Module):
    """A class token before embedded tokens, learned positions, ``EncoderLayer``s whose attention skips the padding;
    the class token's output after a final norm. Arguments as ``CaptionDecoder``'s."""

    def __init__(
        self,
        embed_dim: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float,
        max_len: int,
        drop_rate: float = 0.0,
        norm_first: bool = True,
        activation: str = "gelu",
        layer_norm_eps: float = 1e-6,
        fused_attn: bool = True,
    ) -> None:
        super().__init__()
        check_heads(num_heads, embed_dim, "text_num_heads")
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, max_len + 1, embed_dim))
        self.blocks = nn.ModuleList(
            EncoderLayer(
                embed_dim,
                num_heads,
                int(embed_dim * mlp_ratio),
                rate=drop_rate,
                norm_first=norm_first,
                activation=activation,
                layer_norm_eps=layer_norm_eps,
                fused_attn=fused_attn,
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps) if norm_first else nn.Identity()
        if not self.pos_embed.is_meta:
            trunc_normal_(self.pos_embed, std=0.02)
            trunc_normal_(self.cls_token, std=0.02)

    def forward(self, x: Tensor, padding: Tensor) -> Tensor:
        """(N, T, D) embedded tokens, (N, T) True at padding -> (N, D)."""
        N, T, D = x.shape
        x = torch.cat([self.cls_token.expand(N, -1, -1), x], dim=1) + self.pos_embed[:, : T + 1]  # (N, 1 + T, D)
        mask = F.pad(padding, (1, 0)).view(N, 1, 1, T + 1)  # (N, 1, 1, 1 + T): 1 = a padding key; the class token never
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x[:, 0])  # (N, D)


class Embedder(CaptionSearch):
    """A caption model that also embeds images and texts, L2-normalised, in one space of width ``embed_dim``; the
    runtime gives ``embed_images``, ``embed_texts`` and ``logit_scale`` (the learned log temperature, (1,)), this
    class what follows from them: ``choose``, which ``generate(rerank=N)`` needs."""

    embeds = True
    embed_dim: int
    logit_scale: Tensor

    def embed_images(self, images: Tensor | Patches) -> Tensor:
        """(B, C, height, width) -> (B, E) unit-length image embeddings."""
        raise NotImplementedError

    def embed_texts(self, tokens: Tensor) -> Tensor:
        """(N, T) token ids, ``<bos> ... <eos>`` right-padded -> (N, E) unit-length text embeddings."""
        raise NotImplementedError

    def encode_and_embed(self, images: Tensor) -> tuple[Any, Tensor]:
        """``encode`` and ``embed_images`` of (B, C, height, width) images; one encoder pass where the runtime
        can share it (PyTorch's)."""
        return self.encode(images), self.embed_images(images)

    def choose(self, images: Tensor, candidates: Tensor) -> Tensor:
        """(B, T') the caption of each image whose text embedding is nearest its image embedding (cosine), among
        (B * N, T') ``generate``'s candidates (an image's N consecutive; no ``<bos>``, ``<pad>`` after ``<eos>``),
        as LAION-COCO and BLIP's CapFilt choose. The images are encoded again, for their pooled embedding."""
        B, T = images.shape[0], candidates.shape[1]
        texts = self.embed_texts(self.caption_texts(candidates)).view(B, -1, self.embed_dim)
        cosine = torch.einsum("be,bne->bn", self.embed_images(images), texts)  # (B, N): both unit-length
        best = cosine.argmax(dim=1)  # (B,)
        return candidates.view(B, -1, T)[torch.arange(B, device=best.device), best]  # (B, T')

    def caption_texts(self, captions: Tensor) -> Tensor:
        """(M, T') generated captions -> (M, <= max_len) ``embed_texts`` rows, the ids ``encode_texts`` makes of
        their words: ``<bos>`` first, and a caption cut at the length limit ends in ``<eos>``, in its last word's
        place when it would not fit."""
        ids = self.special_ids
        M = captions.shape[0]
        bos = captions.new_full((M, 1), ids.bos_id)
        rows = torch.cat([bos, captions, captions.new_full((M, 1), ids.pad_id)], dim=1)  # (M, 2 + T')
        cut = ~(captions == ids.eos_id).any(dim=1)  # (M,)
        at = ((captions != ids.pad_id).sum(dim=1) + 1).clamp(max=self.max_len - 1)  # (M,) where its <eos> goes
        rows[cut.nonzero()[:, 0], at[cut]] = ids.eos_id
        return rows[:, : self.max_len]


class CocaCaptioner(Embedder, ImageCaptioner):
    """An ``ImageCaptioner`` that also embeds images and texts, L2-normalised, in one space of width E.

    Args:
        encoder, decoder: the captioner's.
        embed_dim: E.
        text_depth, text_num_heads, text_mlp_ratio: the text tower's layers; its width, length and the rest are the
            decoder's.
        init_logit_scale: the start of the learned log temperature (CLIP's log(1/0.07), SigLIP's log 10).
        init_logit_bias: the start of SigLIP's learned logit bias; None: no bias (CLIP).
    """

    def __init__(
        self,
        encoder: VisionTransformer,
        decoder: CaptionDecoder,
        embed_dim: int = 512,
        text_depth: int = 2,
        text_num_heads: int = 4,
        text_mlp_ratio: float = 4.0,
        init_logit_scale: float = math.log(1 / 0.07),
        init_logit_bias: float | None = None,
    ) -> None:
        contrastive = {k: v for k, v in locals().items() if k not in ("self", "encoder", "decoder", "__class__")}
        super().__init__(encoder, decoder)
        self.contrastive_config = contrastive
        dec = decoder.config
        width = dec["embed_dim"]
        shared = {k: dec[k] for k in ("drop_rate", "norm_first", "activation", "layer_norm_eps", "fused_attn")}
        self.text = TextEncoder(width, text_depth, text_num_heads, text_mlp_ratio, dec["max_len"], **shared)
        self.embed_dim = embed_dim
        self.image_proj = nn.Linear(encoder.embed_dim, embed_dim, bias=False)
        self.text_proj = nn.Linear(width, embed_dim, bias=False)
        # (1,), not scalars: FSDP shards no scalar parameter
        self.logit_scale = nn.Parameter(torch.full((1,), float(init_logit_scale)))
        bias = init_logit_bias is not None
        self.logit_bias = nn.Parameter(torch.full((1,), float(init_logit_bias))) if bias else None

    @property
    def config(self) -> dict[str, Any]:
        return {**super().config, "contrastive": self.contrastive_config}

    def embed_images(self, images: Tensor | Patches) -> Tensor:
        return self.embed_features(self.encoder.forward_tokens(images))

    def embed_texts(self, tokens: Tensor) -> Tensor:
        x = self.decoder.token_embed(tokens)  # (N, T, D): the decoder's embedding, shared
        return F.normalize(self.text_proj(self.text(x, tokens == self.decoder.pad_id)), dim=-1)

    def encode_and_embed(self, images: Tensor | Patches) -> tuple[Memory, Tensor]:
        encoded = self.encoder.forward_tokens(images)  # (B, N, D): once for both
        return self.memory(encoded), self.embed_features(encoded)

    def forward_coca(
        self, images: Tensor, tokens: Tensor, texts: Tensor, caption_image: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Training's pass, one encoding of each image: the (N, T - 1, V) teacher-forced logits of captions
        ``tokens`` (N, T) (caption n of image ``caption_image[n]``, as ``forward``), the (B, E) image embeddings and
        the text embeddings of ``texts`` (M, T). Under FSDP a forward method (``shard_layers`` registers it)."""
        encoded = self.encoder.forward_tokens(images)  # (B, N, D)
        logits = self.decoder(tokens[:, :-1], per_caption(self.memory(encoded), caption_image))
        return logits, self.embed_features(encoded), self.embed_texts(texts)

    def embed_features(self, encoded: Memory) -> Tensor:
        """(B, E) image embeddings from the encoder's ``forward_tokens``: its own pool (merged tokens weighted by
        their sizes) and norm, projected."""
        pooled = self.encoder.forward_head(encoded, pre_logits=True)  # (B, D)
        return F.normalize(self.image_proj(pooled), dim=-1)


def captioner_from_config(config: dict[str, Any]) -> ImageCaptioner:
    """The captioner of a saved ``config``: a ``CocaCaptioner`` when it has a ``contrastive`` part."""
    return (CocaCaptioner if "contrastive" in config else ImageCaptioner).from_config(config)
