"""The weights' own preprocessing: a run that starts from pretrained weights normalises, resizes and crops as
they were trained (timm's ``resolve_model_data_config``; a vitattn model's own ``preprocess``), in every
split, the bundle and the ONNX folder; ``data.*`` keys win; the run log says what was chosen and why.

The oracle is timm: ``create_transform(**resolve_model_data_config(model))`` and the timm model's features."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from timm.data import create_transform, resolve_model_data_config
from timm.models import get_pretrained_cfg
from torchvision import transforms as T

from tests.helpers.bundles import CAPTION_PREPROCESS, make_caption_bundle
from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn.bundle import load_bundle, save_bundle
from vitattn.cli.run_split import datamodule_from_run
from vitattn.data.preprocess import Normalize, eval_transform, from_timm
from vitattn.errors import ConfigError
from vitattn.models import VisionTransformer
from vitattn.run_dir import RunDir
from vitattn.training import train
from vitattn.training.build import build_datamodule
from vitattn.training.plan import resolve
from vitattn.training.start_weights import log_preprocess

# Each family's weights as the issue names them, and a small model of the same family and preprocessing that the
# fast tests load from a file (NAME@FILE), with the model keys that fit it.
FAMILIES = {
    "augreg": (
        "vit_base_patch16_224.augreg2_in21k_ft_in1k",
        "vit_tiny_patch16_224.augreg_in21k_ft_in1k",
        ["model=tiny"],
    ),
    "deit": ("deit_small_patch16_224.fb_in1k", "deit_tiny_patch16_224.fb_in1k", ["model=tiny"]),
    "clip": (
        "vit_base_patch16_clip_224.openai",
        "vit_xsmall_patch16_clip_224.tinyclip_yfcc15m",
        ["model.embed_dim=256", "model.depth=10", "model.num_heads=4", "model.mlp_ratio=4.0"],
    ),
}
NAMED_MODELS = {"augreg": ["model=base"], "deit": ["model=small"], "clip": ["model=base"]}
SIZES = [(160, 120), (224, 224), (333, 500)]  # (width, height): landscape, square, portrait
QUIET = [
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "logger=csv",
    "num_threads=null",
]
LOG = "preprocessing: "


def _images(folder: Path) -> list[Path]:
    """Noise images of every size in ``folder`` (noise: any resampling difference shows)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for width, height in SIZES:
        paths.append(folder / f"{width}x{height}.png")
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(paths[-1])
    return paths


def _image_folder(root: Path) -> Path:
    for split in ("train", "val"):
        for name in ("cat", "dog"):
            _images(root / split / name)
    return root


def _max_difference(ours, theirs, paths: list[Path]) -> float:
    images = [Image.open(p).convert("RGB") for p in paths]
    return max(float((ours(im) - theirs(im)).abs().max()) for im in images)


def _weights_file(name: str, folder: Path) -> Path:
    """A randomly initialised ``name`` saved as a local file: what ``NAME@FILE`` loads, without the network."""
    file = folder / f"{name}.safetensors"
    save_file(timm.create_model(name, pretrained=False).state_dict(), file)
    return file


def _timm_reference(name: str, file: Path) -> tuple[torch.nn.Module, object]:
    """timm's model of ``name`` with ``file``'s weights, and its evaluation transform."""
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(file))).eval()
    return model, create_transform(**resolve_model_data_config(model))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _logged(run) -> list[str]:
    """The log lines of ``run()``, at INFO."""
    handler, root = _Lines(), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        run()
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return handler.lines


def _train_from_timm(name: str, model: list[str], tmp: Path, extra: list[str] = ()) -> dict:
    """A classifier trained one step from ``name``@FILE on image files, its encoder frozen (so the bundle's encoder
    holds the file's weights): the run's bundle, its data, timm's model and transform, and the run's log."""
    file = _weights_file(name, tmp)
    root = _image_folder(tmp / "images")
    overrides = [
        *QUIET,
        "head=classification",
        "data=imagefolder",
        f"data.root={root}",
        "data.img_size=224",
        "data.batch_size=6",
        "data.cache=none",
        "data.num_workers=0",
        *model,
        "trainer.fast_dev_run=true",
        "finetune.freeze_encoder_epochs=1",
        f"finetune.init={name}@{file}",
        "finetune.init_kind=encoder",
        *extra,
    ]
    result = {}
    lines = _logged(lambda: result.update(run=train(compose_train(overrides, tmp / "run"))))
    reference, transform = _timm_reference(name, file)
    return dict(
        bundle=load_bundle(result["run"].bundle_dir),
        datamodule=result["run"].system.trainer.datamodule,  # the run's own data
        run_dir=result["run"].run_dir,
        images=sorted((root / "val").rglob("*.png")),
        reference=reference,
        transform=transform,
        lines=lines,
    )


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def timm_run(request, tmp_path_factory):
    family = request.param
    _, small, model = FAMILIES[family]
    return {"family": family, **_train_from_timm(small, model, tmp_path_factory.mktemp(family))}


def test_timms_preprocessing_of_each_named_family_is_timms_transform(tmp_path):
    """The issue's AugReg, DeiT and CLIP weights (their configs; no weights read): ``from_timm`` of timm's data
    config gives timm's own transform, and the small models the other tests load share those configs."""
    paths = _images(tmp_path)
    for family, (named, small, _) in FAMILIES.items():
        configs = []
        for name in (named, small):
            with torch.device("meta"):
                model = timm.create_model(name)
            configs.append(resolve_model_data_config(model))
            ours = eval_transform({**from_timm(configs[-1]), "img_size": 224})
            assert _max_difference(ours, create_transform(**configs[-1]), paths) <= 1e-6, name
        assert configs[0] == configs[1], family


def test_the_bundle_and_every_split_preprocess_as_timm_does(timm_run):
    bundle, theirs, paths = timm_run["bundle"], timm_run["transform"], timm_run["images"]
    assert _max_difference(bundle.transform, theirs, paths) <= 1e-6
    datamodule = timm_run["datamodule"]
    for dataset in (datamodule.val_dataset, datamodule.test_dataset):  # uint8, normalised on the device
        ours = T.Compose([dataset.transform, datamodule.normalize])
        assert _max_difference(ours, theirs, paths) <= 1e-6
    training = datamodule.train_dataset.transform.transforms  # crop, flip, to a uint8 tensor
    config = resolve_model_data_config(timm_run["reference"])
    assert training[0].interpolation.value == config["interpolation"]
    normalize = datamodule.normalize
    assert isinstance(normalize, Normalize)
    torch.testing.assert_close(normalize.mean.flatten(), torch.tensor(config["mean"]), rtol=0, atol=1e-7)
    torch.testing.assert_close(normalize.std.flatten(), torch.tensor(config["std"]), rtol=0, atol=1e-7)


def test_the_saved_config_is_the_resolved_one_that_ran(timm_run):
    """The run folder's config holds the preprocessing the run was checked and built with (the weights', resolved
    into the null data.* keys first), so what evaluation or a resume rebuilds from it is what trained."""
    saved = RunDir(timm_run["run_dir"]).load_config().data
    config = resolve_model_data_config(timm_run["reference"])
    ran = timm_run["datamodule"].preprocess
    assert list(saved.mean) == list(ran["mean"]) == list(config["mean"])
    assert list(saved.std) == list(ran["std"]) == list(config["std"])
    assert saved.interpolation == ran["interpolation"] == config["interpolation"]
    assert saved.crop_pct == ran["crop_pct"] == config["crop_pct"]


def test_the_encoders_features_on_the_bundles_transform_are_timms(timm_run):
    bundle, reference, paths = timm_run["bundle"], timm_run["reference"], timm_run["images"]
    images = [Image.open(p).convert("RGB") for p in paths]
    ours = torch.stack([bundle.transform(im) for im in images])
    theirs = torch.stack([timm_run["transform"](im) for im in images])
    with torch.no_grad():
        features = bundle.model.forward_features(ours)
        expected = reference.forward_features(theirs)
    torch.testing.assert_close(features, expected, rtol=0, atol=1e-4)


def test_the_run_logs_the_choice_once_naming_timms_config(timm_run):
    lines = [line for line in timm_run["lines"] if line.startswith(LOG)]
    name = FAMILIES[timm_run["family"]][1]
    config = resolve_model_data_config(timm_run["reference"])
    assert len(lines) == 1, timm_run["lines"]
    assert lines[0].endswith(f": the pretrained weights' own, from timm's pretrained config of {name}"), lines[0]
    named = {"augreg": "[Inception 0.5]", "deit": "[ImageNet]", "clip": "[OpenAI CLIP]"}[timm_run["family"]]
    assert named in lines[0] and f"crop_mode center crop_pct {config['crop_pct']:g}, 224 px" in lines[0]


@pytest.mark.parametrize("timm_run", ["augreg"], indirect=True)  # one family: the folder copies the bundle's
def test_the_onnx_folder_preprocesses_as_timm_does(timm_run, tmp_path):
    from vitattn.bundle import load_model
    from vitattn.bundle.onnx_export import export_onnx

    folder = export_onnx(timm_run["bundle"], tmp_path / "onnx")
    onnx = load_model(folder)  # what vitattn-serve, vitattn-caption and vitattn-eval load
    assert json.loads((folder / "onnx.json").read_text())["preprocess"] == timm_run["bundle"].preprocess
    assert _max_difference(onnx.transform, timm_run["transform"], timm_run["images"]) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_named_weights_train_with_timms_preprocessing_and_features(family, tmp_path):
    named, _, _ = FAMILIES[family]
    run = _train_from_timm(named, NAMED_MODELS[family], tmp_path)
    assert _max_difference(run["bundle"].transform, run["transform"], run["images"]) <= 1e-6
    images = [Image.open(p).convert("RGB") for p in run["images"]]
    with torch.no_grad():
        features = run["bundle"].model.forward_features(torch.stack([run["bundle"].transform(im) for im in images]))
        expected = run["reference"].forward_features(torch.stack([run["transform"](im) for im in images]))
    torch.testing.assert_close(features, expected, rtol=0, atol=1e-4)


def _datamodule(overrides: list[str], tmp_path: Path, source=None):
    """The run's data built from its resolved config: the preprocessing of ``source`` (an encoder) written into
    ``data.*`` first, as ``train`` does. Returns it and the log lines of the resolution."""
    start = [f"finetune.init={source}", "finetune.init_kind=encoder"] if source is not None else []
    # the model sizes of the weights: TINY's for the tiny timm file, timm's vit_tiny for the named weights
    tiny = [o for o in TINY if not o.startswith("model.")] + ["model=tiny"] if "vit_tiny" in str(source) else TINY
    plan = resolve(compose_train([*tiny, *overrides, *start], tmp_path / "run"))
    datamodule = build_datamodule(plan)
    lines = _logged(lambda: log_preprocess(datamodule, plan.preprocess_from))
    return datamodule, [line for line in lines if line.startswith(LOG)]


def _choose(overrides: list[str], tmp_path: Path, source) -> tuple[dict, list[str], object]:
    datamodule, lines = _datamodule(overrides, tmp_path, source)
    return datamodule.preprocess, lines, datamodule


def _tiny_timm_file(tmp_path: Path) -> Path:
    shape = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)  # tests.helpers.TINY
    model = timm.create_model("vit_base_patch16_224", **shape)
    save_file(model.state_dict(), tmp_path / "vit.safetensors")
    return tmp_path / "vit.safetensors"


def test_a_bare_file_keeps_the_datas_preprocessing_and_says_so(tmp_path):
    folder = ["head=classification", "data=imagefolder", f"data.root={tmp_path}"]
    default = _datamodule(folder, tmp_path)[0].preprocess
    chosen, lines, _ = _choose(folder, tmp_path, _tiny_timm_file(tmp_path))
    assert chosen == default and chosen["mean"] == [0.485, 0.456, 0.406]
    assert len(lines) == 1
    assert "the data's own, ImageNet's mean and std: " in lines[0]
    assert "vit.safetensors is a bare weights file whose family cannot be known" in lines[0]
    assert lines[0].endswith("if its weights were trained with others, set data.mean=[...] data.std=[...]")


def test_a_bare_run_says_once_that_the_family_cannot_be_known(tmp_path):
    file = _tiny_timm_file(tmp_path)
    overrides = [*TINY, *TINY_SHAPES, *QUIET[:2], "trainer.fast_dev_run=true", f"finetune.init={file}"]
    overrides.append("finetune.init_kind=encoder")
    lines = _logged(lambda: train(compose_train(overrides, tmp_path / "run")))
    assert sum("family cannot be known" in line for line in lines) == 1, lines


def test_a_file_in_timms_hub_layout_has_the_preprocessing_of_its_config(tmp_path):
    name = "vit_base_patch16_224.augreg2_in21k_ft_in1k"
    file = _tiny_timm_file(tmp_path)
    config = {"architecture": name.split(".")[0], "pretrained_cfg": get_pretrained_cfg(name).to_dict()}
    (tmp_path / "config.json").write_text(json.dumps(config))
    folder = ["head=classification", "data=imagefolder", f"data.root={tmp_path}"]
    chosen, lines, _ = _choose(folder, tmp_path, file)
    assert (chosen["mean"], chosen["std"], chosen["crop_pct"], chosen["crop_mode"]) == (
        [0.5] * 3,
        [0.5] * 3,
        0.9,
        "center",
    )
    assert lines[0].endswith(f"from timm's pretrained config of {name} (the config.json beside vit.safetensors)")


def test_a_vitattn_source_brings_its_own_preprocessing(tmp_path):
    own = dict(img_size=64, crop_pct=1.0, crop_mode="squash", interpolation="bilinear", mean=[0.5] * 3, std=[0.25] * 3)
    model = VisionTransformer(
        img_size=64, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=2
    )
    bundle = save_bundle(tmp_path / "bundle", model, task="classification", preprocess=own)
    root = _image_folder(tmp_path / "images")
    chosen, lines, datamodule = _choose(
        ["head=classification", "data=imagefolder", f"data.root={root}"], tmp_path, bundle
    )
    assert chosen == {**own, "img_size": 32}  # the image size is the run's
    assert lines == [
        "preprocessing: mean (0.5, 0.5, 0.5) std (0.25, 0.25, 0.25), bilinear, crop_mode squash crop_pct 1, 32 px: "
        f"the pretrained weights' own, from the vitattn classification model {bundle}"
    ]
    datamodule.setup("fit")
    ours = T.Compose([datamodule.val_dataset.transform, datamodule.normalize])
    assert _max_difference(ours, eval_transform(chosen), _images(tmp_path / "x")) == 0


def test_data_keys_win_over_the_weights_and_the_log_says_which(tmp_path):
    name = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    file = _weights_file(name, tmp_path)
    overrides = ["data.mean=[0.1,0.2,0.3]", "data.std=[0.3,0.3,0.3]", "data.crop_mode=squash"]
    folder = ["head=classification", "data=imagefolder", f"data.root={tmp_path}", *overrides]
    chosen, lines, _ = _choose(folder, tmp_path, f"{name}@{file}")
    assert chosen == dict(
        img_size=32, crop_pct=0.9, crop_mode="squash", interpolation="bicubic", mean=[0.1, 0.2, 0.3], std=[0.3] * 3
    )
    assert lines[0].endswith(
        ": data.mean, data.std, data.crop_mode: from the config; "
        f"the rest: the pretrained weights' own, from timm's pretrained config of {name}"
    ), lines[0]


def test_the_shapes_data_takes_the_weights_mean_and_std_and_keeps_its_whole_images(tmp_path):
    name = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    file = _weights_file(name, tmp_path)
    chosen, lines, datamodule = _choose(["head=classification", *TINY_SHAPES], tmp_path, f"{name}@{file}")
    assert (chosen["mean"], chosen["std"], chosen["crop_mode"], chosen["crop_pct"]) == (
        [0.5] * 3,
        [0.5] * 3,
        "squash",
        1.0,
    )
    assert lines[0].endswith(
        f": mean, std: the pretrained weights' own, from timm's pretrained config of {name}; the rest: the data's own"
    )
    datamodule.setup("fit")
    dataset = datamodule.val_dataset
    pixels = dataset.image(0).float() / 255  # (3, height, width) in [0, 1]
    torch.testing.assert_close(datamodule.normalize(dataset[0][0]), (pixels - 0.5) / 0.5)  # uint8, normalised


def test_the_run_data_that_evaluation_rebuilds_takes_the_models_preprocessing(tmp_path):
    cfg = compose_train([*TINY, *TINY_SHAPES], tmp_path / "run")
    RunDir(tmp_path / "run").save_config(cfg)  # a run trained from weights with mean = std = 0.5
    model = dict(img_size=32, crop_pct=1.0, crop_mode="squash", interpolation="bicubic", mean=[0.5] * 3, std=[0.5] * 3)
    datamodule = datamodule_from_run(RunDir(tmp_path / "run"), preprocess=model)
    assert datamodule.preprocess == model


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.mean=[0.5,0.5]", r"^data\.mean=\[0\.5, 0\.5\] must be 3 finite numbers$"),
        ("data.std=[0.5,0,0.5]", r"^data\.std=\[0\.5, 0\.0, 0\.5\] must be positive$"),
        (
            "data.crop_mode=middle",
            r"^data\.crop_mode='middle' is unknown; choose one of \['center', 'squash', 'border'\]$",
        ),
        ("data.crop_pct=2", r"^data\.crop_pct=2 must be a number from 0\.1 to 1"),
        ("data.interpolation=cubic", r"^data\.interpolation='cubic' is unknown; try bicubic$"),
    ],
)
def test_a_bad_data_preprocessing_key_is_one_line_from_the_datamodule_before_any_data_is_read(
    override, message, tmp_path
):
    overrides = [*TINY, "head=classification", "data=imagefolder", f"data.root={tmp_path}", override]
    plan = resolve(compose_train(overrides, tmp_path / "run"))  # an empty root: reading it would fail otherwise
    with pytest.raises(ConfigError, match=message):
        build_datamodule(plan)


def test_a_whole_start_model_brings_the_preprocessing_the_data_takes(tmp_path):
    """finetune.init=BUNDLE (a whole model): the mean and std the shapes data takes (its ``weights_keys``) come from
    the bundle, written into the config that is checked and saved; a ``data.*`` key given wins."""
    bundle = make_caption_bundle(tmp_path / "bundle", {**CAPTION_PREPROCESS, "mean": [0.25] * 3, "std": [0.75] * 3})
    plan = resolve(compose_train([*TINY, f"finetune.init={bundle}"], tmp_path / "run"))
    assert (list(plan.cfg.data.mean), list(plan.cfg.data.std)) == ([0.25] * 3, [0.75] * 3)
    assert plan.preprocess_from == (
        f"mean, std: the pretrained weights' own, from finetune.init={bundle}; the rest: the data's own"
    )
    plan = resolve(compose_train([*TINY, f"finetune.init={bundle}", "data.std=[0.1,0.2,0.3]"], tmp_path / "run"))
    assert (list(plan.cfg.data.mean), list(plan.cfg.data.std)) == ([0.25] * 3, [0.1, 0.2, 0.3])
    assert plan.preprocess_from.startswith("data.std: from the config; mean: the pretrained weights' own")
