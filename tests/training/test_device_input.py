"""The GPU input path: every DataModule's loaders yield uint8 images, normalised where the batch lands
(``ImageDataModule.on_after_batch_transfer``) bit for bit as ``ToTensor`` and ``Normalize`` made them in the loader."""

from __future__ import annotations

from pathlib import Path

import hydra
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from torchvision import transforms as T
from torchvision.transforms.functional import pil_to_tensor

from tests.helpers.datasets import make_coco, make_karpathy
from tests.helpers.images import make_image_folder
from tests.helpers.runs import TINY, compose_train
from vitattn.data import eval_transform
from vitattn.data.preprocess import (
    CROP_MODES,
    Augment,
    CaptionAugment,
    Normalize,
    classification_train_transform,
    default_preprocess,
)
from vitattn.data.shapes import CLASS_NAMES
from vitattn.data.shards.writer import shapes_samples, write_shards
from vitattn.training.build import build_system
from vitattn.training.datamodules import (
    CocoCaptionDataModule,
    ImageFolderDataModule,
    KarpathyDataModule,
    ShapesDataModule,
    WebDatasetDataModule,
)
from vitattn.training.plan import resolve

STATISTICS = [
    (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
    ((0.5,) * 3, (0.5,) * 3),
    (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),
]


def _photos(n: int = 4, size: int = 32) -> list[Image.Image]:
    """Noisy RGB images, and one whose every channel takes every value 0..255 (where a rounding slip shows)."""
    rng = np.random.default_rng(0)
    ramp = (np.arange(size * size) % 256).astype(np.uint8).reshape(size, size)
    photos = [Image.fromarray(rng.integers(0, 256, (size, size + 8, 3), dtype=np.uint8)) for _ in range(n - 1)]
    return [Image.fromarray(np.stack([ramp, ramp.T, 255 - ramp], axis=-1)), *photos]


def _to_tensor_then_normalize(mean, std) -> T.Compose:
    """What the loaders' transforms ended with before: torchvision's ``ToTensor`` then ``Normalize``."""
    return T.Compose([T.ToTensor(), T.Normalize(mean, std)])


@pytest.mark.parametrize("mean, std", STATISTICS)
def test_normalize_of_a_uint8_batch_is_to_tensor_then_normalize_bit_for_bit(mean, std):
    photos = [photo.crop((0, 0, 32, 32)) for photo in _photos()]
    batch = torch.stack([pil_to_tensor(photo) for photo in photos])  # (B, 3, 32, 32) uint8, as a loader yields it
    expected = torch.stack([_to_tensor_then_normalize(mean, std)(photo) for photo in photos])
    got = Normalize(mean, std)(batch)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert torch.equal(Normalize(mean, std)(batch.float().div(255)), expected)  # float input: normalised only


@pytest.mark.gpu  # scripts/gpu_check.sh runs it
@pytest.mark.parametrize("mean, std", STATISTICS)
def test_normalize_on_cuda_is_bit_for_bit_the_cpu_loaders_normalisation(mean, std):
    """CUDA divides by a host scalar as a product with its reciprocal: ``Normalize`` divides by a device tensor."""
    batch = torch.stack([pil_to_tensor(photo.crop((0, 0, 32, 32))) for photo in _photos()])  # (B, 3, 32, 32) uint8
    expected = torch.stack([_to_tensor_then_normalize(mean, std)(photo.crop((0, 0, 32, 32))) for photo in _photos()])
    got = Normalize(mean, std)(batch.pin_memory().to("cuda", non_blocking=True))
    assert got.device.type == "cuda" and torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("crop_mode", CROP_MODES)
@pytest.mark.parametrize("mean, std", STATISTICS[:2])
def test_eval_transform_stops_at_uint8_and_normalize_finishes_it_as_inference_does(crop_mode, mean, std):
    preprocess = {**default_preprocess(32), "crop_mode": crop_mode, "crop_pct": 0.875, "mean": mean, "std": std}
    loaders, inference = eval_transform(preprocess, normalize=False), eval_transform(preprocess)
    for photo in _photos():
        pixels = loaders(photo)
        assert pixels.dtype == torch.uint8 and pixels.shape == (3, 32, 32)
        assert torch.equal(Normalize(mean, std)(pixels[None]), inference(photo)[None])


def test_training_transforms_yield_uint8_that_normalise_to_the_float_transforms():
    """The augmentations run on PIL images, before the tensor: with the same random draws, the uint8 path
    normalised equals the same steps ending in ToTensor and Normalize (composed by hand)."""
    preprocess = {**default_preprocess(32), "mean": list(OPENAI_CLIP_MEAN), "std": list(OPENAI_CLIP_STD)}
    normalize = Normalize(preprocess["mean"], preprocess["std"])
    old_end = _to_tensor_then_normalize(preprocess["mean"], preprocess["std"])
    strong = Augment(color_jitter=0.4, auto_augment="rand-m9-mstd0.5-inc1")
    for augment in (Augment(), Augment(crop="pad"), strong):
        new = classification_train_transform(32, augment, preprocess)
        old = T.Compose([*new.transforms[:-1], old_end])
        for seed, photo in enumerate(_photos()):
            pl.seed_everything(seed, verbose=False)  # torch, random and numpy: RandAugment draws from all
            pixels = new(photo)
            pl.seed_everything(seed, verbose=False)
            assert pixels.dtype == torch.uint8 and torch.equal(normalize(pixels), old(photo))
    captions = CaptionAugment(32, Augment(scale=(0.5, 1.0), hflip=0.5, color_jitter=0.4), preprocess)
    for seed, photo in enumerate(_photos()):
        pl.seed_everything(seed, verbose=False)
        pixels = captions(photo, ["a dog"])
        captions.finish, new_finish = old_end, captions.finish
        pl.seed_everything(seed, verbose=False)
        assert pixels.dtype == torch.uint8 and torch.equal(normalize(pixels), captions(photo, ["a dog"]))
        captions.finish = new_finish


# --- every DataModule ------------------------------------------------------------------------------------------


def _shards(root: Path) -> dict[str, str]:
    write_shards(shapes_samples("train", 10, img_size=32), root / "train", 6, class_names=CLASS_NAMES)
    write_shards(shapes_samples("val", 6, img_size=32), root / "val", 6, class_names=CLASS_NAMES)
    return {"train_shards": str(root / "train"), "val_shards": str(root / "val"), "count_cache": str(root / "c")}


DATAMODULES = {
    "shapes caption": lambda root: ShapesDataModule(img_size=32, num_train=8, num_val=6, num_test=6, batch_size=4),
    "shapes classification": lambda root: ShapesDataModule(
        task="classification", img_size=32, num_train=8, num_val=6, num_test=6, batch_size=4
    ),
    "imagefolder cached": lambda root: ImageFolderDataModule(
        make_image_folder(root), img_size=32, batch_size=4, cache="ram"
    ),
    "imagefolder files": lambda root: ImageFolderDataModule(
        make_image_folder(root), img_size=32, batch_size=4, cache="none"
    ),
    "coco": lambda root: CocoCaptionDataModule(**make_coco(root), img_size=32, batch_size=4, min_word_freq=1),
    "karpathy": lambda root: KarpathyDataModule(**make_karpathy(root), img_size=32, batch_size=4, num_workers=0),
    "webdataset caption": lambda root: WebDatasetDataModule(**_shards(root), img_size=32, batch_size=4, num_workers=0),
    "webdataset classification": lambda root: WebDatasetDataModule(
        **_shards(root), task="classification", img_size=32, batch_size=4, num_workers=0
    ),
}


def _images(batch) -> torch.Tensor:
    return batch["images"] if isinstance(batch, dict) else batch[0]


def _use_float_transforms(dm) -> None:
    """The evaluation datasets' transforms as they were: ending in ToTensor and Normalize (inference's transform)."""
    mean, std = dm.preprocess["mean"], dm.preprocess["std"]
    float_transform = eval_transform(dm.preprocess)
    for dataset in (dm.val_dataset, dm.test_dataset):
        inner = getattr(dataset, "dataset", dataset)  # TokenizedCaptions -> images
        if hasattr(inner, "samples") and hasattr(inner.samples, "transform"):  # a ShardStream
            inner.samples.transform = float_transform
        elif hasattr(inner, "scenes"):  # shapes: the generated uint8 image, scaled and normalised as before
            inner.transform = lambda image: Normalize(mean, std)(image.float().div_(255))
        else:
            inner.transform = float_transform


@pytest.mark.parametrize("name", sorted(DATAMODULES))
def test_every_datamodule_yields_uint8_batches_that_its_hook_normalises_as_the_float_loaders_did(name, tmp_path):
    dm = DATAMODULES[name](tmp_path)
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader()):
        batch = dm.on_before_batch_transfer(next(iter(loader)), 0)  # shards: the batch without its positions
        assert _images(batch).dtype == torch.uint8 and _images(batch).shape[1:] == (3, 32, 32)
        assert loader.pin_memory == torch.cuda.is_available()  # pinned for a non_blocking copy on CUDA
    uint8 = [dm.ready_batch(batch) for batch in dm.val_dataloader()]
    _use_float_transforms(dm)
    floats = [dm.on_before_batch_transfer(batch, 0) for batch in dm.val_dataloader()]
    assert len(uint8) == len(floats) > 0
    for new, old in zip(uint8, floats):
        assert _images(old).dtype == torch.float32 and torch.equal(_images(new), _images(old))
    with pytest.raises(TypeError, match="uint8 images, not torch.float32: normalised twice"):
        dm.normalize_batch(floats[0])


def test_evaluation_batches_of_the_built_in_data_are_normalised():
    dm = DATAMODULES["shapes classification"](None)
    dm.setup("fit")
    split = dm.evaluation_split("val")
    (images, labels), *_ = list(split.loader)
    assert len(split.loader) == 2 and len(split.loader.dataset) == 6
    expected = dm.normalize(next(iter(dm.val_dataloader()))[0])
    assert images.dtype == torch.float32 and torch.equal(images, expected)


# --- training: the same losses as the float loaders ---------------------------------------------------------------


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def _train_losses(overrides: list[str], root: Path, float_loaders: bool) -> list[float]:
    cfg = compose_train([*TINY, *overrides], root)
    pl.seed_everything(0)
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.setup("fit")
    if float_loaders:  # today's loaders by hand: float transforms in the datasets, nothing done after the transfer
        _use_float_transforms(datamodule)
        train = datamodule.train_dataset
        inner = getattr(train, "dataset", train)
        mean, std = datamodule.preprocess["mean"], datamodule.preprocess["std"]
        if hasattr(inner, "scenes"):
            inner.transform = lambda image: Normalize(mean, std)(image.float().div_(255))
        elif isinstance(inner.transform, CaptionAugment):
            inner.transform.finish = _to_tensor_then_normalize(mean, std)
        else:
            inner.transform = T.Compose([*inner.transform.transforms[:-1], _to_tensor_then_normalize(mean, std)])
        datamodule.on_after_batch_transfer = lambda batch, dataloader_idx: batch
    system = build_system(resolve(cfg), datamodule)
    losses = _Losses()
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[losses], **quiet
    )
    pl.seed_everything(0)
    trainer.fit(system, datamodule=datamodule)
    return losses.losses


RUNS = {
    "shapes classification, mixup and cutmix": [
        "head=classification",
        "data=shapes",
        "data.num_train=24",
        "head.mixup=0.8",
        "head.cutmix=1.0",
    ],
    "imagefolder, random crops and flips": ["head=classification", "data=imagefolder", "data.num_workers=0"],
    "coco captions, crops and colour jitter": [
        "data=coco",
        "data.num_workers=0",
        "data.min_word_freq=1",
        "data.augment.color_jitter=0.4",
    ],
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_training_losses_are_those_of_the_float_loaders(name, tmp_path):
    overrides = list(RUNS[name])
    if "data=imagefolder" in overrides:
        overrides.append(f"data.root={make_image_folder(tmp_path / 'data')}")
    elif "data=coco" in overrides:
        files = make_coco(tmp_path / "data")
        overrides += [f"data.{key}={value}" for key, value in files.items()]
    new = _train_losses(overrides, tmp_path / "uint8", float_loaders=False)
    old = _train_losses(overrides, tmp_path / "float", float_loaders=True)
    assert len(new) == 3 and new == old


def test_the_model_summary_sends_its_example_input_through_the_batch_hooks_unchanged(tmp_path):
    """The default run prints Lightning's model summary, whose forward pass of the system's float example input
    goes through the DataModule's batch hooks: it is no loader batch and passes as it is."""
    from tests.helpers.runs import TINY_SHAPES
    from vitattn.training import train

    run = [*TINY, *TINY_SHAPES, "trainer.enable_model_summary=true", "trainer.max_steps=1", "test=false"]
    result = train(compose_train([*run, "export_bundle=false"], tmp_path))
    assert result.global_step == 1
    datamodule = hydra.utils.instantiate(compose_train(TINY, tmp_path).data)
    for example in (torch.rand(2, 3, 32, 32), (torch.rand(2, 3, 32, 32), torch.zeros(2, 8, dtype=torch.long))):
        assert datamodule.on_after_batch_transfer(example, 0) is example  # a classifier's, a captioner's
