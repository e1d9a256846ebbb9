import io
import json

import pytest
import torch
from PIL import Image

from vitattn.bundle import save_bundle
from vitattn.cli.caption import main
from vitattn.data.tokenizer import Vocabulary
from vitattn.inference import attention_figure, attention_from_tokens, attention_rollout, figure_png
from vitattn.layers import MultiHeadAttention, record_attention
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
WORDS = "a red blue green circle square on the left right".split()


def caption_attention_maps(model, images, layer=-1, **generate):
    """Caption ``images`` as ``generate`` does, then the maps of the captions: what ``Captioner.attention_maps``
    and ``vitattn-caption attention_maps=`` do."""
    tokens = model.generate(images, **generate)
    return (tokens, *attention_from_tokens(model, images, tokens, layer))


def tiny_captioner(norm_first: bool = True) -> ImageCaptioner:
    vocab = Vocabulary(WORDS)
    decoder = CaptionDecoder(
        len(vocab), embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, max_len=8, norm_first=norm_first
    )
    with torch.no_grad():
        decoder.token_embed.weight[vocab.eos_id].mul_(0.2)  # some captions stop early, some run to the end
    encoder = VisionTransformer(**TINY, norm_first=norm_first, activation="gelu" if norm_first else "relu")
    return ImageCaptioner(encoder, decoder).eval()


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_caption_attention_maps_shapes_and_normalisation(norm_first, num_beams):
    model = tiny_captioner(norm_first)
    images = torch.randn(3, 3, 32, 32)
    tokens, cross, rollout = caption_attention_maps(model, images, num_beams=num_beams)
    torch.testing.assert_close(tokens, model.generate(images, num_beams=num_beams), rtol=0, atol=0)
    assert cross.shape == (3, tokens.shape[1], 4, 4) and rollout.shape == (3, 4, 4)
    assert (cross >= 0).all() and (rollout >= 0).all()
    torch.testing.assert_close(cross.sum(dim=(-2, -1)), torch.ones(3, tokens.shape[1]))
    torch.testing.assert_close(rollout.sum(dim=(-2, -1)), torch.ones(3))
    assert caption_attention_maps(model, images, layer=0, num_beams=num_beams)[1].shape == cross.shape
    with pytest.raises(ValueError, match="layer=2 is out of range"):
        caption_attention_maps(model, images, layer=2)


def test_cross_maps_equal_those_recorded_while_decoding():
    """Oracle: position t of the teacher-forced pass is the decoding step that produced word t."""
    model = tiny_captioner()
    images = torch.randn(2, 3, 32, 32)
    with record_attention(model) as maps:
        tokens = model.generate(images)  # explicit attention, one (B, H, 1, N) record per step
    steps = torch.cat(maps["decoder.layers.1.mha2"], dim=2).mean(dim=1)[..., 1:]  # (B, T', N-1)
    expected = (steps / steps.sum(-1, keepdim=True)).view(2, -1, 4, 4)
    generated, cross, _ = caption_attention_maps(model, images)
    torch.testing.assert_close(generated, tokens, rtol=0, atol=0)
    torch.testing.assert_close(cross, expected, atol=1e-5, rtol=1e-5)


def test_maps_leave_fused_attention_and_outputs_alone():
    model = tiny_captioner()
    images = torch.randn(2, 3, 32, 32)
    before = model.generate(images, num_beams=2)
    caption_attention_maps(model, images, num_beams=2)
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert len(layers) == 2 + 2 * 2 and all(m._record is None for m in layers)
    torch.testing.assert_close(model.generate(images, num_beams=2), before, rtol=0, atol=0)


def test_attention_rollout_of_uniform_attention_is_uniform():
    B, H, N = 2, 3, 17
    uniform = [torch.full((B, H, N, N), 1.0 / N) for _ in range(4)]
    torch.testing.assert_close(attention_rollout(uniform), torch.full((B, N - 1), 1.0 / (N - 1)))
    # One layer by hand: heads averaged, identity added, rows renormalised, the class row over patches.
    a = torch.rand(B, H, N, N).softmax(-1)
    mixed = (a.mean(1) + torch.eye(N)) / 2
    expected = mixed[:, 0, 1:] / mixed[:, 0, 1:].sum(-1, keepdim=True)
    torch.testing.assert_close(attention_rollout([a]), expected)


def test_masking_half_the_image_changes_the_maps():
    model = tiny_captioner()
    with torch.no_grad():  # sharper attention than the near-uniform one of a fresh model
        for layer in model.modules():
            if isinstance(layer, MultiHeadAttention):
                layer.wq.weight.mul_(10)
                layer.wk.weight.mul_(10)
    images = torch.randn(2, 3, 32, 32)
    masked = images.clone()
    masked[..., 16:] = 0  # right half
    tokens, cross, rollout = caption_attention_maps(model, images)
    cross_masked, rollout_masked = attention_from_tokens(model, masked, tokens)  # same words, other image
    assert (cross - cross_masked).abs().max() > 0.02 and (rollout - rollout_masked).abs().max() > 0.02
    # Unchanged input, unchanged maps: the difference comes from the image.
    torch.testing.assert_close(attention_from_tokens(model, images, tokens), (cross, rollout))


def test_attention_figure_is_a_png(tmp_path):
    image = Image.new("RGB", (32, 32), (120, 60, 30))
    cross = torch.rand(4, 4, 4)
    png = figure_png(attention_figure(image, ["a", "red", "circle"], cross, torch.rand(4, 4), title="a red circle"))
    with Image.open(io.BytesIO(png)) as shown:
        assert shown.format == "PNG" and shown.size[0] > shown.size[1]
    figure_png(attention_figure(torch.rand(3, 32, 32), [], cross, torch.rand(4, 4)))  # a tensor image
    with pytest.raises(ValueError, match="5 words but only 4"):
        attention_figure(image, list("abcde"), cross, torch.rand(4, 4))


def test_cli_writes_one_figure_per_captioned_image(tmp_path):
    model = tiny_captioner()
    bundle = save_bundle(
        tmp_path / "bundle",
        model,
        task="caption",
        vocab=Vocabulary(WORDS),
        preprocess=dict(img_size=32, crop_pct=1.0, mean=[0.5] * 3, std=[0.5] * 3, interpolation="bicubic"),
    )
    for sub, color in (("a", (255, 0, 0)), ("b", (0, 0, 255))):
        (tmp_path / "imgs" / sub).mkdir(parents=True)
        Image.new("RGB", (40, 40), color).save(tmp_path / "imgs" / sub / "same.png")  # same stem twice
    (tmp_path / "imgs" / "bad.png").write_text("not an image")
    out, figs = tmp_path / "out.jsonl", tmp_path / "maps"
    args = [
        f"model={bundle}",
        f"images={tmp_path / 'imgs'}",
        f"out={out}",
        f"attention_maps={figs}",
        "num_workers=0",
        "progress=false",
    ]
    assert main(args) == 1
    assert sorted(p.name for p in figs.iterdir()) == ["same-2.png", "same.png"]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # The same captions as without maps.
    assert (
        main(
            [
                f"model={bundle}",
                f"images={tmp_path / 'imgs'}",
                f"out={tmp_path / 'plain.jsonl'}",
                "num_workers=0",
                "progress=false",
            ]
        )
        == 1
    )
    assert records == [json.loads(line) for line in (tmp_path / "plain.jsonl").read_text().splitlines()]


def test_maps_of_mixed_aspect_patches_are_each_images_own_by_hand():
    """``Patches`` of three grids (1 x 4, 3 x 2, 2 x 1; padded to 6): each image's maps at its own grid, equal to a
    hand computation over the image run alone: the last decoder layer's cross-attention weights averaged over heads
    and renormalised over the patches, and the rollout's class row, layer by layer (heads averaged, identity added,
    rows renormalised)."""
    from vitattn.data.preprocess import pad_patches, patchify

    model = tiny_captioner()
    g = torch.Generator().manual_seed(0)
    images = [torch.randn(3, 8 * r, 8 * c, generator=g) for r, c in ((1, 4), (3, 2), (2, 1))]
    batch = pad_patches([patchify(image, 8) for image in images])
    tokens, cross, rollout = caption_attention_maps(model, batch)
    for i, image in enumerate(images):
        rows, cols = image.shape[1] // 8, image.shape[2] // 8
        alone = pad_patches([patchify(image, 8)])
        inputs = torch.cat([tokens.new_full((1, 1), model.decoder.bos_id), tokens[i : i + 1, :-1]], dim=1)
        with record_attention(model) as maps, torch.no_grad():
            model.decoder(inputs, model.memory(model.encoder.forward_tokens(alone)))
        words = maps["decoder.layers.1.mha2"][0][0].mean(0)[:, 1:]  # (T', rows*cols): heads averaged, no class token
        expected = (words / words.sum(-1, keepdim=True)).view(-1, rows, cols)
        torch.testing.assert_close(cross[i], expected, atol=1e-5, rtol=0)
        flow = torch.eye(1 + rows * cols)
        for block in range(2):
            a = maps[f"encoder.blocks.{block}.mha"][0][0].mean(0) + torch.eye(1 + rows * cols)
            flow = (a / a.sum(-1, keepdim=True)) @ flow
        expected = (flow[0, 1:] / flow[0, 1:].sum()).view(rows, cols)
        torch.testing.assert_close(rollout[i], expected, atol=1e-5, rtol=0)
