"""Tests for vitattn.data: shapes generator, vocabulary, COCO parsing and the DataModules."""

from __future__ import annotations

import json
import math
import pickle
import re

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torchvision import transforms as T

from vitattn.data import (
    CocoCaptionDataset,
    ShapesDataset,
    Vocabulary,
    denormalize,
    load_coco_captions,
    normalize,
    read_image,
)
from vitattn.data.shapes import BACKGROUND, COLOURS, SHAPES, SIZES
from vitattn.metrics.tokenize import coco_tokenize
from vitattn.training.datamodules import CocoCaptionDataModule, ImageFolderDataModule, ShapesDataModule

IMG = 64  # shapes are specified at the default size; 32 px leaves too few pixels to measure them
_PHRASE = rf"a ({'|'.join(SIZES)}) ({'|'.join(COLOURS)}) ({'|'.join(SHAPES)})"
CAPTION_RE = re.compile(rf"{_PHRASE}( (left of|above|below) {_PHRASE}){{0,2}}")
INVERSE = {"left of": "right of", "above": "below", "below": "above"}


# --- an independent reading of a rendered shapes image ------------------------------------------


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean (H, W) mask, each as (k, 2) pixel (y, x) coordinates."""
    seen = np.zeros_like(mask)
    found = []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        stack, pixels = [(y0, x0)], []
        while stack:
            y, x = stack.pop()
            pixels.append((y, x))
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        found.append(np.array(pixels))
    return found


def _nearest(value, table: dict):
    return min(table, key=lambda key: np.abs(np.subtract(table[key], value)).sum())


def read_objects(image: torch.Tensor) -> list[dict]:
    """Find the shapes in a (3, H, W) uint8 image from pixels alone, sorted left to right.

    A pixel is foreground when it is at least half covered by a shape (its distance from the
    background is over half the smallest colour-to-background distance). Each component's box gives
    centre and size; its fill of the box tells the shape (square 1, circle pi/4, triangle 1/2); the
    pixel at its centre gives the colour.
    """
    pixels = image.permute(1, 2, 0).numpy().astype(int)  # (H, W, 3)
    side = pixels.shape[0]
    distance = np.abs(pixels - BACKGROUND).sum(-1)  # (H, W)
    half_cover = min(np.abs(np.subtract(c, BACKGROUND)).sum() for c in COLOURS.values()) / 2
    objects = []
    for comp in _components(distance > half_cover):
        (y0, x0), (y1, x1) = comp.min(0), comp.max(0) + 1
        fill = len(comp) / ((y1 - y0) * (x1 - x0))
        objects.append(
            {
                "size": _nearest((x1 - x0) / side, SIZES),
                "colour": _nearest(pixels[(y0 + y1) // 2, (x0 + x1) // 2], COLOURS),
                "shape": _nearest(fill, {"square": 1.0, "circle": math.pi / 4, "triangle": 0.5}),
                "cx": (x0 + x1) / 2 / side,
                "cy": (y0 + y1) / 2 / side,
                "width": (x1 - x0) / side,
            }
        )
    return sorted(objects, key=lambda o: o["cx"])


def caption_from_objects(objects: list[dict]) -> str:
    """The caption grammar, written out again from the specification."""
    words = []
    for i, obj in enumerate(objects):
        if i:
            prev = objects[i - 1]
            dx, dy = obj["cx"] - prev["cx"], obj["cy"] - prev["cy"]
            words.append("left of" if abs(dx) >= abs(dy) else "above" if prev["cy"] < obj["cy"] else "below")
        words.append(f"a {obj['size']} {obj['colour']} {obj['shape']}")
    return " ".join(words)


def phrases(caption: str) -> list[str]:
    return re.findall(_PHRASE.replace("(", "(?:"), caption)


# --- shapes ---------------------------------------------------------------------------------------


def test_shapes_same_seed_split_index_gives_same_item():
    a, b = ShapesDataset("train", 6, seed=3), ShapesDataset("train", 6, seed=3)
    longer = ShapesDataset("train", 12, seed=3)  # an item does not depend on the dataset's size
    for i in range(len(a)):
        assert torch.equal(a.image(i), b.image(i)) and torch.equal(a.image(i), longer.image(i))
        assert a.caption(i) == b.caption(i) == longer.caption(i)


@pytest.mark.parametrize("other", [dict(split="val", seed=0), dict(split="train", seed=1)])
def test_shapes_other_split_or_seed_gives_other_items(other):
    base, changed = (
        ShapesDataset("train", 8, seed=0),
        ShapesDataset(other["split"], 8, seed=other["seed"]),
    )
    assert base.captions != changed.captions
    assert not all(torch.equal(base.image(i), changed.image(i)) for i in range(len(base)))


def test_shapes_captions_follow_the_grammar_and_use_every_word():
    dataset = ShapesDataset("train", 300)
    counts = {len(phrases(c)) for c in dataset.captions}
    assert all(CAPTION_RE.fullmatch(c) for c in dataset.captions)
    assert counts == {1, 2, 3}
    used = {w for c in dataset.captions for w in c.split()}
    assert {*SIZES, *COLOURS, *SHAPES, "left", "above", "below"} <= used


def test_shapes_caption_and_label_agree_with_the_pixels():
    dataset = ShapesDataset("val", 40, task="classification")
    widths = {size: [] for size in SIZES}
    for i in range(len(dataset)):
        objects = read_objects(dataset.image(i))
        assert caption_from_objects(objects) == dataset.caption(i), f"image {i}"
        label = dataset.class_names[dataset[i][1]]
        assert label == f"{objects[0]['colour']} {objects[0]['shape']}"
        for obj in objects:
            widths[obj["size"]].append(obj["width"])
    assert min(widths["large"]) >= 1.5 * max(widths["small"])  # sizes tell apart at a glance


def test_shapes_order_and_relations_are_unambiguous():
    clear = 0.05  # of the image side: 3 px at 64 px, well beyond the antialiased edge pixel
    for scene in ShapesDataset("train", 500).scenes:
        for a, b in zip(scene, scene[1:]):
            dx, dy = b.cx - a.cx, abs(b.cy - a.cy)
            assert dx >= clear and abs(dx - dy) >= clear, scene


def test_shapes_references_add_the_reversed_chain():
    dataset = ShapesDataset("test", 60)
    for i in range(len(dataset)):
        refs, names = dataset.references(i), phrases(dataset.caption(i))
        assert refs[0] == dataset.caption(i)
        if len(names) == 1:
            assert refs == [names[0]]
        else:
            relations = re.split("|".join(map(re.escape, names)), refs[0])[1:-1]  # text between phrases
            reversed_chain = [names[-1]]
            for rel, name in zip(reversed(relations), reversed(names[:-1])):
                reversed_chain += [INVERSE[rel.strip()], name]
            assert refs[1:] == [" ".join(reversed_chain)]


def test_shapes_class_names_cover_colour_times_shape():
    names = ShapesDataset.class_names
    assert len(names) == len(set(names)) == len(COLOURS) * len(SHAPES)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(split="dev"), "split='dev' must be one of"),
        (dict(task="detection"), "task='detection' must be one of"),
        (dict(img_size=8), "img_size=8 is too small to draw shapes; use 16 or more"),
    ],
)
def test_shapes_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShapesDataset(**{"split": "train", "size": 2, **kwargs})


# --- vocabulary -----------------------------------------------------------------------------------


def test_vocab_build_orders_by_frequency_then_alphabet():
    captions = ["the dog runs", "the cat", "The cat!"]
    vocab = Vocabulary.build(captions)
    assert vocab.itos[4:] == ["the", "cat", "dog", "runs"]  # the x3, cat x2, dog/runs x1 by name
    assert [vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.unk_id] == [0, 1, 2, 3]
    assert vocab.itos[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert Vocabulary.build(captions, min_freq=2).itos[4:] == ["the", "cat"]


def test_vocab_encode_decode_round_trip():
    captions = ["A man riding a horse.", "Two dogs' toys on the grass"]
    vocab = Vocabulary.build(captions)
    for caption in captions:
        ids = vocab.encode(caption)
        assert ids[0] == vocab.bos_id and ids[-1] == vocab.eos_id
        assert vocab.decode(ids) == " ".join(coco_tokenize(caption))
    assert vocab.encode("a zebra") == [vocab.bos_id, vocab.stoi["a"], vocab.unk_id, vocab.eos_id]
    padded = torch.tensor(
        [
            vocab.encode("a horse") + [vocab.pad_id] * 3,
            vocab.encode("a man") + [vocab.stoi["man"]] * 3,
        ]
    )
    assert vocab.decode_batch(padded) == ["a horse", "a man"]  # stops at eos, skips pad/bos


def test_vocab_encode_truncates_but_keeps_eos():
    vocab = Vocabulary.build(["one two three four five"])
    ids = vocab.encode("one two three four five", max_len=4)
    assert len(ids) == 4 and ids[-1] == vocab.eos_id and vocab.decode(ids) == "one two"
    with pytest.raises(ValueError, match="max_len=1 must be at least 2 to hold <bos> and <eos>"):
        vocab.encode("one", max_len=1)


def test_vocab_save_load_is_plain_json(tmp_path):
    vocab = Vocabulary.build(["a small red circle", "a large blue square"])
    path = tmp_path / "vocab.json"
    vocab.save(path)
    assert json.loads(path.read_text())["itos"] == vocab.itos
    assert Vocabulary.load(path) == vocab and len(Vocabulary.load(path)) == len(vocab)
    assert Vocabulary.load(path) != Vocabulary(["other"])


def test_vocab_load_rejects_bad_files(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "nospecials.json").write_text(json.dumps({"itos": ["a", "b"]}))
    with pytest.raises(ValueError, match="not valid JSON"):
        Vocabulary.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match=r"starts with \['a', 'b'\], expected \['<pad>', '<bos>', '<eos>', '<unk>'\]"):
        Vocabulary.load(tmp_path / "nospecials.json")
    with pytest.raises(FileNotFoundError, match=r"vocabulary file not found: .*missing\.json"):
        Vocabulary.load(tmp_path / "missing.json")


# --- COCO files -----------------------------------------------------------------------------------

TRAIN_CAPTIONS = {
    1: ["A dog on grass.", "A brown dog"],
    2: ["A red car", "A car parked"],
    3: ["Two cats", "A cat on a bed"],
}
VAL_CAPTIONS = {10: ["A zebra near a dog", "A dog"], 11: ["A car"]}
EXIF_SIZE, EXIF_ORIENTATION_ROT90 = (40, 20), 6  # stored landscape, shown portrait


def _write_coco(path, captions: dict[int, list[str]]) -> None:
    images = [{"id": i, "file_name": f"{i}.jpg"} for i in captions]
    annotations = [{"image_id": i, "caption": c} for i, cs in captions.items() for c in cs]
    path.write_text(json.dumps({"images": images, "annotations": annotations}))


@pytest.fixture
def coco(tmp_path):
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    for i in [*TRAIN_CAPTIONS, *VAL_CAPTIONS]:
        exif = Image.Exif()
        exif[0x0112] = EXIF_ORIENTATION_ROT90 if i == 1 else 1  # 0x0112: EXIF Orientation tag
        Image.new("RGB", EXIF_SIZE, (30 * i % 255, 90, 120)).save(image_dir / f"{i}.jpg", exif=exif)
    _write_coco(tmp_path / "train.json", TRAIN_CAPTIONS)
    _write_coco(tmp_path / "val.json", VAL_CAPTIONS)
    return tmp_path


def test_coco_groups_captions_by_image(coco):
    images = load_coco_captions(coco / "train.json")
    assert {im.image_id: list(im.captions) for im in images} == TRAIN_CAPTIONS


def test_coco_image_is_rgb_and_upright(coco):
    image = read_image(coco / "images" / "1.jpg")
    assert image.mode == "RGB" and image.size == EXIF_SIZE[::-1]
    item = CocoCaptionDataset(coco / "images", coco / "train.json")[1]
    assert item["image"].size == EXIF_SIZE and item["references"] == TRAIN_CAPTIONS[2]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "COCO caption file not found"),
        ("{oops", "not valid JSON"),
        (json.dumps({"images": []}), r"has no \['annotations'\]; it needs \['images', 'annotations'\]"),
        (json.dumps({"images": [{"id": 1}], "annotations": []}), r"images\[0\] has no \['file_name'\]"),
        (
            json.dumps({"images": [], "annotations": [{"image_id": 1, "caption": "x"}]}),
            "image_id=1",
        ),
    ],
)
def test_coco_bad_files_raise_one_line_value_errors(tmp_path, content, message):
    path = tmp_path / "captions.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        load_coco_captions(path)
    assert "\n" not in str(info.value)


# --- DataModules ----------------------------------------------------------------------------------


def check_caption_batch(batch: dict, vocab: Vocabulary, batch_size: int, img_size: int) -> None:
    images, tokens, ids, refs = (
        batch["images"],
        batch["tokens"],
        batch["image_ids"],
        batch["references"],
    )
    assert images.shape == (batch_size, 3, img_size, img_size) and images.dtype == torch.uint8  # normalised on device
    rows = batch["caption_image"].tolist()  # the image of each caption: every reference of a training image, else one
    assert tokens.dtype == torch.long and rows == sorted(rows) and len(set(rows)) == batch_size
    assert ids.shape == (batch_size,) and ids.dtype == torch.long
    assert len(refs) == batch_size and all(r and all(isinstance(c, str) for c in r) for r in refs)
    assert (tokens[:, 0] == vocab.bos_id).all()
    is_eos = tokens == vocab.eos_id
    assert (is_eos.sum(1) == 1).all()
    after_eos = is_eos.long().cumsum(1).bool() & ~is_eos  # (B, T) positions after the eos
    assert (tokens[after_eos] == vocab.pad_id).all()
    assert not (tokens[~after_eos] == vocab.pad_id).any()
    assert (tokens[:, -1] != vocab.pad_id).any()  # padded to the longest caption, no further


def test_shapes_caption_datamodule_batches():
    dm = ShapesDataModule(num_train=40, num_val=10, num_test=6, batch_size=4)
    dm.setup("fit")
    assert dm.vocab == Vocabulary.build(ShapesDataset("train", 40).captions)
    val_ids = []
    for batch in dm.val_dataloader():
        check_caption_batch(batch, dm.vocab, len(batch["image_ids"]), IMG)
        assert dm.vocab.decode_batch(batch["tokens"]) == [r[0] for r in batch["references"]]
        val_ids += batch["image_ids"].tolist()
    assert val_ids == list(range(dm.num_val))
    train_ids = [i for b in dm.train_dataloader() for i in b["image_ids"].tolist()]
    assert sorted(train_ids) == list(range(dm.num_train))  # each image once per epoch
    corners = batch["images"][:, :, 0, 0]  # (B, 3); a border keeps shapes off corners
    assert torch.equal(corners, torch.tensor(BACKGROUND, dtype=torch.uint8).expand_as(corners))
    corners = denormalize(dm.ready_batch(batch)["images"])[:, :, 0, 0]  # what the model gets, undone
    torch.testing.assert_close(corners, (torch.tensor(BACKGROUND) / 255).expand_as(corners))


def test_shapes_caption_datamodule_truncates_and_reuses_vocab(tmp_path):
    saved = Vocabulary.build(["a small red circle", "a never seen word"])
    saved.save(tmp_path / "vocab.json")
    dm = ShapesDataModule(
        num_train=8,
        num_val=8,
        num_test=8,
        batch_size=8,
        max_caption_len=5,
        vocab_path=tmp_path / "vocab.json",
    )
    dm.setup()
    assert dm.vocab == saved
    batch = next(iter(dm.test_dataloader()))
    assert batch["tokens"].shape[1] <= 5 and (batch["tokens"] == saved.eos_id).any(1).all()


def test_shapes_classification_datamodule_batches():
    dm = ShapesDataModule(task="classification", img_size=32, num_train=12, num_val=6, num_test=6, batch_size=6)
    dm.setup()
    images, labels = next(iter(dm.val_dataloader()))
    assert images.shape == (6, 3, 32, 32) and images.dtype == torch.uint8
    assert labels.dtype == torch.long
    assert labels.tolist() == [dm.val_dataset.label(i) for i in range(6)]
    assert dm.num_classes == len(dm.class_names) == len(COLOURS) * len(SHAPES)


def test_datamodule_datasets_pickle_for_spawned_workers():
    dm = ShapesDataModule(num_train=4, num_val=4, num_test=4, batch_size=2)
    dm.setup()
    loader = dm.train_dataloader()
    restored = pickle.loads(pickle.dumps((loader.dataset, loader.collate_fn)))
    dataset, collate = restored
    check_caption_batch(collate([dataset[0], dataset[1]]), dm.vocab, 2, IMG)


def test_datamodule_needs_setup_before_loaders():
    with pytest.raises(RuntimeError, match=r"ShapesDataModule.setup\(\) must run before its dataloaders"):
        ShapesDataModule(num_train=4).train_dataloader()


def _write_folder(root, split: str, classes: list[str], per_class: int) -> None:
    for c, name in enumerate(classes):
        (root / split / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (48, 40), (60 * c, 20 * i, 100)).save(root / split / name / f"{i}.png")


@pytest.fixture
def folder(tmp_path):
    _write_folder(tmp_path, "train", ["cat", "dog"], per_class=3)
    _write_folder(tmp_path, "val", ["cat", "dog"], per_class=2)
    return tmp_path


def test_image_folder_datamodule_batches(folder):
    dm = ImageFolderDataModule(folder, img_size=32, batch_size=4)
    dm.setup("fit")
    assert dm.class_names == ["cat", "dog"] and dm.num_classes == 2
    assert dm.test_dataset is dm.val_dataset  # no root/test
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        images, labels = next(iter(loader))
        assert images.shape == (4, 3, 32, 32) and images.dtype == torch.uint8
        assert labels.dtype == torch.long and set(labels.tolist()) <= {0, 1}


def test_image_folder_datamodule_clear_errors(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"image folder not found: .*train \(expected .*train/<class>/<image>\)"
    ):
        ImageFolderDataModule(tmp_path).setup()
    (tmp_path / "train").mkdir()
    with pytest.raises(ValueError, match=r"image folder .*train is empty"):
        ImageFolderDataModule(tmp_path).setup()
    (tmp_path / "train").rmdir()
    _write_folder(tmp_path, "train", ["cat", "dog"], per_class=1)
    _write_folder(tmp_path, "val", ["cat", "bird"], per_class=1)
    with pytest.raises(
        ValueError, match=r"classes of .*val \['bird', 'cat'\] differ from those of .*train \['cat', 'dog'\]"
    ):
        ImageFolderDataModule(tmp_path).setup()


def test_coco_datamodule_batches(coco):
    dm = CocoCaptionDataModule(coco / "images", coco / "train.json", coco / "val.json", img_size=32, batch_size=2)
    dm.setup("fit")
    assert dm.vocab == Vocabulary.build(c for cs in TRAIN_CAPTIONS.values() for c in cs)  # train only
    assert "zebra" not in dm.vocab.stoi
    val = list(dm.val_dataloader())
    for batch in val:
        check_caption_batch(batch, dm.vocab, len(batch["image_ids"]), 32)
    assert [i for b in val for i in b["image_ids"].tolist()] == list(VAL_CAPTIONS)
    assert [r for b in val for r in b["references"]] == list(VAL_CAPTIONS.values())
    assert dm.test_dataset.dataset is dm.val_dataset.dataset  # no test file: test on val
    batch = next(iter(dm.train_dataloader()))
    check_caption_batch(batch, dm.vocab, 2, 32)
    decoded = [dm.vocab.decode(tokens) for tokens in batch["tokens"]]
    for i, refs in enumerate(batch["references"]):  # captions_per_image=all: each reference, once
        assert [d for d, row in zip(decoded, batch["caption_image"]) if row == i] == [
            " ".join(coco_tokenize(r)) for r in refs
        ]


def test_coco_datamodule_samples_every_training_caption(coco):
    settings = {"img_size": 32, "batch_size": 2, "captions_per_image": 1}
    dm = CocoCaptionDataModule(coco / "images", coco / "train.json", coco / "val.json", **settings)
    dm.setup()
    seen = {dm.vocab.decode(dm.train_dataset[0, seed]["tokens"][0]) for seed in range(30)}  # each missed w.p. 2**-30
    assert seen == {" ".join(coco_tokenize(c)) for c in TRAIN_CAPTIONS[1]}


def test_normalize_matches_torchvision_and_inverts():
    images = torch.rand(2, 3, 8, 8)
    reference = T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)(images)
    torch.testing.assert_close(normalize()(images), reference)
    torch.testing.assert_close(denormalize(normalize()(images)), images)


def test_coco_datamodule_missing_paths_raise(coco):
    with pytest.raises(ValueError, match="image folder not found"):
        CocoCaptionDataModule(coco / "nope", coco / "train.json", coco / "val.json").setup()
    with pytest.raises(ValueError, match=r"COCO caption file not found: .*missing\.json"):
        CocoCaptionDataModule(coco / "images", coco / "missing.json", coco / "val.json").setup()
