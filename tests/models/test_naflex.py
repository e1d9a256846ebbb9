"""Images at their own grids (``Patches``, docs/training.md): a batch of mixed-aspect images padded to its longest,
each image's tokens, logits and captions as it gets alone (no padding at all), and an image alone as timm's ViT
with dynamic image sizes gets it with the same weights.

Dimension letters: B images, N patches (the batch's longest), D width, T caption positions, K beams.
"""

from __future__ import annotations

import pytest
import timm
import torch

from vitattn.data.preprocess import pad_patches, patchify
from vitattn.models.caption import CaptionDecoder, DecoderStep, ImageCaptioner
from vitattn.models.timm_weights import load_timm_weights
from vitattn.models.vit import Patches, VisionTransformer

P = 8  # patch side; the position table is 4 x 4 (img_size 32)
SIZES = [(16, 32), (32, 16), (8, 32), (24, 24), (32, 32), (8, 8), (40, 8)]  # grids 2x4 4x2 1x4 3x3 4x4 1x1 5x1
VIT = dict(img_size=32, patch_size=P, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)


def _vit(fused_attn: bool = False, **kwargs) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(**VIT, num_classes=5, fused_attn=fused_attn, **kwargs).eval()


def _images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, h, w, generator=g) for h, w in SIZES]


def _batch(images: list[torch.Tensor]) -> Patches:
    return pad_patches([patchify(image, P) for image in images])


def _lengths(images: list[torch.Tensor]) -> list[int]:
    return [1 + (image.shape[1] // P) * (image.shape[2] // P) for image in images]  # class token + patches


@pytest.mark.parametrize("global_pool", ["cls", "avg"])
def test_each_image_of_a_mixed_batch_encodes_and_classifies_as_it_does_alone(global_pool):
    model, images = _vit(global_pool=global_pool), _images()
    with torch.no_grad():
        batch = model.forward_tokens(_batch(images))
        logits = model.forward_head(batch)
        for i, (image, n) in enumerate(zip(images, _lengths(images))):
            alone = model.forward_tokens(_batch([image]))
            assert alone.tokens.shape[1] == n and bool(alone.valid.all())  # alone: no padding at all
            torch.testing.assert_close(batch.tokens[i, :n], alone.tokens[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(logits[i], model.forward_head(alone)[0], atol=1e-5, rtol=0)
    assert batch.valid.sum(1).tolist() == _lengths(images)


def test_an_image_alone_is_timms_vit_at_its_size_with_the_same_weights():
    """The oracle for the patch embedding and the position table resampled to each grid: timm's ViT with
    ``dynamic_img_size`` resamples its table to the image's grid (bicubic, antialiased), from the image itself."""
    ref = timm.models.vision_transformer.VisionTransformer(
        **VIT, num_classes=5, dynamic_img_size=True, global_pool="token"
    ).eval()
    ours = _vit()
    load_timm_weights(ours, ref)
    with torch.no_grad():
        for image in _images():
            torch.testing.assert_close(ours(_batch([image])), ref(image[None]), atol=1e-5, rtol=1e-5)


def test_a_square_image_as_patches_is_the_square_forward_bit_for_bit():
    model = _vit(global_pool="avg")
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(_batch(list(images))), model(images))


@pytest.mark.parametrize("global_pool", ["cls", "avg"])
def test_fused_attention_masks_padding_as_the_explicit_path(global_pool):
    explicit, fused = _vit(False, global_pool=global_pool), _vit(True, global_pool=global_pool)
    patches = _batch(_images())
    with torch.no_grad():
        a, b = explicit.forward_tokens(patches), fused.forward_tokens(patches)
        valid = patches.valid
        torch.testing.assert_close(a.tokens[:, 1:][valid], b.tokens[:, 1:][valid], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(explicit.forward_head(a), fused.forward_head(b), atol=1e-5, rtol=1e-5)


def test_token_merging_of_padded_patches_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^token merging \(model.merge_tokens\) .*data.max_patches"):
        _vit(merge_tokens=1)(_batch(_images()))


def _captioner() -> ImageCaptioner:
    torch.manual_seed(0)
    encoder = VisionTransformer(**VIT, fused_attn=False)
    decoder = CaptionDecoder(12, embed_dim=32, depth=2, num_heads=2, max_len=8, drop_rate=0.0, fused_attn=False)
    model = ImageCaptioner(encoder, decoder).eval()
    with torch.no_grad():  # weights large enough that images get different captions
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.3)
    return model


def test_each_images_caption_logits_and_cached_steps_are_as_alone():
    """Teacher-forced logits, and the cached decoder's steps with K = 2 rows per image (the beams' shared
    cross-attention), for each image of a mixed batch as for the image alone."""
    model, images = _captioner(), _images()
    B, K, T = len(images), 2, 6
    tokens = torch.randint(4, 12, (B * K, T), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = model.decoder.bos_id
    with torch.no_grad():
        memory = model.encode(_batch(images))
        forced = model.decoder(tokens[::K], memory)  # (B, T, V)
        step = DecoderStep(model.decoder, memory, model.decoder.new_cache(T))
        steps = torch.stack([step(tokens[:, : t + 1]) for t in range(T)], 1)  # (B * K, T, V)
        for i, image in enumerate(images):
            alone = model.encode(_batch([image]))
            torch.testing.assert_close(forced[i], model.decoder(tokens[K * i : K * i + 1], alone)[0], atol=1e-5, rtol=0)
            step = DecoderStep(model.decoder, alone, model.decoder.new_cache(T))
            rows = tokens[K * i : K * (i + 1)]
            expected = torch.stack([step(rows[:, : t + 1]) for t in range(T)], 1)  # (K, T, V)
            torch.testing.assert_close(steps[K * i : K * (i + 1)], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_each_images_generated_caption_is_its_caption_alone(num_beams):
    model, images = _captioner(), _images()
    batch = model.generate(_batch(images), max_new_tokens=7, num_beams=num_beams)
    assert len({tuple(row.tolist()) for row in batch}) >= 4  # captions that differ can show a neighbour's
    for i, image in enumerate(images):
        alone = model.generate(_batch([image]), max_new_tokens=7, num_beams=num_beams)[0]
        n = len(alone)
        assert batch[i, :n].tolist() == alone.tolist()
        assert (batch[i, n:] == model.decoder.pad_id).all()


@pytest.mark.parametrize("size", [4, 14])
def test_resample_weights_are_pytorchs_antialiased_bicubic_kernel(size):
    """The oracle: ``F.interpolate(antialias=True)`` of the identity table, in float64, along the rows (two columns
    kept: torch 2.14's kernel gives every output row the first one's weights when the other side is 1 wide)."""
    import torch.nn.functional as F

    from vitattn.models.vit import resample_weights

    eye = torch.eye(size, dtype=torch.float64).reshape(1, size, size, 1).repeat(1, 1, 1, 2)  # channel j: entry j
    for out in range(1, 3 * size + 1):  # shrinking, as it is, growing
        kernel = F.interpolate(eye, size=(out, 2), mode="bicubic", antialias=True, align_corners=False)
        expected = kernel[0, :, :, 0].T.float()  # (out, size): each output entry's weights
        weights = resample_weights(torch.tensor(out), torch.arange(out), size)
        torch.testing.assert_close(weights, expected, atol=3e-6, rtol=0)  # computed in fp32
