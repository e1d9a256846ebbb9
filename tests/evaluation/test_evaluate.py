import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import load_file

from tests.helpers.datasets import make_coco
from tests.helpers.images import make_image_folder
from tests.helpers.runs import console_script
from vitattn.bundle import load_bundle, save_bundle
from vitattn.cli.caption import main as caption_main
from vitattn.cli.evaluate import main as eval_main
from vitattn.cli.export import main as export_main
from vitattn.data.images import read_image
from vitattn.data.preprocess import normalize
from vitattn.data.shapes import CLASS_NAMES, ShapesDataset
from vitattn.inference import InputImage, caption_images
from vitattn.metrics import compute_caption_metrics, exact_match
from vitattn.metrics.toolkit import TOOLKIT_METRICS
from vitattn.run_dir import RunDir

CAPTION_KEYS = {"bleu1", "bleu2", "bleu3", "bleu4", "rouge_l", "cider_d", "distinct", "unknown_words", "num_images"}
FAST = ["num_workers=0", "progress=false"]


@pytest.fixture
def caption_run(small_caption_run):
    """The shared small captioner (tests/conftest.py: 40 steps, 16 validation and test images) and its final
    validation metrics, logged at its last step."""
    return small_caption_run, RunDir(small_caption_run).load_result()["metrics"]


@pytest.fixture
def classifier_run(small_classifier_run):
    """The shared small classifier (tests/conftest.py: 8 steps, 16 test images)."""
    return small_classifier_run


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _generated(run: Path, split: str, **generate) -> tuple[list[str], list[list[str]]]:
    """The oracle's captions: the bundle's model on the regenerated split, all images in one batch."""
    bundle = load_bundle(run)
    data = ShapesDataset(split, 16, img_size=32, seed=0, task="caption", transform=normalize())
    images = torch.stack([data[i]["image"] for i in range(len(data))])
    captions = bundle.vocab.decode_batch(bundle.model.generate(images, **{**bundle.generate, **generate}))
    return captions, [data.references(i) for i in range(len(data))]


@pytest.mark.parametrize(
    "split,decoding",
    [("val", {}), ("test", {"num_beams": 2, "max_new_tokens": 6, "length_penalty": 0.5, "early_stopping": "never"})],
)
def test_eval_captions_on_the_run_split_match_the_oracle(caption_run, split, decoding, tmp_path, capsys):
    run, _ = caption_run
    if split == "test":  # written into the run folder: a copy of the shared run
        run = Path(shutil.copytree(run, tmp_path / "run"))
    args = [f"model={run}", f"split={split}", *FAST, *(f"{k}={v}" for k, v in decoding.items())]
    if split == "val":
        args.append(f"out={tmp_path}")
    assert eval_main(args) == 0
    out = tmp_path if split == "val" else run / "eval-test"  # default: RUN/eval-<split>
    report = _metrics(out)
    assert {"task", "model", "split", "data", "predictions", "decoding", "metrics"} <= set(report)
    assert (report["task"], report["split"], report["model"], report["predictions"]) == (
        "caption",
        split,
        str(run),
        None,
    )
    defaults = {"num_beams": 1, "max_new_tokens": 23, "length_penalty": 1.0, "early_stopping": False}
    defaults |= {"min_new_tokens": 0, "no_repeat_ngram_size": 0, "repetition_penalty": 1.0, "rerank": 1}  # off
    assert report["decoding"] == {**defaults, **decoding}
    assert set(report["metrics"]) == CAPTION_KEYS | {"exact_match"}
    captions, references = _generated(run, split, **decoding)
    expected = {
        **compute_caption_metrics(captions, references),
        "exact_match": exact_match(captions, references),
        "distinct": len(set(captions)) / 16,
        "num_images": 16,
    }
    for key, value in expected.items():
        assert report["metrics"][key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    written = [json.loads(line) for line in (out / "captions.jsonl").read_text().splitlines()]
    assert [(r["image_id"], r["caption"], r["references"]) for r in written] == list(
        zip(range(16), captions, references)
    )
    table = capsys.readouterr().out
    assert (
        "BLEU-4" in table
        and "CIDEr-D" in table
        and "exact match" in table
        and f"metrics -> {out / 'metrics.json'}" in table
    )


def test_eval_equals_the_trainers_validation(caption_run, tmp_path):
    run, val = caption_run
    assert eval_main([f"model={run / 'checkpoints' / 'last.ckpt'}", "batch_size=8", f"out={tmp_path}", *FAST]) == 0
    metrics = _metrics(tmp_path)["metrics"]
    for key in ("bleu1", "bleu4", "rouge_l", "cider_d", "exact_match", "distinct", "num_images"):
        assert metrics[key] == pytest.approx(val[f"val/{key}"], rel=1e-6, abs=1e-7), key  # logged as float32


@pytest.mark.parametrize("fmt", ["jsonl", "coco"])
def test_eval_predictions_identical_to_references_score_one(caption_run, fmt, tmp_path):
    run, _ = caption_run
    data = ShapesDataset("val", 16, img_size=32, seed=0, task="caption")
    records = [{"image": f"shape{i}.png", "image_id": i, "caption": data.references(i)[-1]} for i in range(16)]
    path = tmp_path / f"predictions.{'jsonl' if fmt == 'jsonl' else 'json'}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text(json.dumps([{"image_id": r["image_id"], "caption": r["caption"]} for r in records]))
    assert eval_main([f"model={run}", f"predictions={path}", f"out={tmp_path / 'eval'}", *FAST]) == 0
    report = _metrics(tmp_path / "eval")
    metrics = report["metrics"]
    assert report["predictions"] == str(path) and report["decoding"] == {}
    assert metrics["bleu1"] == pytest.approx(1.0, abs=1e-6) and metrics["bleu4"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["exact_match"] == 1.0 and metrics["rouge_l"] == pytest.approx(1.0) and metrics["num_images"] == 16
    assert not (tmp_path / "eval" / "captions.jsonl").exists()


def test_eval_predictions_are_matched_by_image_id(caption_run, tmp_path):
    run, _ = caption_run
    data = ShapesDataset("val", 16, img_size=32, seed=0, task="caption")
    refs = [data.references(i) for i in range(16)]
    captions = {
        i: refs[i][0] if i % 2 else refs[(i + 1) % 16][0] for i in range(14)
    }  # half right, half another image's
    lines = [{"image_id": str(i), "caption": captions[i]} for i in reversed(range(14))]  # reversed, ids as strings
    lines += [
        {"image": "x.png", "image_id": 14, "error": "file not found"},
        {"image_id": 3, "caption": "repeated: not scored"},
    ]
    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"image_id": 15, "capt')  # a cut-off last line
    assert eval_main([f"model={run}", f"predictions={path}", f"out={tmp_path}", *FAST]) == 1  # not every image scored
    metrics = _metrics(tmp_path)["metrics"]
    expected = compute_caption_metrics([captions[i] for i in range(14)], refs[:14])
    assert {k: metrics[k] for k in expected} == pytest.approx(expected, rel=1e-12)
    assert metrics["exact_match"] == sum(captions[i] in refs[i] for i in range(14)) / 14
    assert (metrics["num_images"], metrics["num_failed"], metrics["num_missing"]) == (14, 1, 1)


@pytest.mark.slow
def test_eval_scorer_coco_writes_the_toolkits_numbers_beside_the_builtin_ones(caption_run, tmp_path, capsys):
    pytest.importorskip("pycocoevalcap", reason="pip install -e '.[coco]'")
    if shutil.which("java") is None:
        pytest.skip("needs Java: apt-get install default-jre-headless")
    run, _ = caption_run
    data = ShapesDataset("val", 16, img_size=32, seed=0, task="caption")
    refs = [data.references(i) for i in range(16)]
    lines = [{"image_id": i, "caption": refs[i][0] if i % 2 else refs[(i + 3) % 16][0]} for i in range(16)]
    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert eval_main([f"model={run}", f"predictions={path}", "scorer=coco", f"out={tmp_path}", *FAST]) == 0
    report = _metrics(tmp_path)
    builtin, coco = report["metrics"], report["coco"]
    assert set(coco) == set(TOOLKIT_METRICS) and set(builtin) == CAPTION_KEYS | {"exact_match"}
    shared = [k for k in coco if k != "meteor"]
    assert {k: coco[k] for k in shared} == pytest.approx({k: builtin[k] for k in shared}, abs=1e-6)
    assert 0.3 < coco["meteor"] < 1.0  # half the captions right, half another image's
    table = capsys.readouterr().out
    meteor_row = r"built-in\s+COCO toolkit\n  BLEU-1 .*\n(?:.*\n){3}  METEOR\s+-\s+0\.\d{4}\n  ROUGE-L"
    assert re.search(meteor_row, table), table


def test_eval_generated_captions_read_back_as_predictions_give_the_same_scores(caption_run, tmp_path):
    run, _ = caption_run
    assert eval_main([f"model={run}", f"out={tmp_path / 'gen'}", *FAST]) == 0
    assert (
        eval_main(
            [f"model={run}", f"predictions={tmp_path / 'gen' / 'captions.jsonl'}", f"out={tmp_path / 'pred'}", *FAST]
        )
        == 0
    )
    assert _metrics(tmp_path / "pred")["metrics"] == _metrics(tmp_path / "gen")["metrics"]


def test_eval_coco_references_and_vitattn_caption_predictions(caption_run, tmp_path):
    run, _ = caption_run
    coco = make_coco(tmp_path / "coco")
    refs_file, image_dir = coco["val_annotations"], coco["image_dir"]
    base = [f"model={run}", f"references={refs_file}", f"image_dir={image_dir}", *FAST]
    assert eval_main([*base, f"out={tmp_path / 'gen'}"]) == 0
    generated = _metrics(tmp_path / "gen")
    assert (
        generated["data"] == str(refs_file) and set(generated["metrics"]) == CAPTION_KEYS
    )  # no exact match on free text
    coco_json = json.loads(refs_file.read_text())
    bundle = load_bundle(run)
    inputs = [InputImage(str(image_dir / im["file_name"]), im["id"]) for im in coco_json["images"]]
    captions = [r["caption"] for r in caption_images(bundle, inputs, **bundle.generate)]
    references = [
        [a["caption"] for a in coco_json["annotations"] if a["image_id"] == im["id"]] for im in coco_json["images"]
    ]
    expected = compute_caption_metrics(captions, references)
    assert {k: generated["metrics"][k] for k in expected} == pytest.approx(expected, rel=1e-12)
    # the same captions through vitattn-caption's JSON Lines, scored by image id
    assert (
        caption_main(
            [f"model={run}", f"images={refs_file}", f"image_dir={image_dir}", f"out={tmp_path / 'c.jsonl'}", *FAST]
        )
        == 0
    )
    assert eval_main([*base[:2], f"predictions={tmp_path / 'c.jsonl'}", f"out={tmp_path / 'pred'}", *FAST]) == 0
    assert _metrics(tmp_path / "pred")["metrics"] == generated["metrics"]


def test_eval_takes_coco_and_image_folder_data_from_the_run_config(caption_run, classifier_run, tmp_path):
    coco = make_coco(tmp_path / "coco")
    folder = make_image_folder(tmp_path / "folder", classes=("blue square", "red circle"), per_class=2, size=40)
    runs = {
        "coco": (
            caption_run[0],
            {
                "_target_": "vitattn.training.datamodules.CocoCaptionDataModule",
                **{k: str(v) for k, v in coco.items()},
                "test_annotations": None,
            },
            [f"references={coco['val_annotations']}", f"image_dir={coco['image_dir']}"],
        ),
        "folder": (
            classifier_run,
            {"_target_": "vitattn.training.datamodules.ImageFolderDataModule", "root": str(folder)},
            [f"data_root={folder}"],
        ),
    }
    for name, (trained, data, explicit) in runs.items():
        run = tmp_path / f"{name}_run"
        shutil.copytree(trained / "bundle", run / "bundle")
        OmegaConf.save(OmegaConf.create({"data": data}), run / "config.yaml")
        assert (
            eval_main([f"model={run}", "split=test", *FAST]) == 0
        )  # no test annotations / folder: val, as in training
        assert eval_main([f"model={run / 'bundle'}", *explicit, f"out={tmp_path / name}", *FAST]) == 0
        from_run, given = _metrics(run / "eval-test"), _metrics(tmp_path / name)
        assert from_run["metrics"] == given["metrics"] and from_run["data"] == given["data"]


def _hand_count(logits: torch.Tensor, labels: list[int]) -> tuple[float, float]:
    top5 = logits.topk(5, dim=-1).indices  # (I, 5)
    hits1 = sum(int(row[0]) == y for row, y in zip(top5, labels))
    hits5 = sum(y in row.tolist() for row, y in zip(top5, labels))
    return hits1 / len(labels), hits5 / len(labels)


def _check_confusion(out: Path, num_images: int, top1: float) -> None:
    with Image.open(out / "confusion_matrix.png") as image:
        image.verify()
        assert image.format == "PNG" and min(image.size) > 100
    table = json.loads((out / "confusion_matrix.json").read_text())
    matrix = np.array(table["matrix"])
    assert table["class_names"] == CLASS_NAMES and matrix.shape == (15, 15)
    assert matrix.sum() == num_images and np.trace(matrix) / num_images == pytest.approx(top1)


def test_eval_classification_on_the_run_split(classifier_run, tmp_path, capsys):
    assert eval_main([f"model={classifier_run}", "split=test", f"out={tmp_path}", *FAST]) == 0
    report = _metrics(tmp_path)
    assert (report["task"], report["split"], report["decoding"]) == ("classification", "test", {})
    data = ShapesDataset("test", 16, img_size=32, seed=0, task="classification", transform=normalize())
    images = torch.stack([data[i][0] for i in range(16)])
    with torch.no_grad():
        logits = load_bundle(classifier_run).model(images)
    labels = [data.label(i) for i in range(16)]
    top1, top5 = _hand_count(logits, labels)
    assert report["metrics"] == {"top1": pytest.approx(top1), "top5": pytest.approx(top5), "num_images": 16}
    _check_confusion(tmp_path, 16, top1)
    # per class: the share of each class's images whose top prediction is that class, counted by hand
    predicted = logits.argmax(dim=-1).tolist()
    by_hand = {}
    for y, p in zip(labels, predicted):
        by_hand.setdefault(CLASS_NAMES[y], []).append(p == y)
    table = json.loads((tmp_path / "confusion_matrix.json").read_text())["per_class"]
    assert [row["class"] for row in table] == CLASS_NAMES
    for row in table:
        hits = by_hand.get(row["class"], [])
        assert row["images"] == len(hits)
        assert row["accuracy"] == (pytest.approx(sum(hits) / len(hits)) if hits else None)
    printed = capsys.readouterr().out
    assert "per class: accuracy (images)" in printed
    name, hits = next(iter(by_hand.items()))
    assert f"    {name:<26} {sum(hits) / len(hits):>8.4f}  ({len(hits)})" in printed


def test_eval_classification_on_an_image_folder_maps_classes_by_name(classifier_run, tmp_path):
    root = make_image_folder(tmp_path / "folder", classes=("blue square", "red circle"), per_class=4, size=40)
    (root / "val" / "red circle" / "broken.png").write_bytes(b"not a png")
    out = tmp_path / "eval"
    assert (
        eval_main([f"model={classifier_run}", f"data_root={root}", f"out={out}", "batch_size=3", *FAST]) == 1
    )  # one unreadable
    metrics = _metrics(out)["metrics"]
    bundle = load_bundle(classifier_run)
    paths = sorted((root / "val").glob("*/[0-9].png"))
    images = torch.stack([bundle.transform(read_image(p)) for p in paths])
    with torch.no_grad():
        logits = bundle.model(images)
    top1, top5 = _hand_count(logits, [CLASS_NAMES.index(p.parent.name) for p in paths])
    assert metrics == {"top1": pytest.approx(top1), "top5": pytest.approx(top5), "num_images": 8, "num_failed": 1}
    _check_confusion(out, 8, top1)


def test_eval_usage_errors_are_one_line(caption_run, classifier_run, tmp_path, capsys):
    run, _ = caption_run
    bundle_only = tmp_path / "bundle"
    b = load_bundle(run)
    save_bundle(bundle_only, b.model, task="caption", preprocess=b.preprocess, vocab=b.vocab)
    (tmp_path / "p.jsonl").write_text('{"image_id": 99, "caption": "a red circle"}\n')
    cases = [
        (["model=m", "splitt=val"], "unknown key 'splitt'; did you mean 'split'?"),
        (["model=m", "split=train"], "split='train' is unknown"),
        (["split=val"], "missing model=..."),
        (["model=m", "predictions=p", "num_beams=3"], "predictions= scores captions already made"),
        (["model=nowhere"], "model not found: nowhere"),
        ([f"model={bundle_only}"], "not inside a training run"),
        ([f"model={run}", f"data_root={tmp_path}"], "data_root= is for classifiers"),
        ([f"model={run}", f"image_dir={tmp_path}"], "goes with references=COCO_JSON"),
        ([f"model={run}", f"predictions={tmp_path / 'p.jsonl'}"], "image ids that"),
        ([f"model={run}", f"predictions={tmp_path / 'none.jsonl'}"], "predictions file not found"),
        ([f"model={classifier_run}", "num_beams=2"], "apply to caption models"),
        ([f"model={classifier_run}", f"data_root={tmp_path}"], f"image folder not found: {tmp_path / 'val'}"),
    ]
    for args, message in cases:
        assert eval_main([*args, f"out={tmp_path / 'out'}", *FAST]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and message in err[-1], (args, err[-1])
    assert not (tmp_path / "out").exists()


def test_eval_scorer_on_a_classifier_is_a_usage_error(classifier_run, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("vitattn.cli.evaluate.check_toolkit", lambda: None)  # whether Java is here is not the point
    assert eval_main([f"model={classifier_run}", "scorer=coco", f"out={tmp_path / 'out'}", *FAST]) == 2
    assert "scorer apply to caption models" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("which", ["caption_run", "classifier_run"])
def test_export_checkpoint_equals_the_runs_own_bundle(which, request, tmp_path):
    run = request.getfixturevalue(which)
    run = run[0] if isinstance(run, tuple) else run
    out = tmp_path / "exported"
    assert export_main([f"model={run / 'checkpoints' / 'last.ckpt'}", f"out={out}"]) == 0
    files = {p.name for p in out.iterdir()}
    assert files == (
        {"config.json", "model.safetensors", "vocab.json"}
        if which == "caption_run"
        else {"config.json", "model.safetensors"}
    )
    assert json.loads((out / "config.json").read_text()) == json.loads((run / "bundle" / "config.json").read_text())
    ours, theirs = load_file(out / "model.safetensors"), load_file(run / "bundle" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert export_main([f"model={out}", f"out={out}"]) == 0  # a bundle re-exported in place
    assert load_bundle(out).task == ("caption" if which == "caption_run" else "classification")


class _Trap:
    """Unpickling this creates ``path``: the sign that a checkpoint was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_export_refuses_pickled_checkpoints_without_unpickling(caption_run, tmp_path, capsys):
    run, _ = caption_run
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["hyper_parameters"]["trap"] = _Trap(tmp_path / "unpickled")
    torch.save(checkpoint, tmp_path / "pickled.ckpt")
    assert export_main([f"model={tmp_path / 'pickled.ckpt'}", f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "contains pickled objects" in err[-1]
    assert not (tmp_path / "unpickled").exists() and not (tmp_path / "out").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    assert export_main([f"model={run}", f"out={tmp_path / 'taken'}"]) == 2
    assert "is not a vitattn bundle" in capsys.readouterr().err
    assert export_main([f"model={run}"]) == 2 and "missing out=..." in capsys.readouterr().err


@pytest.mark.parametrize(
    "script,usage",
    [("vitattn-eval", "vitattn-eval model=PATH"), ("vitattn-export", "vitattn-export model=PATH out=DIR")],
)
def test_console_scripts_print_their_usage(script, usage):
    path = console_script(script)
    proc = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and usage in proc.stdout


def _declared_console_scripts() -> list[str]:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    return sorted(tomllib.loads(pyproject.read_text())["project"]["scripts"])


@pytest.mark.parametrize("script", _declared_console_scripts())
def test_every_declared_console_script_is_in_the_venv(script):
    assert console_script(script).is_file()  # a missing one fails here, naming it, rather than skipping a test


def test_more_than_20_classes_print_the_20_weakest_and_write_every_row(tmp_path):
    from vitattn.evaluation import EvalReport, format_report, write_report

    generator = torch.Generator().manual_seed(0)
    confusion = torch.randint(0, 6, (25, 25), generator=generator)  # rows true, columns predicted; not symmetric
    confusion[3] = 0  # a class without images: no accuracy, and never among the weakest
    names = [f"class {i:02d}" for i in range(25)]
    top1 = float(confusion.diagonal().sum() / confusion.sum())
    report = EvalReport("classification", "test", "folder", {"top1": top1, "num_images": int(confusion.sum())})
    report.confusion, report.class_names = confusion, names
    write_report(report, tmp_path, model="m")
    table = json.loads((tmp_path / "confusion_matrix.json").read_text())["per_class"]
    by_hand = [
        (n, int(row.sum()), int(row[i]) / int(row.sum()) if row.sum() else None)
        for i, (n, row) in enumerate(zip(names, confusion))
    ]
    assert [(r["class"], r["images"]) for r in table] == [(n, k) for n, k, _ in by_hand]
    assert [r["accuracy"] for r in table] == [pytest.approx(a) if a is not None else None for _, _, a in by_hand]
    printed = format_report(report).split("per class: accuracy (images)")[1].splitlines()
    assert printed[0] == ", the 20 weakest of 25 (all in confusion_matrix.json)"
    weakest = sorted((r for r in by_hand if r[2] is not None), key=lambda r: r[2])[:20]
    assert printed[1:] == [f"    {n:<26} {a:>8.4f}  ({k})" for n, k, a in weakest]
