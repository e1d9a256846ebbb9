"""The composed config's user errors: each one line naming the key and the fix, found before any data is read
or any step runs; a saved config naming a target outside the allow-list is refused."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers.datasets import make_coco
from tests.helpers.images import make_image_folder
from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn.errors import ConfigError
from vitattn.run_dir import check_targets
from vitattn.training import train
from vitattn.training.plan import resolve

SHAPES = [*TINY, *TINY_SHAPES]
CLS = ["head=classification", *SHAPES]


def error_data(root: Path) -> dict:
    """The files the error cases name: an image folder, one with an empty class, COCO captions, wrong paths."""
    empty = make_image_folder(root / "empty", classes=("cat",), per_class=1)
    for image in (empty / "train" / "cat").iterdir():  # train/cat/ stays, without images
        image.unlink()
    coco = make_coco(root / "coco", num_train=2, num_val=2)
    return {
        "folder": make_image_folder(root / "folder", per_class=1),
        "empty": empty,
        "coco": " ".join(f"data.{k}={v}" for k, v in coco.items()),
        "ann_dir": root / "coco" / "images",  # a folder where a file belongs
        "missing": root / "missing.json",
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return error_data(tmp_path_factory.mktemp("data"))


# (overrides, what the error must say); {name} is filled from the `data` fixture; shapes data unless data= is given.
CONFIG_ERRORS = {
    "task": ("head.task=segment", r"^head\.task='segment' is unknown; choose head=caption or head=classification"),
    "warmup": (
        "optim.warmup_steps=soon",
        r"^optim\.warmup_steps='soon' must be a whole number of steps, or auto",
    ),
    "caption-on-imagefolder": (
        "data=imagefolder head=caption data.root={folder}",
        r"no captions for head=caption; use head=classification",
    ),
    "classification-on-coco": (
        "data=coco head=classification {coco}",
        r"no class labels for head=classification; use head=caption",
    ),
    "root-missing": ("data=imagefolder head=classification", r"^data\.root is required: add data\.root=PATH"),
    "root-not-found": (
        "data=imagefolder head=classification data.root=/no/such/dir",
        r"^data\.root=/no/such/dir does not exist",
    ),
    "annotations-not-found": (
        "data=coco {coco} data.train_annotations={missing}",
        r"^data\.train_annotations=.*missing\.json does not exist",
    ),
    "annotations-not-a-file": (
        "data=coco {coco} data.val_annotations={ann_dir}",
        r"^data\.val_annotations=.* is not a file",
    ),
    "empty-shapes": ("data.num_train=0", r"^data\.num_train=0 leaves that split empty; use 1 or more"),
    "resume-without-checkpoint": ("resume={folder}", r"^resume=.* has no checkpoints/last\.ckpt"),
    "ckpt-path-missing": ("ckpt_path=/no/such.ckpt", r"^ckpt_path=/no/such\.ckpt does not exist$"),
    "untrusted-target": ("data._target_=os.system", r"^data\._target_=os\.system is not allowed"),
    "unknown-target": (
        "data._target_=vitattn.data.NoSuchData",
        r"^data\._target_=vitattn\.data\.NoSuchData cannot be imported",
    ),
}


def _overrides(spec: str, data: dict) -> list[str]:
    given = spec.format(**data).split()
    base = SHAPES if not any(o.startswith("data=") for o in given) else TINY
    return [*base, *given]


@pytest.mark.parametrize("name", list(CONFIG_ERRORS))
def test_check_config_names_key_and_fix(name, data, tmp_path):
    spec, message = CONFIG_ERRORS[name]
    cfg = compose_train(_overrides(spec, data), tmp_path)
    with pytest.raises(ConfigError, match=message) as err:
        resolve(cfg)
    assert "\n" not in str(err.value)


def test_check_targets_refuses_a_saved_config_pointing_outside(tmp_path):
    cfg = compose_train(CLS, tmp_path)
    cfg.data._target_ = "os.system"
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match=r"^data\._target_=os\.system is not allowed"):
        check_targets(OmegaConf.load(tmp_path / "config.yaml"))
    cfg.data._target_ = "vitattn.training.datamodules.ShapesDataModule"
    cfg.callbacks.step_checkpoint._target_ = "builtins.exec"  # nested nodes too
    with pytest.raises(ConfigError, match=r"^callbacks\.step_checkpoint\._target_=builtins\.exec"):
        check_targets(cfg)


# Checked by their owners, the constructors (the model's shape, data.augment, data.bad_images, head.nonfinite), when
# train() builds the data and the system: one line naming the config key, before any step and before the run folder
# is written.
OWNER_ERRORS = {
    "encoder-heads": ("model.num_heads=3", r"^model\.num_heads=3 must divide model\.embed_dim=32"),
    "decoder-heads": (
        "head=caption head.decoder.num_heads=3",
        r"^head\.decoder\.num_heads=3 must divide head\.decoder\.embed_dim=32",
    ),
    "patch": ("data.img_size=36", r"^data\.img_size=36 must be divisible by model\.patch_size=8"),
    "pool": ("model.global_pool=max", r"^model\.global_pool='max' is unknown"),
    "activation": ("model.activation=swish", r"^model\.activation='swish' is unknown"),
    "decoder-activation": (
        "head=caption head.decoder.activation=swish",
        r"^head\.decoder\.activation='swish' is unknown",
    ),
    "sincos-width": (
        "model.embed_dim=34 model.num_heads=2",
        r"^model\.pos_embed_init=sincos needs embed_dim divisible by 4, not 34",
    ),
    "merge-too-large": (
        "head=classification model.merge_tokens=9",
        r"^model\.merge_tokens=9 is too large for 17 tokens: at most 8$",
    ),
    "merge-layer": (
        "head=caption model.merge_tokens=[4,9]",
        r"^model\.merge_tokens\[1\]=9 is out of range for the 13 tokens layer 1 receives: 0 to 6$",
    ),
    "merge-layers": (
        "head=coca model.merge_tokens=[4]",
        r"^model\.merge_tokens=\[4\] has 1 entries; the encoder has 2 layers$",
    ),
    "rerank-without-embeddings": (
        "head=caption head.generate.num_beams=3 head.generate.rerank=3",
        r"^head\.generate\.rerank=3 chooses among captions by image and text embeddings, which only a head=coca model",
    ),
    "generate-too-long": (
        "head=caption data.max_caption_len=8 head.generate.max_new_tokens=8",
        r"^head\.generate\.max_new_tokens=8 exceeds the decoder's max_len=8 - 1$",
    ),
    "nonfinite": ("head.nonfinite=ignore", r"^head\.nonfinite='ignore' is unknown; choose raise or skip"),
    "augment-crop": (
        "data=imagefolder head=classification data.root={folder} data.augment.crop=zoom",
        r"^data\.augment\.crop='zoom' is unknown; use one of \['resized', 'pad'\]",
    ),
    "augment-scale": (
        "data=imagefolder head=classification data.root={folder} data.augment.scale=[0.9,0.2]",
        r"^data\.augment\.scale=\[0\.9, 0\.2\] must satisfy 0 < min <= max <= 1",
    ),
    "bad-images": (
        "data=imagefolder head=classification data.root={folder} data.bad_images=ignore",
        r"^data\.bad_images='ignore' is unknown; choose raise or skip",
    ),
}


@pytest.mark.parametrize("name", list(OWNER_ERRORS))
def test_constructor_refusals_are_one_line_before_any_step(name, data, tmp_path):
    spec, message = OWNER_ERRORS[name]
    with pytest.raises(ConfigError, match=message) as err:
        train(compose_train(_overrides(spec, data), tmp_path / "run"))
    assert "\n" not in str(err.value) and not (tmp_path / "run" / "config.yaml").exists()
