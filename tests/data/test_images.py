"""One image reader: training datasets and the captioner see the same pixels for every kind of file."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.images import write_good_images
from vitattn.data import eval_transform, read_image
from vitattn.data.images import check_split
from vitattn.inference.captioning import read_pixels
from vitattn.training.datamodules import CocoCaptionDataModule, ImageFolderDataModule, ShapesDataModule


def _palette_with_transparency(path):
    image = Image.new("P", (30, 30), 1)
    image.putpalette([0, 0, 0, 200, 0, 0] + [0] * 762)
    image.paste(0, (0, 0, 15, 30))
    image.save(path, transparency=0)  # index 0 (left half) transparent: white once read


@pytest.fixture()
def tricky(tmp_path):
    folder = tmp_path / "images"
    write_good_images(folder)
    _palette_with_transparency(folder / "palette_alpha.png")
    names = ["rgba.png", "palette_alpha.png", "gray16.png", "exif_rotated.jpg", "cmyk.jpg", "animated.gif"]
    return folder, names


def test_palette_transparency_is_composited_on_white(tricky):
    folder, _ = tricky
    image = read_image(folder / "palette_alpha.png")
    assert image.getpixel((2, 2)) == (255, 255, 255) and image.getpixel((25, 2)) == (200, 0, 0)


def test_coco_training_data_and_captioner_see_identical_tensors(tricky, tmp_path):
    folder, names = tricky
    images = [{"id": i, "file_name": n} for i, n in enumerate(names)]
    annotations = [{"id": i, "image_id": i, "caption": "a thing"} for i in range(len(names))]
    (tmp_path / "c.json").write_text(json.dumps({"images": images, "annotations": annotations}))
    dm = CocoCaptionDataModule(folder, tmp_path / "c.json", tmp_path / "c.json", img_size=32, batch_size=2)
    dm.setup("fit")
    ours = [read_pixels(str(folder / n), eval_transform(dm.preprocess)) for n in names]  # the captioner's reader
    for i, name in enumerate(names):
        tensor = ours[i]
        assert isinstance(tensor, torch.Tensor), (name, tensor)
        pixels = dm.val_dataset[i]["image"]  # uint8, normalised on the device as here
        torch.testing.assert_close(dm.normalize(pixels), tensor, rtol=0, atol=0, msg=name)


def test_image_folder_training_data_and_captioner_see_identical_tensors(tricky, tmp_path):
    source, names = tricky
    root = tmp_path / "tree"
    for split in ("train", "val"):
        for name in names:
            target = root / split / name.split(".")[0] / name
            target.parent.mkdir(parents=True)
            target.write_bytes((source / name).read_bytes())
    dm = ImageFolderDataModule(root, img_size=32, batch_size=2, augment=False)
    dm.setup("fit")
    paths = [path for path, _ in dm.val_dataset.samples]
    ours = [read_pixels(path, eval_transform(dm.preprocess)) for path in paths]  # the captioner's reader
    for i, path in enumerate(paths):
        tensor = ours[i]
        training, _ = dm.train_dataset[i]  # augment=False: training images get the evaluation transform
        torch.testing.assert_close(dm.normalize(dm.val_dataset[i][0]), tensor, rtol=0, atol=0, msg=path)
        torch.testing.assert_close(dm.normalize(training), tensor, rtol=0, atol=0, msg=path)
    assert np.isfinite(torch.stack(ours).numpy()).all()


def test_evaluation_refuses_the_training_split():
    for split in ("val", "test"):
        check_split(split)
    with pytest.raises(ValueError, match=r"^split='train' is unknown; choose one of \['val', 'test'\]$"):
        check_split("train")
    with pytest.raises(ValueError, match=r"^split='train' is unknown"):  # a DataModule asks the same check
        ShapesDataModule(img_size=32, num_train=2, num_val=2, num_test=2).evaluation_split("train")
