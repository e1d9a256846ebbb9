"""The shared caption search (``vitattn.models.search``): what it never generates."""

from __future__ import annotations

import pytest
import torch


def _unk_loving_bundle(folder):
    """A tiny random captioner whose output layer favours ``<unk>`` by far, saved as a bundle."""
    from tests.helpers import CAPTION_PREPROCESS, CAPTION_WORDS
    from vitattn.bundle import save_bundle
    from vitattn.data.vocab import Vocabulary
    from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer

    vocab = Vocabulary(CAPTION_WORDS)
    decoder = CaptionDecoder(len(vocab), embed_dim=32, depth=1, num_heads=2, max_len=8, tie_embeddings=False)
    with torch.no_grad():
        decoder.head.bias[vocab.unk_id] = 20.0
        decoder.head.bias[vocab.eos_id] = 1.0  # after <unk>, <eos> is likely: beams finish at several steps
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    model = ImageCaptioner(encoder, decoder).eval()
    return save_bundle(folder, model, task="caption", preprocess=CAPTION_PREPROCESS, vocab=vocab)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_decoder_that_prefers_unk_never_generates_it_eager_or_onnx(tmp_path, num_beams):
    """The ban is in the one shared search: PyTorch and ONNX Runtime give the same captions, without
    ``<unk>``; an ONNX folder written before ``onnx.json`` carried ``unk_id`` takes its vocabulary's."""
    pytest.importorskip("onnxruntime", reason="the onnx extra: pip install -e '.[onnx]'")
    import json

    from vitattn.bundle import load_bundle
    from vitattn.bundle.onnx_export import export_onnx
    from vitattn.inference.loader import load_model

    bundle = load_bundle(_unk_loving_bundle(tmp_path / "bundle"))
    unk = bundle.vocab.unk_id
    images = torch.randn(6, 3, 32, 32)
    with torch.no_grad():
        eager = bundle.model.generate(images, num_beams=num_beams)
        bundle.model.decoder.unk_id = None  # the ban lifted: <unk> is what this decoder says
        assert (bundle.model.generate(images, num_beams=num_beams) == unk).any()
        bundle.model.decoder.unk_id = unk
    assert not (eager == unk).any()
    onnx_dir = export_onnx(bundle, tmp_path / "onnx")
    config = json.loads((onnx_dir / "onnx.json").read_text())
    assert config["decoder"]["unk_id"] == unk
    torch.testing.assert_close(load_model(onnx_dir).model.generate(images, num_beams=num_beams), eager)
    del config["decoder"]["unk_id"]  # as an ONNX folder of an earlier vitattn
    (onnx_dir / "onnx.json").write_text(json.dumps(config))
    older = load_model(onnx_dir).model
    assert older.special_ids.unk_id == unk
    torch.testing.assert_close(older.generate(images, num_beams=num_beams), eager)


def test_a_bundle_saved_before_unk_id_bans_its_vocabularys_unk(tmp_path):
    """A decoder config without ``unk_id`` (bundles of an earlier vitattn, all word-level) gets
    ``Vocabulary``'s, as its ``pad_id``, ``bos_id`` and ``eos_id`` defaults are."""
    import json

    from vitattn.bundle import load_bundle

    folder = _unk_loving_bundle(tmp_path / "bundle")
    config = json.loads((folder / "config.json").read_text())
    del config["model"]["decoder"]["unk_id"]
    (folder / "config.json").write_text(json.dumps(config))
    bundle = load_bundle(folder)
    assert bundle.model.special_ids.unk_id == bundle.vocab.unk_id
    with torch.no_grad():
        assert not (bundle.model.generate(torch.randn(4, 3, 32, 32), num_beams=2) == bundle.vocab.unk_id).any()
