"""Token merging (ToMe) as a load setting: a model trained without it runs with it (``merge_tokens`` of
``load_model``, ``Captioner.load``, ``Classifier.load``), bundles and run folders alike, while what the bundle
records (its ``config.json``, its model card) stays what it was trained with; an ONNX folder runs only the merge it
was exported with. The command lines: tests/cli/test_merge_tokens.py."""

import json
import shutil

import pytest
import torch

from tests.helpers.bundles import make_caption_bundle, make_classifier_bundle
from vitattn import Captioner, Classifier
from vitattn.bundle import load_bundle, load_model
from vitattn.bundle.card import model_card
from vitattn.bundle.folder import encoder_of
from vitattn.bundle.onnx_folder import ONNX_CONFIG_FILE
from vitattn.cli.export import main as export_main

TOKENS = 17  # the tiny bundles' 4 x 4 patches and the class token: at most 8 merged in the first layer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Task -> a run folder holding a tiny random model's ``bundle/``, trained without merging."""
    root = tmp_path_factory.mktemp("runs")
    make_caption_bundle(root / "caption" / "bundle")
    make_classifier_bundle(root / "classification" / "bundle")
    return {task: root / task for task in ("caption", "classification")}


def _outputs(loaded, images: torch.Tensor) -> torch.Tensor:
    """A classifier's (B, K) logits, or a captioner's (B, 4, V) teacher-forced logits of fixed captions."""
    with torch.no_grad():
        if loaded.task == "classification":
            return loaded.model(images)
        return loaded.model(images, torch.arange(4, 9).expand(images.shape[0], -1))


@pytest.mark.parametrize("task", ["caption", "classification"])
@pytest.mark.parametrize("where", ["bundle", "run"])
def test_a_model_trained_without_merging_runs_merged_when_loaded_with_merge_tokens(runs, task, where):
    path = runs[task] / "bundle" if where == "bundle" else runs[task]
    recorded = (runs[task] / "bundle" / "config.json").read_bytes()
    plain, merged = load_model(path), load_model(path, merge_tokens=5)
    assert (plain.merge_tokens, merged.merge_tokens) == (0, 5)
    encoder = encoder_of(merged.model)
    assert encoder.merge_schedule == [5, 5] and encoder_of(plain.model).merge_schedule == [0, 0]
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert encoder.forward_features(images).shape[1] == TOKENS - 10
    assert not torch.allclose(_outputs(merged, images), _outputs(plain, images), atol=1e-3)
    assert (runs[task] / "bundle" / "config.json").read_bytes() == recorded  # the bundle's record is left alone
    assert merged.config == plain.config and load_model(path).merge_tokens == 0


def test_captioner_and_classifier_load_with_merge_tokens(runs):
    """Both classes pass it to ``load_model``, a classifier of class names (zero-shot) too."""
    images = torch.randn(3, 3, 32, 32)
    captioner = Captioner.load(runs["caption"], merge_tokens=[6, 2])
    assert captioner.bundle.merge_tokens == [6, 2] and captioner.model.encoder.num_tokens == TOKENS - 8
    classifier = Classifier.load(runs["classification"], merge_tokens=4)
    assert classifier.bundle.merge_tokens == 4 and classifier.model.num_tokens == TOKENS - 8
    torch.testing.assert_close(
        classifier.model(images), _outputs(load_model(runs["classification"], merge_tokens=4), images)
    )
    labels = ["red", "blue", "green"]
    zero_shot, plain = (Classifier.load(runs["caption"], labels=labels, merge_tokens=m) for m in (8, None))
    assert (zero_shot.bundle.merge_tokens, plain.bundle.merge_tokens) == (8, 0)
    with torch.no_grad():
        assert not torch.allclose(zero_shot.model(images), plain.model(images), atol=1e-3)


def test_a_merge_too_large_for_the_tokens_is_refused_at_load_in_one_line(runs):
    with pytest.raises(ValueError) as err:
        Captioner.load(runs["caption"], merge_tokens=9)
    assert str(err.value) == "merge_tokens=9 is too large for 17 tokens: at most 8"
    with pytest.raises(ValueError) as err:
        Classifier.load(runs["classification"], merge_tokens=[8, 5])
    assert str(err.value) == "merge_tokens[1]=5 is out of range for the 9 tokens layer 1 receives: 0 to 4"


@pytest.mark.parametrize("task", ["caption", "classification"])
def test_an_onnx_folder_runs_only_the_merge_it_was_exported_with(runs, task, tmp_path):
    pytest.importorskip("onnxruntime", reason="the onnx extra: pip install -e '.[onnx]'")
    folder = tmp_path / "onnx"
    assert export_main([f"model={runs[task]}", f"out={folder}", "format=onnx"]) == 0
    assert load_model(folder).merge_tokens == 0 and load_model(folder, merge_tokens=0).merge_tokens == 0
    with pytest.raises(ValueError) as err:
        load_model(folder, merge_tokens=4)
    assert str(err.value) == (
        f"merge_tokens=4 but {folder} is an ONNX folder, whose graphs merge the merge_tokens=0 they were exported "
        "with; export it again with vitattn-export model=RUN format=onnx merge_tokens=4, or load the bundle or run "
        "folder"
    )
    config = json.loads((folder / ONNX_CONFIG_FILE).read_text())  # what a folder exported merged records
    del config["model"].get("encoder", config["model"])["merge_tokens"]
    (folder / ONNX_CONFIG_FILE).write_text(json.dumps(config))
    assert load_model(folder, merge_tokens=0).merge_tokens == 0  # a folder that records none merges none
    config["model"].get("encoder", config["model"])["merge_tokens"] = [4, 2]
    (folder / ONNX_CONFIG_FILE).write_text(json.dumps(config))
    assert load_model(folder, merge_tokens=(4, 2)).merge_tokens == [4, 2] == load_model(folder).merge_tokens
    with pytest.raises(ValueError, match=r"^merge_tokens=0 but .* merge the merge_tokens=\[4,2\] they were exported "):
        (Captioner if task == "caption" else Classifier).load(folder, merge_tokens=0)


def test_the_model_card_states_the_merge_the_model_was_trained_with(runs, tmp_path):
    card = model_card(load_model(runs["caption"], merge_tokens=4), "org/tiny", None).text
    assert "merge_tokens" not in card  # trained without: a merge to run with is not what it was trained with
    bundle = shutil.copytree(runs["caption"] / "bundle", tmp_path / "bundle")
    config = json.loads((bundle / "config.json").read_text())
    config["model"]["encoder"]["merge_tokens"] = [4, 2]  # as a run with model.merge_tokens=[4,2] writes it
    (bundle / "config.json").write_text(json.dumps(config))
    card = model_card(load_bundle(bundle), "org/tiny", None).text
    assert "\n- token merging (ToMe): trained with merge_tokens=[4,2]\n" in card
