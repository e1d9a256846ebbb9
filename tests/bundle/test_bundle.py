import json
import os
import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from vitattn.bundle import Bundle, bundle_from_system, load_bundle, save_bundle
from vitattn.data.preprocess import eval_transform
from vitattn.data.tokenizer import Vocabulary
from vitattn.models import CaptionDecoder, CocaCaptioner, ImageCaptioner, VisionTransformer

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
WORDS = "a red blue green circle square on the left right".split()
PREPROCESS = dict(img_size=32, crop_pct=1.0, crop_mode="squash", mean=[0.5] * 3, std=[0.5] * 3, interpolation="bicubic")


def tiny_captioner(vocab: Vocabulary) -> ImageCaptioner:
    decoder = CaptionDecoder(len(vocab), embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, max_len=8)
    with torch.no_grad():
        decoder.token_embed.weight[vocab.eos_id].zero_()  # a random model would often stop at once
    return ImageCaptioner(VisionTransformer(**TINY), decoder).eval()


def lightning_checkpoint(path: Path, model: torch.nn.Module, **hparams) -> Path:
    """What a Lightning checkpoint of our systems holds: plain hyperparameters, ``model.``-prefixed weights."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state["train_acc.tp"] = torch.zeros(1)  # system-level state that is not the model's
    torch.save(
        {
            "epoch": 1,
            "global_step": 10,
            "pytorch-lightning_version": "2.6.0",
            "state_dict": state,
            "hyper_parameters": hparams,
        },
        path,
    )
    return path


@pytest.fixture
def captioner_and_vocab():
    vocab = Vocabulary(WORDS)
    return tiny_captioner(vocab), vocab


def test_bundle_round_trip_generates_the_same_captions(tmp_path, captioner_and_vocab):
    model, vocab = captioner_and_vocab
    directory = save_bundle(
        tmp_path / "bundle", model, task="caption", preprocess=PREPROCESS, vocab=vocab, generate={"num_beams": 2}
    )
    assert sorted(os.listdir(directory)) == ["config.json", "model.safetensors", "vocab.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    config = json.loads((directory / "config.json").read_text())  # plain JSON
    assert config["format"] == "vitattn-bundle" and config["version"] == 1 and config["task"] == "caption"
    assert config["model"] == json.loads(json.dumps(model.config)) and config["vocab_file"] == "vocab.json"
    assert config["preprocess"] == PREPROCESS and config["generate"] == {"num_beams": 2}

    bundle = load_bundle(directory)
    assert isinstance(bundle, Bundle) and not bundle.model.training
    assert bundle.vocab == vocab and bundle.task == "caption" and bundle.generate == {"num_beams": 2}
    assert bundle.model.decoder.head.weight is bundle.model.decoder.token_embed.weight  # still tied
    images = torch.randn(3, 3, 32, 32)
    for kwargs in (dict(), dict(num_beams=3)):
        torch.testing.assert_close(
            bundle.model.generate(images, **kwargs), model.generate(images, **kwargs), rtol=0, atol=0
        )
    assert bundle.transform(Image.new("RGB", (50, 30), (255, 0, 0))).shape == (3, 32, 32)


@pytest.mark.parametrize(
    ("value", "message"),
    [("4", "other_special_ids='4'"), ([4, -1], "other_special_ids=[4, -1]"), ([True], "other_special_ids=[True]")],
)
def test_a_bundle_whose_special_ids_are_not_a_list_of_ids_is_one_line(value, message, tmp_path, captioner_and_vocab):
    model, vocab = captioner_and_vocab
    directory = save_bundle(tmp_path / "bundle", model, task="caption", preprocess=PREPROCESS, vocab=vocab)
    config = json.loads((directory / "config.json").read_text())
    assert config["model"]["decoder"]["other_special_ids"] == []
    config["model"]["decoder"]["other_special_ids"] = value
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(f"{message}; it must be a list of non-negative integers")):
        load_bundle(directory)


def test_a_bundle_of_a_per_layer_merge_schedule_round_trips(tmp_path, captioner_and_vocab):
    """``merge_tokens`` of type ``int | list[int]``: a list is one of its types (ToMe, a count per layer)."""
    model, vocab = captioner_and_vocab
    model.encoder.set_merge_tokens([4, 2])
    save_bundle(tmp_path / "b", model, task="caption", preprocess=PREPROCESS, vocab=vocab)
    assert load_bundle(tmp_path / "b").model.encoder.merge_schedule == [4, 2]
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    config["model"]["encoder"]["merge_tokens"] = [4, "2"]
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape("merge_tokens=[4, '2']; it must be int or a list of int")):
        load_bundle(tmp_path / "b")


def test_untied_output_layer_round_trips_and_old_configs_stay_tied(tmp_path):
    vocab = Vocabulary.build(WORDS, min_freq=1)
    untied = CaptionDecoder(len(vocab), embed_dim=32, depth=1, num_heads=2, max_len=8, tie_embeddings=False)
    assert untied.head.weight is not untied.token_embed.weight and untied.head.bias is not None
    model = ImageCaptioner(VisionTransformer(**TINY), untied).eval()
    with torch.no_grad():
        model.decoder.head.bias[vocab.eos_id] = -5.0  # the bias is saved and loaded, or the captions differ
    save_bundle(tmp_path / "b", model, task="caption", preprocess=PREPROCESS, vocab=vocab)
    loaded = load_bundle(tmp_path / "b").model
    assert loaded.decoder.head.weight is not loaded.decoder.token_embed.weight
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(loaded.generate(images), model.generate(images), rtol=0, atol=0)

    # a config written before the option existed has no tie_embeddings key: it was tied
    old = {**model.config, "decoder": {k: v for k, v in model.config["decoder"].items() if k != "tie_embeddings"}}
    rebuilt = ImageCaptioner.from_config(old)
    assert rebuilt.decoder.head.weight is rebuilt.decoder.token_embed.weight and rebuilt.decoder.head.bias is None


def test_a_bundle_of_a_grad_checkpointing_model_loads_exports_and_old_bundles_load(tmp_path, captioner_and_vocab):
    """The switch is saved with the model and changes nothing at inference: the bundle captions as the model,
    exports to ONNX, and a bundle written before the switch existed loads with it off."""
    model, vocab = captioner_and_vocab
    model.set_grad_checkpointing()
    images = torch.randn(3, 3, 32, 32)
    expected = model.generate(images)
    directory = save_bundle(tmp_path / "bundle", model, task="caption", preprocess=PREPROCESS, vocab=vocab)
    config = json.loads((directory / "config.json").read_text())
    assert config["model"]["encoder"]["grad_checkpointing"] is config["model"]["decoder"]["grad_checkpointing"] is True
    bundle = load_bundle(directory)
    assert bundle.model.encoder.grad_checkpointing and bundle.model.decoder.grad_checkpointing
    torch.testing.assert_close(bundle.model.generate(images), expected, rtol=0, atol=0)

    for part in ("encoder", "decoder"):  # as a bundle of an earlier vitattn
        del config["model"][part]["grad_checkpointing"]
    (directory / "config.json").write_text(json.dumps(config))
    old = load_bundle(directory).model
    assert not old.encoder.grad_checkpointing and not old.decoder.grad_checkpointing
    torch.testing.assert_close(old.generate(images), expected, rtol=0, atol=0)

    pytest.importorskip("onnxruntime", reason="the onnx extra: pip install -e '.[onnx]'")
    from vitattn.bundle import load_model
    from vitattn.bundle.onnx_export import export_onnx

    onnx_dir = export_onnx(bundle, tmp_path / "onnx")
    torch.testing.assert_close(load_model(onnx_dir).model.generate(images), expected, rtol=0, atol=0)


def test_bundle_round_trip_classification(tmp_path):
    model = VisionTransformer(**TINY, num_classes=3).eval()
    save_bundle(tmp_path / "b", model, task="classification", preprocess=PREPROCESS, class_names=["cat", "dog", "owl"])
    bundle = load_bundle(tmp_path / "b")
    assert bundle.task == "classification" and bundle.class_names == ["cat", "dog", "owl"] and bundle.vocab is None
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(bundle.model(x), model(x))


def _ties(model: torch.nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return sorted(names.values())


@pytest.mark.parametrize("head", ["caption", "coca", "classification"])
def test_a_loaded_bundle_holds_every_tensor_of_the_saved_model(tmp_path, head):
    """The loader builds the model once, without values, then fills it from the weights: every parameter and
    buffer is the saved one (a buffer left out of the state dict would stay unfilled), ties kept."""
    vocab = Vocabulary(WORDS)
    if head == "classification":
        model, labels = VisionTransformer(**TINY, num_classes=3).eval(), dict(class_names=["cat", "dog", "owl"])
    else:
        model, labels = tiny_captioner(vocab), dict(vocab=vocab)
        if head == "coca":
            model = CocaCaptioner(model.encoder, model.decoder, embed_dim=16, text_depth=1, text_num_heads=2).eval()
    task = "classification" if head == "classification" else "caption"
    loaded = load_bundle(save_bundle(tmp_path / "b", model, task=task, preprocess=PREPROCESS, **labels)).model
    assert type(loaded) is type(model) and not loaded.training
    expected = model.state_dict()
    assert dict(loaded.named_buffers()).keys() <= expected.keys()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    assert _ties(loaded) == _ties(model)


def test_load_bundle_from_run_folders_and_checkpoints(tmp_path, captioner_and_vocab):
    model, vocab = captioner_and_vocab
    images = torch.randn(2, 3, 32, 32)
    expected = model.generate(images)
    # (c) a Lightning checkpoint, hyperparameters as CaptionSystem saves them (no 'task' key; vocab without specials)
    hparams = dict(
        model_config=model.config, vocab=WORDS, preprocess=PREPROCESS, generate={"num_beams": 1}, label_smoothing=0.0
    )
    ckpt = lightning_checkpoint(tmp_path / "model.ckpt", model, **hparams)
    # (b) a run folder with only checkpoints/last.ckpt, then one with a bundle too
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    lightning_checkpoint(run / "checkpoints" / "last.ckpt", model, task="caption", **{**hparams, "vocab": vocab.itos})
    for source in (ckpt, run, run / "checkpoints" / "last.ckpt"):
        bundle = load_bundle(source)
        assert bundle.task == "caption" and bundle.vocab == vocab and bundle.preprocess == PREPROCESS
        torch.testing.assert_close(bundle.model.generate(images), expected, rtol=0, atol=0)
    save_bundle(run / "bundle", model, task="caption", preprocess=PREPROCESS, vocab=vocab)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")  # the bundle is preferred: the checkpoint is not read
    torch.testing.assert_close(load_bundle(run).model.generate(images), expected, rtol=0, atol=0)


def test_load_bundle_classification_checkpoint(tmp_path):
    model = VisionTransformer(**TINY, num_classes=2).eval()
    ckpt = lightning_checkpoint(
        tmp_path / "c.ckpt", model, model_config=model.config, class_names=["a", "b"], preprocess=PREPROCESS
    )
    bundle = load_bundle(ckpt)
    assert bundle.task == "classification" and bundle.class_names == ["a", "b"]
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(bundle.model(x), model(x))


class _Payload:
    """Unpickling this creates a folder: proof that the payload ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("kind", ["torch_zip", "raw_pickle"])
def test_load_bundle_refuses_pickled_checkpoint(tmp_path, captioner_and_vocab, kind):
    model, _ = captioner_and_vocab
    marker = tmp_path / "payload_ran"
    evil = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "hyper_parameters": {"model_config": model.config, "vocab": WORDS, "preprocess": PREPROCESS},
        "callbacks": _Payload(marker),
    }
    path = tmp_path / "evil.ckpt"
    if kind == "torch_zip":
        torch.save(evil, path)
    else:
        path.write_bytes(pickle.dumps(evil, protocol=2))
    with pytest.raises(ValueError, match="contains pickled objects") as info:
        load_bundle(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


def _break(directory: Path, name: str) -> Path:
    path = directory / name
    if name == "model.safetensors":
        path.write_bytes(path.read_bytes()[:100])
    elif name == "config.json":
        path.write_text('{"format": "vitattn-bundle", ')
    else:
        path.unlink()
    return path


BROKEN_FILE_ERRORS = {  # what load_bundle says when this file is cut short (or, for vocab.json, missing)
    "model.safetensors": (ValueError, "cannot be loaded into the model of"),
    "config.json": (ValueError, "is not valid JSON"),
    "vocab.json": (FileNotFoundError, "vocabulary file not found"),
}


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "vocab.json"])
def test_load_bundle_names_a_corrupt_or_missing_file(tmp_path, captioner_and_vocab, name):
    model, vocab = captioner_and_vocab
    directory = save_bundle(tmp_path / "b", model, task="caption", preprocess=PREPROCESS, vocab=vocab)
    bad = _break(directory, name)
    error, message = BROKEN_FILE_ERRORS[name]
    with pytest.raises(error, match=message) as info:
        load_bundle(directory)
    assert str(bad) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("content", [b"", b"junk", b"not a checkpoint at all", b"PK\x03\x04truncated zip"])
def test_load_bundle_names_an_unreadable_checkpoint(tmp_path, content):
    path = tmp_path / "broken.ckpt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a (readable )?PyTorch checkpoint") as info:
        load_bundle(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_load_bundle_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^model not found: .*nowhere \(expected a bundle folder"):
        load_bundle(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="neither a bundle"):
        load_bundle(tmp_path)


def test_save_bundle_replaces_a_bundle_but_not_other_folders(tmp_path, captioner_and_vocab):
    model, vocab = captioner_and_vocab
    save_bundle(tmp_path / "b", model, task="caption", preprocess=PREPROCESS, vocab=vocab)
    other = tiny_captioner(vocab)
    save_bundle(tmp_path / "b", other, task="caption", preprocess=PREPROCESS, vocab=vocab)
    torch.testing.assert_close(load_bundle(tmp_path / "b").model.state_dict(), other.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a vitattn bundle"):
        save_bundle(tmp_path / "docs", model, task="caption", preprocess=PREPROCESS, vocab=vocab)
    assert (tmp_path / "docs" / "notes.txt").read_text() == "keep me"


def test_save_bundle_checks_its_arguments(tmp_path, captioner_and_vocab):
    model, vocab = captioner_and_vocab
    with pytest.raises(ValueError, match=r"task='caption' needs vocab=Vocabulary\(...\)"):
        save_bundle(tmp_path / "b", model, task="caption", preprocess=PREPROCESS)
    with pytest.raises(ValueError, match="vocab has 5 tokens but the decoder's vocab_size=14"):
        save_bundle(tmp_path / "b", model, task="caption", preprocess=PREPROCESS, vocab=Vocabulary(["x"]))
    with pytest.raises(ValueError, match="has no \\['crop_pct'\\]"):
        save_bundle(
            tmp_path / "b",
            model,
            task="caption",
            preprocess={k: v for k, v in PREPROCESS.items() if k != "crop_pct"},
            vocab=vocab,
        )
    with pytest.raises(ValueError, match="task='detect' is unknown"):
        save_bundle(tmp_path / "b", model, task="detect", preprocess=PREPROCESS, vocab=vocab)
    assert not (tmp_path / "b").exists()


def test_bundle_from_system_uses_the_system_settings(tmp_path, captioner_and_vocab):
    model, vocab = captioner_and_vocab
    system = SimpleNamespace(
        model=model,
        task="caption",
        vocab=vocab,
        generate_kwargs={"num_beams": 2},
        hparams={"model_config": model.config, "vocab": WORDS, "preprocess": PREPROCESS},
    )
    bundle = load_bundle(bundle_from_system(system, tmp_path / "bundle"))
    assert bundle.generate == {"num_beams": 2} and bundle.preprocess == PREPROCESS and bundle.vocab == vocab


def test_eval_transform_follows_preprocess():
    image = Image.new("RGB", (64, 32), (255, 255, 255))
    center = eval_transform({**PREPROCESS, "crop_mode": None, "crop_pct": 0.875})
    x = center(image)
    assert x.shape == (3, 32, 32)
    torch.testing.assert_close(x, torch.ones(3, 32, 32))  # (1 - 0.5) / 0.5
