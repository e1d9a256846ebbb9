"""Learning from small data: schedules that end at the run's limit, augmentation, cache, EMA, early stopping."""

import csv
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.images import make_image_folder
from tests.helpers.runs import TINY, TINY_SHAPES, compose_train, metrics_with_weights
from vitattn.data.images import should_cache
from vitattn.data.preprocess import (
    Augment,
    CaptionAugment,
    auto_min_scale,
    classification_train_transform,
    default_preprocess,
    eval_transform,
)
from vitattn.training import train
from vitattn.training.datamodules import ImageFolderDataModule
from vitattn.training.systems.base import WarmupCosine

CLS = ["head=classification", *TINY, *TINY_SHAPES, "test=false", "export_bundle=false", "num_threads=1"]


def test_warmup_cosine_reaches_its_floor_at_the_horizon_and_follows_a_moved_one():
    schedule = WarmupCosine(total_steps=1000, warmup_steps=50, min_lr_ratio=0.01)
    assert schedule(0) == pytest.approx(1e-3) and schedule(50) == pytest.approx(1.0)
    assert schedule(1000) == pytest.approx(0.01) and schedule(525) == pytest.approx(0.505)
    schedule.total_steps = 500  # a shorter budget than first thought: the floor comes sooner
    assert schedule(500) == pytest.approx(0.01) and schedule(275) == pytest.approx(0.505)
    assert WarmupCosine(total_steps=100, warmup_steps=50, min_lr_ratio=0.0).warmup_steps == 10  # capped at 1/10
    assert WarmupCosine(total_steps=938, warmup_steps="auto", min_lr_ratio=0.0).warmup_steps == 93  # a tenth
    assert WarmupCosine(total_steps=10_000, warmup_steps="auto", min_lr_ratio=0.0).warmup_steps == 200


def _final_lr_ratio(result) -> tuple[float, int]:
    trainer_lr = result.system.trainer.lr_scheduler_configs[0].scheduler
    schedule = trainer_lr.lr_lambdas[0]
    return schedule(result.global_step), schedule.total_steps


@pytest.mark.parametrize(
    "limits,steps",
    [
        (["trainer.max_steps=12", "trainer.max_epochs=100"], 12),  # max_steps ends training first
        (["trainer.max_steps=1000", "trainer.max_epochs=2"], 16),  # 2 epochs of 8 batches end it first
    ],
)
def test_the_limit_that_ends_training_is_the_schedule_horizon(limits, steps, tmp_path):
    result = train(compose_train([*CLS, *limits, "trainer.check_val_every_n_epoch=1000"], tmp_path))
    ratio, horizon = _final_lr_ratio(result)
    assert result.global_step == steps and horizon == steps and ratio == pytest.approx(0.01)


@pytest.mark.parametrize(
    "overrides,peak",
    [
        (["head=caption"], 2e-3),
        (["head=classification"], 1e-3),
        (["head=classification", "optim.lr=5e-4"], 5e-4),  # given: the head's recipe does not override it
    ],
)
def test_each_head_trains_at_its_recipes_peak_rate_unless_optim_lr_is_given(overrides, peak, tmp_path):
    base = [*TINY, *TINY_SHAPES, "test=false", "export_bundle=false", "trainer.max_steps=1"]
    result = train(compose_train([*base, *overrides, "trainer.check_val_every_n_epoch=1000"], tmp_path))
    groups = result.system.trainer.optimizers[0].param_groups
    assert len(groups) >= 2 and [g["initial_lr"] for g in groups] == pytest.approx([peak] * len(groups))


@pytest.mark.slow  # twelve seconds of training
def test_a_time_budget_anneals_the_learning_rate_to_its_floor_by_the_deadline(tmp_path):
    from lightning.pytorch.callbacks import Timer

    overrides = [
        *CLS,
        "trainer.max_steps=-1",
        "trainer.max_epochs=-1",
        "trainer.max_time=00:00:00:12",
        "data.num_train=64",
        "optim.warmup_steps=5",
        "trainer.check_val_every_n_epoch=1000",
    ]
    result = train(compose_train(overrides, tmp_path))
    timer = next(c for c in result.system.trainer.callbacks if isinstance(c, Timer))
    assert 1.0 <= timer.time_elapsed("train") / 12 < 1.5  # stopped at the budget, not long after it
    ratio, horizon = _final_lr_ratio(result)
    # The horizon was re-estimated from the step rate and the run stopped close to it: the learning
    # rate ends near its floor instead of at its peak (the schedule of an unbounded run).
    assert result.global_step > 20 and abs(horizon - result.global_step) <= 0.25 * result.global_step
    assert ratio < 0.15, (ratio, horizon, result.global_step)


def test_auto_crop_scale_is_mild_for_small_images_and_timm_like_for_large():
    assert auto_min_scale(32) == 0.5 and auto_min_scale(64) == 0.5 and auto_min_scale(224) == 0.08
    assert 0.08 < auto_min_scale(128) < 0.5
    assert Augment.from_config({"scale": [0.3, 1.0]}).crop_scale(32) == (0.3, 1.0)
    with pytest.raises(ValueError, match="unknown keys \\['flip'\\]"):
        Augment.from_config({"flip": 0.5})


def test_pad_crop_shifts_the_image_without_resampling_it():
    preprocess = default_preprocess(32)
    shift = classification_train_transform(32, Augment(crop="pad", hflip=0), preprocess)
    pixels = np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    # every output is a 32 px window of the image mirror-padded by 4 px: the same pixels, moved
    unpadded = eval_transform(preprocess, normalize=False)(image)[None].float()  # (1, 3, 32, 32), uint8 values
    padded = torch.nn.functional.pad(unpadded, (4, 4, 4, 4), mode="reflect")[0]
    windows = {(y, x): padded[:, y : y + 32, x : x + 32] for y in range(9) for x in range(9)}
    torch.manual_seed(0)
    seen = set()
    for _ in range(12):
        out = shift(image)
        matches = [k for k, w in windows.items() if torch.equal(out.float(), w)]
        assert matches, "the pad crop resampled the image"
        seen.add(matches[0])
    assert len(seen) > 3
    with pytest.raises(ValueError, match="data.augment.crop='zoom' is unknown"):
        Augment.from_config({"crop": "zoom"})


@pytest.mark.parametrize("auto_augment", ["rand-m9-mstd0.5-inc1", "trivialaugment", "augmix-m5-w3"])
def test_auto_augment_options_change_the_images(auto_augment):
    preprocess = default_preprocess(32)
    plain = classification_train_transform(32, Augment(scale=(1.0, 1.0), ratio=(1, 1), hflip=0), preprocess)
    strong = classification_train_transform(
        32, Augment(scale=(1.0, 1.0), ratio=(1, 1), hflip=0, auto_augment=auto_augment), preprocess
    )
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    torch.manual_seed(0)
    changed = sum(not torch.equal(plain(image), strong(image)) for _ in range(8))
    assert changed >= 4


def test_caption_augment_never_flips_or_recolours_what_captions_state():
    preprocess = default_preprocess(16)
    augment = CaptionAugment(16, Augment(scale=(1.0, 1.0), ratio=(1, 1), hflip=1.0, color_jitter=0.8), preprocess)
    pixels = np.zeros((16, 16, 3), dtype=np.uint8)
    pixels[:, :8] = (200, 40, 40)  # red on the left half
    image = Image.fromarray(pixels)
    plain = CaptionAugment(16, Augment(scale=(1.0, 1.0), ratio=(1, 1), hflip=0.0), preprocess)(image, ["x"])
    kept = augment(image, ["a red square on the left"])
    torch.testing.assert_close(kept, plain)  # neither flipped (left) nor jittered (red)
    flipped = augment(image, ["a square"])
    assert not torch.equal(flipped, plain)
    no_colour_change = augment(image, ["a blue square"])  # colour named: flipped, never jittered
    torch.testing.assert_close(no_colour_change, plain.flip(-1))


def test_caption_augment_adds_its_auto_augment_only_where_no_caption_names_a_colour():
    preprocess = default_preprocess(16)
    augment = Augment(scale=(1.0, 1.0), ratio=(1, 1), hflip=0.0, auto_augment="rand-m9-n3-mstd0")
    transform = CaptionAugment(16, augment, preprocess)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8))
    plain = torch.from_numpy(np.array(image)).permute(2, 0, 1)  # (3, 16, 16): the whole image, no operation
    random.seed(0), np.random.seed(0)
    assert any(not torch.equal(transform(image, ["a square"]), plain) for _ in range(8))  # RandAugment applied
    assert all(torch.equal(transform(image, ["a red square"]), plain) for _ in range(8))  # a colour named: never


def _folder_module(root, **kwargs):
    dm = ImageFolderDataModule(root, img_size=32, batch_size=4, augment=False, **kwargs)
    dm.setup("fit")
    return dm


def test_cache_gives_the_same_tensors_as_reading_the_files(tmp_path):
    folder = make_image_folder(tmp_path / "folder", per_class=3, size=70)
    cached, files = _folder_module(folder, cache="ram"), _folder_module(folder, cache="none")
    assert cached.cache is not None and len(cached.cache) == 12 and files.cache is None
    for i in range(len(files.val_dataset)):
        torch.testing.assert_close(cached.val_dataset[i][0], files.val_dataset[i][0], rtol=0, atol=0)
        torch.testing.assert_close(cached.train_dataset[i][0], files.train_dataset[i][0], rtol=0, atol=0)
    assert should_cache("auto", 4000, 36) and not should_cache("auto", 10**7, 256) and not should_cache("none", 1, 1)
    with pytest.raises(ValueError, match="data.cache='disk' is unknown"):
        ImageFolderDataModule(folder, cache="disk")


def test_cache_names_an_unreadable_file(tmp_path):
    folder = make_image_folder(tmp_path / "folder", per_class=2, size=20)
    (folder / "train" / "cat" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="broken.png: not an image"):
        _folder_module(folder, cache="ram")


def test_label_smoothing_and_mixup_change_the_training_loss():
    from vitattn.training.systems import ClassificationSystem

    config = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2, "num_classes": 3}
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0])
    losses = {}
    for name, kwargs in {"plain": {}, "smooth": {"label_smoothing": 0.3}, "mixup": {"mixup": 1.0}}.items():
        torch.manual_seed(0)
        system = ClassificationSystem(config, ["a", "b", "c"], **kwargs)
        system.log = lambda *a, **k: None  # no trainer attached
        losses[name] = float(system.training_step((images, labels), 0).detach())
    logits = ClassificationSystem(config, ["a", "b", "c"]).model  # same seed: same weights
    assert losses["smooth"] != losses["plain"] and losses["mixup"] != losses["plain"]
    assert all(math.isfinite(v) for v in losses.values()) and logits is not None


EMA_DECAY = 0.9
EMA_ON = [f"ema.decay={EMA_DECAY}"]  # the config key that turns the EMA on


def _independent_ema(raw: list[dict[str, torch.Tensor]], decay: float) -> list[dict[str, torch.Tensor]]:
    """The EMA after each step, from the raw weights after each optimizer step: the first step's weights,
    then average <- d * average + (1 - d) * weights with d = min(decay, (1 + n) / (10 + n)) after n updates
    (timm's ModelEmaV3 warm-up)."""
    averages = [{k: v.clone() for k, v in raw[0].items()}]
    for n, weights in enumerate(raw[1:], start=1):
        d = min(decay, (1.0 + n) / (10.0 + n))
        averages.append({k: d * averages[-1][k] + (1.0 - d) * weights[k] for k in weights})
    return averages


class _EmaAsBefore:
    """The EMA update as it was, the oracle: ``AveragedModel``'s ``avg_fn``, one tensor at a time, with the
    count read back from the device."""

    def __init__(self, decay: float) -> None:
        self.decay = decay

    def __call__(self, averaged: torch.Tensor, current: torch.Tensor, num_averaged: torch.Tensor) -> torch.Tensor:
        n = float(num_averaged)
        d = min(self.decay, (1.0 + n) / (10.0 + n))
        return averaged + (current - averaged) * (1.0 - d)


def test_ema_foreach_update_equals_the_update_before_and_continues_after_a_resume():
    from torch.optim.swa_utils import AveragedModel

    from vitattn.models import VisionTransformer
    from vitattn.training.callbacks.ema import _WarmupEma

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3)
    decay = 0.8  # the warm-up (1 + n) / (10 + n) for 35 updates, then 0.8
    ours, before = _WarmupEma(model, decay), AveragedModel(model, avg_fn=_EmaAsBefore(decay), use_buffers=True)
    averages = [ours, before]
    for step in range(60):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.1)
        for ema in averages:
            ema.update_parameters(model)
        if step == 20:  # a checkpoint's average loaded into a fresh one, as WeightAveraging.on_load_checkpoint does
            resumed = _WarmupEma(model, decay)
            resumed.load_state_dict(ours.state_dict())
            averages.append(resumed)
    assert ours.num_averaged == int(ours.n_averaged) == int(before.n_averaged) == 60  # the count checkpoints hold
    for a, b, c in zip(ours.module.parameters(), before.module.parameters(), resumed.module.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(c, a, rtol=0, atol=0)


def test_ema_weights_are_validated_tested_and_exported(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import CSVLogger
    from safetensors.torch import load_file

    from vitattn.training.systems import ClassificationSystem

    raw = {}  # global step -> the weights the optimizer reached, before any averaging

    def record(self, outputs, batch, batch_idx):
        raw[self.global_step] = {k: v.detach().clone() for k, v in self.model.named_parameters()}

    monkeypatch.setattr(ClassificationSystem, "on_train_batch_end", record)
    run = [*CLS, *EMA_ON, "trainer.max_steps=6", "trainer.max_epochs=-1", "trainer.val_check_interval=3"]
    run += ["trainer.check_val_every_n_epoch=null", "test=true", "export_bundle=true", "weights=last"]
    run += ["optim.lr=3e-2", "optim.warmup_steps=1"]  # weights that move: the average lags them visibly
    result = train(compose_train(run, tmp_path))
    assert sorted(raw) == [1, 2, 3, 4, 5, 6]
    ema = dict(zip(sorted(raw), _independent_ema([raw[s] for s in sorted(raw)], EMA_DECAY)))
    assert max((ema[6][k] - raw[6][k]).abs().max() for k in raw[6]) > 1e-4  # the average is not the last weights

    exported = load_file(tmp_path / "bundle" / "model.safetensors")
    for key, value in ema[6].items():
        torch.testing.assert_close(exported[key], value, rtol=1e-5, atol=1e-6)

    logger = next(x for x in result.system.trainer.loggers if isinstance(x, CSVLogger))
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # The CSV's step column is zero-based: validation after global step 3 is logged at step 2.
    validated = {int(r["step"]) + 1: float(r["val/loss"]) for r in rows if r.get("val/loss")}
    (tested,) = [float(r["test/loss"]) for r in rows if r.get("test/loss")]
    assert sorted(validated) == [3, 6], validated
    datamodule = result.system.trainer.datamodule
    for step, logged in validated.items():
        assert logged == pytest.approx(
            metrics_with_weights(result.system, ema[step], datamodule, "val")["val/loss"], rel=1e-5
        )
        assert logged != pytest.approx(
            metrics_with_weights(result.system, raw[step], datamodule, "val")["val/loss"], rel=1e-3
        )
    assert tested == pytest.approx(
        metrics_with_weights(result.system, ema[6], datamodule, "test")["test/loss"], rel=1e-5
    )
    assert tested != pytest.approx(
        metrics_with_weights(result.system, raw[6], datamodule, "test")["test/loss"], rel=1e-3
    )


def test_early_stopping_ends_a_run_that_stops_improving(tmp_path):
    overrides = [*CLS, "trainer.max_epochs=30", "optim.lr=0.0", "early_stopping.patience=2"]
    result = train(compose_train(overrides, tmp_path))
    assert result.system.trainer.current_epoch < 10  # nothing learns at lr 0: stopped after 1 + 2 validations
    metrics = [json.loads(json.dumps(result.metrics))]
    assert "val/acc" in metrics[0]


def _warnings(overrides, tmp_path):
    from hydra.utils import instantiate

    from vitattn.training.build import check_fit
    from vitattn.training.plan import resolve

    plan = resolve(compose_train(overrides, tmp_path))
    datamodule = instantiate(plan.cfg.data)
    datamodule.setup("fit")
    return check_fit(plan, datamodule)


def test_startup_warns_when_the_config_fights_the_data(tmp_path, caplog):
    base = [*TINY, *TINY_SHAPES, "head=caption", "model.patch_size=4", "optim.warmup_steps=10", "trainer.max_epochs=-1"]
    assert _warnings([*base, "trainer.max_steps=400"], tmp_path) == []
    coarse = _warnings([*base, "model.patch_size=16", "trainer.max_steps=400"], tmp_path)
    assert len(coarse) == 1 and coarse[0].startswith("model.patch_size=16 cuts 32 px images into a 2x2 grid")
    assert "try model.patch_size=4" in coarse[0]
    endless = _warnings([*base, "trainer.max_epochs=-1", "trainer.max_steps=-1"], tmp_path)
    assert len(endless) == 1 and "the learning-rate schedule has no end" in endless[0]
    short = _warnings([*base, "trainer.max_steps=50", "optim.warmup_steps=200"], tmp_path)
    assert len(short) == 1 and "optim.warmup_steps=200 is more than a tenth of the 50-step run" in short[0]
    assert _warnings([*base, "trainer.max_steps=50", "optim.warmup_steps=auto"], tmp_path) == []  # the default
    timed = _warnings([*base, "trainer.max_epochs=-1", "trainer.max_time=00:00:05:00"], tmp_path)
    assert timed == []  # a time budget sets the horizon (TimeBudgetHorizon)


def test_startup_warns_when_most_caption_words_become_unk(tmp_path):
    from tests.helpers.datasets import make_coco

    coco = make_coco(tmp_path / "coco")
    data = ["data=coco", *[f"data.{k}={v}" for k, v in coco.items()], "data.img_size=32", "data.batch_size=4"]
    data += ["model.patch_size=4", "optim.warmup_steps=10", "trainer.max_epochs=-1"]
    assert _warnings([*TINY, "head=caption", *data, "data.min_word_freq=1", "trainer.max_steps=400"], tmp_path) == []
    rare = _warnings([*TINY, "head=caption", *data, "data.min_word_freq=1000", "trainer.max_steps=400"], tmp_path)
    assert len(rare) == 1 and rare[0].startswith("most training caption tokens become <unk> (100.0 %")
    assert "lower data.min_word_freq=1000" in rare[0]


def test_auto_workers_and_threads_never_oversubscribe_the_cores(tmp_path, monkeypatch):
    import os

    from hydra.utils import instantiate

    from vitattn.training.build import plan_cores
    from vitattn.training.plan import resolve

    folder = make_image_folder(tmp_path / "folder", per_class=2, size=20)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    before = torch.get_num_threads()
    try:
        for cache, workers in (("ram", 0), ("none", 1)):
            overrides = ["head=classification", "data=imagefolder", f"data.root={folder}", *TINY, f"data.cache={cache}"]
            cfg = compose_train([*overrides, "data.num_workers=auto", "num_threads=auto"], tmp_path)
            datamodule = instantiate(cfg.data)
            datamodule.setup("fit")
            assert plan_cores(resolve(cfg), datamodule) == (workers, 4 - workers)
        cfg = compose_train([*overrides, "data.num_workers=3", "num_threads=2"], tmp_path)
        datamodule = instantiate(cfg.data)
        datamodule.setup("fit")
        assert plan_cores(resolve(cfg), datamodule) == (3, 2)  # the user's numbers are kept
    finally:
        torch.set_num_threads(before)


def test_auto_min_word_freq_keeps_coco_threshold_unless_it_leaves_many_unknown_words():
    from collections import Counter

    from vitattn.data.tokenizer import Vocabulary, auto_min_freq

    common = Counter({f"w{i}": 100 for i in range(50)})
    assert auto_min_freq(common + Counter({"rare": 1})) == 5  # one rare word of 5,001 tokens: COCO's 5
    names = Counter({f"name{i}": 2 for i in range(40)}) + Counter({"a": 20})
    assert auto_min_freq(names) == 2  # most tokens are names seen twice: keep them
    assert auto_min_freq(Counter({f"n{i}": 1 for i in range(10)})) == 1
    vocab = Vocabulary.build(["a b c", "a b", "a"], min_freq="auto")
    assert vocab.words == ["a", "b", "c"]
    with pytest.raises(ValueError, match="min_freq=0 must be at least 1 or auto"):
        Vocabulary.build(["a"], min_freq=0)


def test_caption_crops_spare_small_images():
    from vitattn.data.preprocess import CAPTION_CROP_SCALE

    assert auto_min_scale(32, captions=True) == 1.0 and auto_min_scale(224, captions=True) == 0.5
    assert Augment(scale=CAPTION_CROP_SCALE).crop_scale(32) == (1.0, 1.0)
    assert Augment(scale=CAPTION_CROP_SCALE).crop_scale(384) == (0.5, 1.0)
