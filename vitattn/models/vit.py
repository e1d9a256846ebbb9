"""Vision transformer encoder built from the document's ``EncoderLayer``.

Dimension letters: B batch, C channels, N tokens (patches + class token), D width, P patch side.
Stages as in timm: ``forward_tokens`` (the ``Memory`` of (B, N, D) tokens: with merging, their sizes) -> ``pool``
(B, D) -> ``forward_head`` (B, classes); ``forward_features`` is timm's (B, N, D), the tokens alone. Each stage
takes square images (B, C, height, width) or, as timm's NaFlex ViT, ``Patches``: images cut at their own grids and
padded to one length, whose padding the layers, the pool and the decoder mask out (docs/training.md).
"""

from __future__ import annotations

import math
import re
from importlib.resources import files
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from vitattn.layers import EncoderLayer, Memory, check_heads, merge_schedule

__all__ = [
    "PRESETS",
    "Patches",
    "VisionTransformer",
    "image_grids",
    "layer_groups",
    "preset_config",
    "resample_weights",
    "vit_preset",
]

POOLS = ("cls", "mean", "avg")
POS_EMBED_INITS = ("trunc_normal", "sincos")

PRESETS = ("cpu", "tiny", "small", "base")  # the size files of the ``model`` config group


def preset_config(name: str) -> dict[str, Any]:
    """``VisionTransformer`` keyword arguments of a named size, read from ``conf/model/<name>.yaml``
    (the one place the sizes are written); ``img_size`` is left to the caller (224 by default)."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is unknown; choose one of {sorted(PRESETS)}")
    folder = files("vitattn.conf") / "model"
    size = OmegaConf.create((folder / f"{name}.yaml").read_text())
    base = OmegaConf.create((folder / "_vit.yaml").read_text())
    merged = OmegaConf.merge(base, {k: v for k, v in size.items() if k != "defaults"})
    return {k: merged[k] for k in merged if k != "img_size"}


def layer_groups(prefix: str = "") -> dict[str, Any]:
    """timm's ``group_matcher`` regexes (layer-wise lr decay) for ViT parameters named ``prefix...``: the stem
    0, block ``i`` ``i + 1``, the final norm with the last block, the rest (a head, a decoder) one past it."""
    p = re.escape(prefix)
    return dict(
        stem=rf"^{p}(?:cls_token|pos_embed|patch_embed)",
        blocks=[(rf"^{p}blocks\.(\d+)", None), (rf"^{p}norm", (99999,))],
    )


def trunc_normal_(tensor: Tensor, std: float = 0.02) -> Tensor:
    """timm's ``trunc_normal_`` (cut at +-2), draw for draw: torch's draws otherwise, and a seed must give one model."""
    with torch.no_grad():
        low, high = ((1.0 + math.erf(x / std / math.sqrt(2.0))) / 2.0 for x in (-2.0, 2.0))
        return tensor.uniform_(2 * low - 1, 2 * high - 1).erfinv_().mul_(std * math.sqrt(2.0)).add_(0.0).clamp_(-2, 2)


def init_linears_(module: nn.Module) -> None:
    """timm's ViT init of every ``nn.Linear`` in ``module``: weights truncated normal (std 0.02), biases zero."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def resample_weights(out_size: Tensor, at: Tensor, size: int) -> Tensor:
    """The weights over ``size`` table entries of output entry ``at`` when the table is resized to ``out_size``
    entries: ``F.interpolate(mode="bicubic", antialias=True, align_corners=False)``, one axis, as a dense row
    (PyTorch's filter, PIL's cubic with a = -0.5, widened by the scale when shrinking, normalised; taps beyond its
    support weigh 0). ``out_size`` and ``at`` broadcast: (...,) -> (..., size). Equal to PyTorch's kernel in float64."""
    scale = size / out_size.float()  # (...,): input entries per output entry
    center = scale * (at.float() + 0.5)  # where output entry ``at`` sits on the table's axis
    x = ((torch.arange(size, device=at.device) + 0.5 - center.unsqueeze(-1)) / scale.clamp(min=1).unsqueeze(-1)).abs()
    a = -0.5
    near = ((a + 2) * x - (a + 3)) * x * x + 1  # |x| < 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a  # 1 <= |x| < 2
    w = torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))  # (..., size)
    return w / w.sum(dim=-1, keepdim=True)


def image_grids(coord: Tensor, valid: Tensor) -> Tensor:
    """(B, N, 2) patch coordinates and (B, N) validity -> (B, 2) each image's rows and columns: its valid patches'
    largest coordinates + 1 (tensors only, so an ONNX graph computes it)."""
    return (coord * valid.unsqueeze(-1)).amax(dim=1) + 1


class Patches(NamedTuple):
    """Images cut into P x P patches at each one's own grid, padded to the batch's longest (timm NaFlex's
    ``patches``, ``patch_coord``, ``patch_valid``): ``patches`` (B, N, P*P*C), each patch's pixels in (row, column,
    channel) order as timm's ``patchify_image``; ``coord`` (B, N, 2) long, its (row, column) in its image's grid;
    ``valid`` (B, N) bool, False for padding. An image's grid is its valid patches' largest coordinates + 1."""

    patches: Tensor
    coord: Tensor
    valid: Tensor

    @property
    def device(self) -> torch.device:
        return self.patches.device

    def grids(self) -> list[tuple[int, int]]:
        """Each image's (rows, columns) (``image_grids``)."""
        return [(rows, cols) for rows, cols in image_grids(self.coord, self.valid).tolist()]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Patches:
        """The three tensors on ``device``, as a batch of images moves."""
        return Patches(*(t.to(device, non_blocking=non_blocking) for t in self))


class PatchEmbed(nn.Module):
    """timm's ``PatchEmbed`` as the ViT uses it (its parameter names): (B, C, height, width) -> (B, N, D)."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int, bias: bool = True) -> None:
        super().__init__()
        self.img_size, self.patch_size = (img_size, img_size), (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, patch_size, patch_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        torch._assert(
            tuple(x.shape[-2:]) == self.img_size, f"images must be {self.img_size}, not {tuple(x.shape[-2:])}"
        )
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, N, D)

    def forward_patches(self, patches: Tensor) -> Tensor:
        """(B, N, P*P*C) patches in (row, column, channel) order -> (B, N, D): the convolution as the one matmul
        it is over each patch."""
        weight = self.proj.weight.permute(0, 2, 3, 1).flatten(1)  # (D, C, P, P) -> (D, P*P*C)
        return F.linear(patches, weight, self.proj.bias)


class VisionTransformer(nn.Module):
    """ViT: strided-conv patch embedding, class token, learned positions, ``EncoderLayer`` stack.

    Arguments are timm's (``num_classes=0``: features; ``drop_path_rate`` rises over the layers; ``fc_norm`` None:
    on for ``avg``), and:

    Args:
        global_pool: ``cls``, ``mean`` (of the patch tokens) or ``avg`` (timm's: the mean, then ``fc_norm``).
        norm_first: pre-norm layers (pretrained ViTs) or the document's post-norm.
        activation: ``gelu`` (ViT), ``relu`` (the document) or ``quick_gelu`` (OpenAI CLIP).
        norm_pre: a LayerNorm before the layers (timm's ``pre_norm``, CLIP); the patch embedding then has no bias.
        fused_attn: fused attention kernels when weights are not asked for.
        pos_embed_init: ``trunc_normal`` (timm's) or ``sincos`` (MAE's fixed 2-D embedding, learned from there).
        grad_checkpointing: recompute each layer in the backward pass (``set_grad_checkpointing``).
        merge_tokens: tokens each layer merges (ToMe, ``set_merge_tokens``): an int, or a list with one per layer;
            0 (off) runs the document's layers unchanged.
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 0,
        global_pool: str = "cls",
        embed_dim: int = 192,
        depth: int = 12,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        norm_first: bool = True,
        activation: str = "gelu",
        norm_pre: bool = False,
        fc_norm: bool | None = None,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        layer_norm_eps: float = 1e-6,
        fused_attn: bool = True,
        pos_embed_init: str = "trunc_normal",
        grad_checkpointing: bool = False,
        merge_tokens: int | list[int] = 0,
    ) -> None:
        config = dict(locals())
        del config["self"], config["__class__"]
        super().__init__()
        if img_size % patch_size != 0:
            raise ValueError(f"img_size={img_size} must be divisible by patch_size={patch_size}")
        check_heads(num_heads, embed_dim)
        if global_pool not in POOLS:
            raise ValueError(f"global_pool={global_pool!r} is unknown; choose one of {list(POOLS)}")
        if pos_embed_init not in POS_EMBED_INITS:
            raise ValueError(f"pos_embed_init={pos_embed_init!r} is unknown; choose one of {list(POS_EMBED_INITS)}")
        if pos_embed_init == "sincos" and embed_dim % 4 != 0:
            raise ValueError(
                f"pos_embed_init=sincos needs embed_dim divisible by 4, not {embed_dim}; "
                "use pos_embed_init=trunc_normal for this width"
            )
        self.config = config  # plain values that rebuild this model (bundles, checkpoints)
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.embed_dim = self.num_features = embed_dim
        self.num_prefix_tokens = 1

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, bias=not norm_pre)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.norm_pre = nn.LayerNorm(embed_dim, eps=layer_norm_eps) if norm_pre else nn.Identity()
        dpr = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()  # plain floats, also under a meta device
        self.blocks = nn.Sequential(
            *[
                EncoderLayer(
                    embed_dim,
                    num_heads,
                    int(embed_dim * mlp_ratio),
                    rate=drop_rate,
                    norm_first=norm_first,
                    activation=activation,
                    attn_drop=attn_drop_rate,
                    drop_path=dpr[i],
                    layer_norm_eps=layer_norm_eps,
                    qkv_bias=qkv_bias,
                    fused_attn=fused_attn,
                )
                for i in range(depth)
            ]
        )
        # Post-norm layers end in a LayerNorm already; pre-norm stacks need a final one, on the tokens
        # or (fc_norm, timm's avg pool) on the pooled feature.
        use_fc_norm = global_pool == "avg" if fc_norm is None else fc_norm
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps) if norm_first and not use_fc_norm else nn.Identity()
        self.fc_norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.set_grad_checkpointing(grad_checkpointing)
        self.set_merge_tokens(merge_tokens)
        self._init_weights(pos_embed_init)

    def _init_weights(self, pos_embed_init: str) -> None:
        if self.pos_embed.is_meta:  # a copy without values (on the meta device): nothing to fill
            return
        if pos_embed_init == "sincos":
            from timm.layers import build_sincos2d_pos_embed  # timm: only for this init (the first caption: no timm)

            with torch.no_grad():
                self.pos_embed.zero_()
                grid = list(self.patch_embed.grid_size)
                self.pos_embed[0, self.num_prefix_tokens :] = build_sincos2d_pos_embed(
                    grid, self.embed_dim, device=self.pos_embed.device
                )
        else:
            trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        init_linears_(self)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each layer in the backward pass while training (timm's switch): less memory, one more forward."""
        self.grad_checkpointing = self.config["grad_checkpointing"] = enable

    def set_merge_tokens(self, merge_tokens: int | list[int]) -> None:
        """Merge ``merge_tokens`` tokens in each layer (ToMe; a list: one count per layer; 0: off), whatever the
        weights were trained with; ``merge_schedule`` is then what each layer merges. A count larger than a layer
        allows is refused in one line that names the largest."""
        tokens = self.patch_embed.num_patches + self.num_prefix_tokens
        self.merge_schedule = merge_schedule(merge_tokens, tokens, len(self.blocks))
        self.config["merge_tokens"] = merge_tokens if isinstance(merge_tokens, int) else list(self.merge_schedule)

    @property
    def num_tokens(self) -> int:
        """Tokens out of ``forward_features``: the patches and class token less every merged one."""
        return self.patch_embed.num_patches + self.num_prefix_tokens - sum(self.merge_schedule)

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter layers for timm's layer-wise lr decay (``coarse`` is accepted as timm's ViT does, unused)."""
        return layer_groups()

    def _load_from_state_dict(self, state_dict: dict[str, Tensor], prefix: str, *args: Any, **kwargs: Any) -> None:
        # Weights trained at another image size: resample their position grid to ours.
        key = prefix + "pos_embed"
        if key in state_dict and state_dict[key].shape != self.pos_embed.shape:
            from timm.layers import resample_abs_pos_embed  # timm: only for weights of another size

            state_dict[key] = resample_abs_pos_embed(
                state_dict[key], new_size=list(self.patch_embed.grid_size), num_prefix_tokens=self.num_prefix_tokens
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def patch_positions(self, coord: Tensor, valid: Tensor) -> Tensor:
        """(B, N, D) learned positions of patches at (B, N, 2) ``coord`` (``Patches``'): the position table, sized
        by ``img_size``, resampled to each image's grid as weights of another image size are (timm's
        ``resample_abs_pos_embed``: bicubic, antialiased; a grid of the table's size takes it as it is), at every
        forward. Written as each patch's weights over the table's rows and columns (``resample_weights``), not a
        loop over the batch's grids: tensors only, so the ONNX graph resamples any grid (docs/captioning.md)."""
        G = self.patch_embed.grid_size[0]
        table = self.pos_embed[0, self.num_prefix_tokens :]  # (G*G, D)
        grids = image_grids(coord, valid).unsqueeze(1)  # (B, 1, 2): each image's rows, columns
        rows = resample_weights(grids[..., 0], coord[..., 0], G)  # (B, N, G)
        cols = resample_weights(grids[..., 1], coord[..., 1], G)  # (B, N, G)
        weights = (rows.unsqueeze(-1) * cols.unsqueeze(-2)).flatten(2)  # (B, N, G*G)
        with torch.autocast(coord.device.type, enabled=False):  # fp32, as timm resamples (padding: 0, masked anyway)
            pos = (weights * valid.unsqueeze(-1)) @ table.float()  # (B, N, D)
        return pos.to(table.dtype)

    def embed(self, x: Tensor | Patches) -> Memory:
        """(B, C, height, width) images or ``Patches`` -> the ``Memory`` of their (B, N, D) embedded tokens, class
        token first, with positions: ``valid`` (the class token valid) for ``Patches``, None for images."""
        if isinstance(x, Patches):
            patches = self.patch_embed.forward_patches(x.patches) + self.patch_positions(x.coord, x.valid)
            cls = (self.cls_token + self.pos_embed[:, : self.num_prefix_tokens]).expand(patches.shape[0], -1, -1)
            tokens = torch.cat([cls, patches], dim=1)  # (B, N, D)
            valid = torch.cat([x.valid.new_ones(x.valid.shape[0], self.num_prefix_tokens), x.valid], dim=1)
            return Memory(self.norm_pre(self.pos_drop(tokens)), valid=valid)
        x = self.patch_embed(x)  # (B, N-1, D)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, D)
        return Memory(self.norm_pre(self.pos_drop(torch.cat([cls, x], dim=1) + self.pos_embed)))  # (B, N, D)

    def forward_tokens(self, x: Tensor | Patches, trace: list[Memory] | None = None) -> Memory:
        """(B, C, height, width) images or ``Patches`` -> the ``Memory`` of their (B, N, D) tokens, class token
        first: with merging (ToMe), the merged tokens' sizes; with ``Patches``, which are padding (``valid``).
        ``trace``, a list, receives with merging each layer's input ``Memory`` and then the last, with ``sources``:
        which patch tokens each token holds (attention maps)."""
        memory = self.embed(x)
        x = memory.tokens
        tracing = trace is not None and any(self.merge_schedule)
        if tracing:
            eye = torch.eye(x.shape[1], device=x.device, dtype=x.dtype)
            memory = memory._replace(sizes=x.new_ones(x.shape[:2]), sources=eye.expand(x.shape[0], -1, -1))
        recompute = self.grad_checkpointing and self.training and torch.is_grad_enabled()
        for block, r in zip(self.blocks, self.merge_schedule):
            if tracing:
                trace.append(memory)
            if recompute:
                # keeps only the layer's input; the backward runs the layer again
                memory = checkpoint(block, memory, None, r, use_reentrant=False)
            else:
                memory = block(memory, None, r)
        if tracing:
            trace.append(memory)
        return memory._replace(tokens=self.norm(memory.tokens))

    def forward_features(self, x: Tensor | Patches) -> Tensor:
        """(B, C, height, width) images or ``Patches`` -> (B, N, D) tokens, class token first (fewer with
        ``merge_tokens``; padding included with ``Patches``)."""
        return self.forward_tokens(x).tokens

    def pool(self, x: Memory) -> Tensor:
        """The ``Memory`` of (B, N, D) tokens -> (B, D): the class token, or the mean of the patch tokens (merged
        tokens weighted by their sizes: the mean of the patches they hold; padding weighted 0)."""
        tokens = x.tokens
        if self.global_pool in ("mean", "avg"):
            patches = tokens[:, self.num_prefix_tokens :]
            if x.sizes is None and x.valid is None:
                return patches.mean(dim=1)
            weight = patches.new_ones(patches.shape[:2]) if x.sizes is None else x.sizes[:, self.num_prefix_tokens :]
            if x.valid is not None:
                weight = weight * x.valid[:, self.num_prefix_tokens :]
            weight = weight.unsqueeze(-1).to(tokens.dtype)  # (B, N - 1, 1)
            return (patches * weight).sum(dim=1) / weight.sum(dim=1)
        return tokens[:, 0]

    def forward_head(self, x: Memory, pre_logits: bool = False) -> Tensor:
        """The ``Memory`` of (B, N, D) tokens -> (B, num_classes) logits, or the pooled (B, D) feature with
        ``pre_logits``."""
        x = self.head_drop(self.fc_norm(self.pool(x)))
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor | Patches) -> Tensor:
        """(B, C, height, width) or ``Patches`` -> (B, num_classes) logits, or (B, D) features when
        ``num_classes=0``."""
        return self.forward_head(self.forward_tokens(x))


def vit_preset(name: str, **overrides: Any) -> VisionTransformer:
    """A ``VisionTransformer`` of a named size (``cpu``, ``tiny``, ``small``, ``base``), as ``model=NAME`` builds it."""
    return VisionTransformer(**{**preset_config(name), **overrides})
