"""The run's data, built and set up before any step: an empty split and a checkpoint that does not fit the
data (vocabulary, tokenizer, classes, head) are one-line errors, with nothing written."""

import math
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.images import make_image_folder
from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from tests.training.test_config import error_data
from vitattn.data.tokenizer import Vocabulary
from vitattn.errors import ConfigError
from vitattn.training import setup_data, train
from vitattn.training.build import build_datamodule, build_system
from vitattn.training.plan import resolve

SHAPES = [*TINY, *TINY_SHAPES]
CLS = ["head=classification", *SHAPES]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return error_data(tmp_path_factory.mktemp("data"))


def test_empty_image_folder_fails_before_any_step(data, tmp_path):
    cfg = compose_train(
        [*TINY, "data=imagefolder", "head=classification", f"data.root={data['empty']}", "data.num_workers=0"], tmp_path
    )
    with pytest.raises(ConfigError, match=r"^data\.root=.*empty: .*train.*expected ROOT/train/<class>/<image>") as err:
        train(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "config.yaml").exists()


def _fake_checkpoint(path: Path, **hparams) -> Path:
    """A checkpoint file carrying only the hyperparameters (what the pre-training checks read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": 3, "hyper_parameters": hparams}, path)
    return path


@pytest.mark.parametrize("how", ["resume", "ckpt_path"])
def test_vocabulary_differing_from_the_checkpoint_fails_before_any_step(how, tmp_path, monkeypatch):
    run = tmp_path / "run"
    trained = Vocabulary(["a", "red", "circle"])
    ckpt = _fake_checkpoint(run / "checkpoints" / "last.ckpt", vocab=trained.itos[4:], model_config={})
    trained.save(run / "vocab.json")
    other = Vocabulary(["a", "blue", "circle"])
    other.save(tmp_path / "other.json")
    load = f"resume={run}" if how == "resume" else f"ckpt_path={ckpt}"
    cfg = compose_train(["head=caption", *SHAPES, f"data.vocab_path={tmp_path / 'other.json'}", load], tmp_path / "out")
    pattern = (
        r"^data\.vocab_path: .*other\.json \(3 words\) differs .*'blue' vs 'red'.*"
        rf"data\.vocab_path={re.escape(str(run / 'vocab.json'))}$"
    )
    reads, torch_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: reads.append(str(f)) or torch_load(f, *a, **k))
    with pytest.raises(ConfigError, match=pattern):
        train(cfg)
    assert reads.count(str(ckpt)) == 1  # the plan reads the checkpoint once; the checks take what it read
    monkeypatch.setattr(torch, "load", torch_load)
    assert not (tmp_path / "out").exists()  # nothing written, no step run
    # the same vocabulary passes, and a checkpoint of the other head is refused
    matching = compose_train(["head=caption", *SHAPES, f"data.vocab_path={run / 'vocab.json'}", load], tmp_path / "out")
    plan = resolve(matching)
    setup_data(matching, build_datamodule(plan), plan.resume, plan.tokenizer_kind)
    cls_cfg = compose_train([*CLS, load], tmp_path / "out")
    plan = resolve(cls_cfg)
    with pytest.raises(ConfigError, match=r"was trained with head=caption, not head=classification; use head=caption"):
        setup_data(cls_cfg, build_datamodule(plan), plan.resume, plan.tokenizer_kind)


def test_class_list_differing_from_the_checkpoint_fails_before_any_step(tmp_path):
    root = make_image_folder(tmp_path / "folder", classes=("bird", "cat"), per_class=2)
    ckpt = tmp_path / "trained.ckpt"
    torch.save({"global_step": 0, "hyper_parameters": {"class_names": ["cat", "dog"]}}, ckpt)
    cfg = compose_train(
        ["head=classification", "data=imagefolder", f"data.root={root}", f"ckpt_path={ckpt}"], tmp_path / "run"
    )
    plan = resolve(cfg)
    dm = build_datamodule(plan)
    with pytest.raises(ConfigError, match=r"classes \['bird', 'cat'\] differ from the checkpoint's \['cat', 'dog'\]"):
        setup_data(cfg, dm, plan.resume)


def test_siglip_auto_bias_with_batches_by_patches_counts_the_images_of_a_full_length_batch(tmp_path):
    """``init_logit_bias=auto`` is -log(n - 1), n the images of a training step: with ``data.batch_patches=T`` a
    full-length batch's T // N images, not ``data.batch_size`` (which then sizes evaluation batches only)."""
    cfg = compose_train(
        ["head=coca", *SHAPES, "head.contrastive.loss=siglip", "data.batch_size=2"]
        + ["data.max_patches=16", "data.batch_patches=96"],
        tmp_path,
    )
    plan = resolve(cfg)
    datamodule = build_datamodule(plan)
    setup_data(cfg, datamodule)
    bias = build_system(plan, datamodule).model.logit_bias
    assert bias.item() == pytest.approx(-math.log(96 // 16 - 1))  # 6 images a step, one rank
