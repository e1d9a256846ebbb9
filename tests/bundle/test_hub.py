"""``hf-hub:`` names: parsed, read from a Hugging Face cache laid out as huggingface_hub lays it out, offline."""

import numpy as np
import pytest

from tests.helpers.bundles import make_caption_bundle, make_classifier_bundle, put_in_hub_cache
from vitattn import Captioner, Classifier
from vitattn.bundle.hub import parse_hub_name

IMAGES = [np.full((32, 32, 3), v, np.uint8) for v in (0, 90, 180, 255)]


@pytest.mark.parametrize(
    "name,expected",
    [("hf-hub:org/name", ("org/name", None)), ("hf-hub:org/my.model-1@v1.0", ("org/my.model-1", "v1.0"))],
)
def test_parse_hub_name_reads_the_repository_and_revision(name, expected):
    assert parse_hub_name(name) == expected


@pytest.mark.parametrize(
    "name", ["hf-hub:", "hf-hub:name", "hf-hub:a/b/c", "hf-hub:a/b@", "hf-hub:a/b@x@y", "hf-hub:/b"]
)
def test_a_malformed_hub_name_is_one_line(name):
    with pytest.raises(ValueError, match="ORG/NAME") as err:
        Captioner.load(name)
    assert "\n" not in str(err.value)


def test_a_cached_hub_bundle_loads_offline_without_the_network(tmp_path, hub_cache, hub_offline, no_network):
    local = make_caption_bundle(tmp_path / "bundle")
    put_in_hub_cache(hub_cache, "org/tiny", local)
    assert Captioner.load("hf-hub:org/tiny").caption(IMAGES) == Captioner.load(local).caption(IMAGES)
    assert not no_network


def test_a_hub_revision_loads_that_revision(tmp_path, hub_cache, no_network):
    put_in_hub_cache(hub_cache, "org/m", make_caption_bundle(tmp_path / "caption"))
    put_in_hub_cache(hub_cache, "org/m", make_classifier_bundle(tmp_path / "classifier"), revision="v1")
    assert Classifier.load("hf-hub:org/m@v1").predict(IMAGES[0]).labels  # the network refused: from the cache
    assert Captioner.load("hf-hub:org/m").caption(IMAGES[0])


def test_offline_and_uncached_is_one_line_naming_the_fetch(hub_cache, hub_offline, no_network):
    with pytest.raises(ValueError, match=r"hf download org/absent --revision v2.*HF_HUB_OFFLINE") as err:
        Captioner.load("hf-hub:org/absent@v2")
    assert "\n" not in str(err.value) and not no_network


@pytest.mark.parametrize(
    "config,held",
    [
        ('{"architecture": "vit_tiny_patch16_224", "pretrained_cfg": {}}', "a timm model"),
        ('{"model_type": "vit", "architectures": ["ViTModel"]}', "a transformers model"),
        (None, "no vitattn bundle files"),
    ],
)
def test_a_hub_folder_of_something_else_says_what_it_is(config, held, tmp_path, hub_cache, hub_offline, no_network):
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "README.md").write_text("# a model\n")
    if config:
        (folder / "config.json").write_text(config)
    put_in_hub_cache(hub_cache, "org/other", folder)
    with pytest.raises(ValueError, match=f"hf-hub:org/other is not a vitattn model: the repository holds {held}"):
        Captioner.load("hf-hub:org/other")


def test_vitattn_caption_takes_a_hub_name_offline(tmp_path, hub_cache, hub_offline):
    import json
    import subprocess

    from PIL import Image

    from tests.helpers.runs import console_script

    local = make_caption_bundle(tmp_path / "bundle")
    put_in_hub_cache(hub_cache, "org/tiny", local)
    images = tmp_path / "images"
    images.mkdir()
    for i, image in enumerate(IMAGES):
        Image.fromarray(image).save(images / f"{i}.png")
    captions = {}
    for model in (str(local), "hf-hub:org/tiny"):
        out = tmp_path / f"{len(captions)}.jsonl"
        cmd = [str(console_script("vitattn-caption")), f"model={model}", f"images={images}", f"out={out}"]
        subprocess.run([*cmd, "device=cpu", "progress=false"], check=True, capture_output=True, timeout=120)
        captions[model] = [json.loads(line)["caption"] for line in out.read_text().splitlines()]
    assert len(captions["hf-hub:org/tiny"]) == len(IMAGES)
    assert captions["hf-hub:org/tiny"] == captions[str(local)]


def test_vitattn_eval_takes_a_hub_name_offline(tmp_path, hub_cache, hub_offline, no_network):
    import json

    from tests.helpers.datasets import make_coco
    from vitattn.cli.evaluate import main as eval_main

    local = make_caption_bundle(tmp_path / "bundle")
    put_in_hub_cache(hub_cache, "org/tiny", local)
    coco = make_coco(tmp_path / "coco")
    data = [
        f"references={coco['val_annotations']}",
        f"image_dir={coco['image_dir']}",
        "num_workers=0",
        "progress=false",
    ]
    scored = {}
    for model in (str(local), "hf-hub:org/tiny"):
        out = tmp_path / f"eval{len(scored)}"
        assert eval_main([f"model={model}", *data, f"out={out}"]) == 0
        scored[model] = json.loads((out / "metrics.json").read_text())
    assert scored["hf-hub:org/tiny"]["metrics"] == scored[str(local)]["metrics"]
    assert (
        scored["hf-hub:org/tiny"]["metrics"]["num_images"] == 6
        and scored["hf-hub:org/tiny"]["model"] == "hf-hub:org/tiny"
    )
