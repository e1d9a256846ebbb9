import json

import pytest
import torch

from tests.helpers.datasets import KARPATHY_SIZES, KARPATHY_WORDS, make_karpathy
from tests.helpers.runs import TINY, compose_train
from vitattn.cli.evaluate import main as eval_main
from vitattn.data import Vocabulary, load_karpathy
from vitattn.errors import ConfigError
from vitattn.metrics import compute_caption_metrics
from vitattn.training import train
from vitattn.training.datamodules import KarpathyDataModule


@pytest.fixture(scope="module", params=["coco", "flickr"])
def karpathy(request, tmp_path_factory):
    return request.param, make_karpathy(tmp_path_factory.mktemp(request.param), style=request.param)


def _entries(files: dict) -> list[dict]:
    return json.loads(files["dataset_json"].read_text())["images"]


def _sentences(entry: dict) -> list[str]:
    return [s["raw"].strip() for s in entry["sentences"]]


def _datamodule(files: dict, **kwargs) -> KarpathyDataModule:
    dm = KarpathyDataModule(**files, img_size=32, batch_size=4, num_workers=0, min_word_freq=1, **kwargs)
    dm.setup("fit")
    return dm


def test_load_karpathy_reads_splits_ids_file_names_and_sentences(karpathy):
    style, files = karpathy
    splits = load_karpathy(files["dataset_json"])
    assert {split: len(images) for split, images in splits.items()} == KARPATHY_SIZES
    entries = iter(_entries(files))
    for split, images in splits.items():
        for image, entry in zip(images, entries):
            assert entry["split"] == split
            if style == "coco":  # COCO: cocoid, and the file under its filepath
                assert image.image_id == entry["cocoid"] != entry["imgid"]
                assert image.file_name == f"{entry['filepath']}/{entry['filename']}"
                assert image.file_name.startswith("train2014/" if split == "train" else "val2014/COCO_val2014_")
            else:  # Flickr: imgid, the file name alone
                assert (image.image_id, image.file_name) == (entry["imgid"], entry["filename"])
            assert list(image.captions) == _sentences(entry) and len(image.captions) == 3 + entry["imgid"] % 3
            assert image.captions[0] == entry["sentences"][0]["raw"].strip() != entry["sentences"][0]["raw"]
            assert (files["image_dir"] / image.file_name).is_file()


def test_load_karpathy_image_id_falls_back_to_imgid_then_index(tmp_path):
    files = make_karpathy(tmp_path, style="coco")
    entries = _entries(files)
    del entries[0]["cocoid"]
    del entries[1]["cocoid"], entries[1]["imgid"]
    files["dataset_json"].write_text(json.dumps({"images": entries}))
    train = load_karpathy(files["dataset_json"])["train"]
    assert [image.image_id for image in train[:3]] == [entries[0]["imgid"], 1, entries[2]["cocoid"]]


@pytest.mark.parametrize("restval_in_train", [True, False])
def test_karpathy_datamodule_splits_restval_and_train_only_vocabulary(karpathy, restval_in_train):
    _, files = karpathy
    dm = _datamodule(files, restval_in_train=restval_in_train)
    entries = _entries(files)
    trained = ("train", "restval") if restval_in_train else ("train",)
    train_entries = [e for e in entries if e["split"] in trained]
    assert len(dm.train_dataset) == len(train_entries)
    assert len(dm.val_dataset) == KARPATHY_SIZES["val"] and len(dm.test_dataset) == KARPATHY_SIZES["test"]
    assert dm.test_dataset.dataset is not dm.val_dataset.dataset
    assert dm.vocab == Vocabulary.build((s for e in train_entries for s in _sentences(e)), min_freq=1)
    assert ("giraffe" in dm.vocab.stoi) == restval_in_train  # restval's word
    assert KARPATHY_WORDS["val"] not in dm.vocab.stoi and KARPATHY_WORDS["test"] not in dm.vocab.stoi
    batch = next(iter(dm.train_dataloader()))
    assert batch["images"].shape == (4, 3, 32, 32) and torch.isfinite(batch["images"]).all()


@pytest.mark.parametrize("split", ["val", "test"])
def test_karpathy_evaluation_split_references_all_sentences(karpathy, split):
    style, files = karpathy
    evaluation = _datamodule(files).evaluation_split(split)
    entries = [e for e in _entries(files) if e["split"] == split]
    ids = [e["cocoid"] if style == "coco" else e["imgid"] for e in entries]
    assert evaluation.ids == ids and evaluation.references == {i: _sentences(e) for i, e in zip(ids, entries)}
    assert [f.rsplit("/", 1)[-1] for f in evaluation.files] == [e["filename"] for e in entries]
    assert str(files["dataset_json"].resolve()) in evaluation.source and f"{split} split" in evaluation.source


def _drop(key):
    def edit(entries):
        del entries[2][key]

    return edit


def _set(key, value):
    def edit(entries):
        entries[2][key] = value

    return edit


def _drop_raw(entries):
    del entries[2]["sentences"][1]["raw"]


BAD_FILES = {
    "no-filename": (_drop("filename"), r"images\[2\] has no \['filename'\]"),
    "no-split": (_drop("split"), r"images\[2\] has no \['split'\]"),
    "no-sentences": (_drop("sentences"), r"images\[2\] has no \['sentences'\]"),
    "no-raw": (_drop_raw, r"images\[2\]\.sentences\[1\] has no \['raw'\]"),
    "unknown-split": (_set("split", "dev"), r"images\[2\] has split='dev'; it must be one of \['train', 'restval'"),
    "text-id": (_set("cocoid", "42"), r"images\[2\] has cocoid='42'; ids must be integers"),
    "repeated-id": (_set("cocoid", 1000), r"images\[2\] repeats image id 1000"),
    "sentences-not-a-list": (_set("sentences", "a dog"), r"images\[2\] has sentences='a dog'; it must be a list"),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_load_karpathy_bad_entry_is_one_line_naming_it(name, tmp_path):
    files = make_karpathy(tmp_path, style="coco")
    entries = _entries(files)
    edit, message = BAD_FILES[name]
    edit(entries)
    files["dataset_json"].write_text(json.dumps({"images": entries}))
    with pytest.raises(ValueError, match=rf"^{files['dataset_json']}: {message}") as err:
        load_karpathy(files["dataset_json"])
    assert "\n" not in str(err.value)


def test_load_karpathy_file_without_images_or_not_json(tmp_path):
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps({"annotations": []}))
    with pytest.raises(ValueError, match=r"^Karpathy split file .*dataset_coco\.json has no \['images'\]"):
        load_karpathy(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"^Karpathy split file .*dataset_coco\.json is not valid JSON"):
        load_karpathy(path)
    with pytest.raises(ValueError, match=r"^Karpathy split file not found: .*missing\.json"):
        load_karpathy(tmp_path / "missing.json")


def test_train_on_a_bad_karpathy_file_is_one_config_error(tmp_path):
    files = make_karpathy(tmp_path / "data", style="flickr")
    entries = _entries(files)
    del entries[2]["split"]
    files["dataset_json"].write_text(json.dumps({"images": entries}))
    cfg = compose_train(["data=karpathy", *(f"data.{k}={v}" for k, v in files.items()), *TINY], tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^data=KarpathyDataModule: .*images\[2\] has no \['split'\]") as err:
        train(cfg)
    assert "\n" not in str(err.value)


def test_train_then_eval_scores_the_karpathy_test_split(tmp_path):
    files = make_karpathy(tmp_path / "data", style="coco")
    run = tmp_path / "run"
    overrides = [
        "data=karpathy",
        *(f"data.{k}={v}" for k, v in files.items()),
        *TINY,
        "data.num_workers=0",
        "data.min_word_freq=1",
        "head.decoder.depth=1",
        "trainer.max_steps=4",
        "trainer.max_epochs=-1",
        "test=false",
    ]
    train(compose_train(overrides, run))
    assert eval_main([f"model={run}", "split=test", "num_workers=0", "progress=false"]) == 0
    report = json.loads((run / "eval-test" / "metrics.json").read_text())
    assert report["split"] == "test" and report["metrics"]["num_images"] == KARPATHY_SIZES["test"]
    assert "test split" in report["data"]
    entries = [e for e in _entries(files) if e["split"] == "test"]
    lines = [json.loads(line) for line in (run / "eval-test" / "captions.jsonl").read_text().splitlines()]
    assert [line["image_id"] for line in lines] == [e["cocoid"] for e in entries]
    assert [line["references"] for line in lines] == [_sentences(e) for e in entries]
    expected = compute_caption_metrics([line["caption"] for line in lines], [_sentences(e) for e in entries])
    assert {k: report["metrics"][k] for k in expected} == pytest.approx(expected)
