"""Captioning image files: records of good and bad images, the output formats, a run stopped half way
resumed chunk by chunk, and the command line's errors. (The image reader's own tests are here too.)"""

import csv
import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitattn.inference.captioning as captioning
from tests.helpers.images import png_header, write_bad_images, write_good_images
from tests.helpers.runs import console_script
from vitattn.bundle import load_bundle
from vitattn.cli.caption import main
from vitattn.data.images import BadImageError, read_image
from vitattn.inference import caption_files, caption_images, list_inputs
from vitattn.models import ImageCaptioner


def test_read_image_converts_every_mode(tmp_path):
    for name, (size, pixels) in write_good_images(tmp_path).items():
        image = read_image(tmp_path / name)
        assert image.mode == "RGB" and image.size == size, name
        for xy, rgb in pixels.items():
            assert np.abs(np.subtract(image.getpixel(xy), rgb)).max() <= 6, (name, xy, image.getpixel(xy))


def test_read_image_refuses_decompression_bombs(tmp_path):
    png_header(tmp_path / "warn.png", 10_000, 10_000)
    with pytest.raises(BadImageError, match="warn.png: decompression bomb refused: .*decompression bomb DOS attack"):
        read_image(tmp_path / "warn.png")
    skipped = read_image(tmp_path / "warn.png", on_error="skip")
    assert isinstance(skipped, BadImageError) and skipped.reason.startswith("decompression bomb refused")


def test_caption_images_matches_generate(bundle_dir, tmp_path):
    bundle = load_bundle(bundle_dir)
    write_good_images(tmp_path)
    paths = [tmp_path / "rgb.jpg", tmp_path / "gray16.png", tmp_path / "nothing.png"]
    records = caption_images(bundle, paths, batch_size=2, num_beams=2)
    images = torch.stack([bundle.transform(read_image(p)) for p in paths[:2]])
    expected = bundle.vocab.decode_batch(bundle.model.generate(images, num_beams=2))
    assert [r.get("caption") for r in records] == [*expected, None]
    assert records[2] == {"image": str(paths[2]), "image_id": 2, "error": "file not found"}
    assert all(r["caption"] for r in records[:2])


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().decode("utf-8").splitlines()]


def _by_image(path: Path) -> dict[str, dict]:
    return {r["image"]: r for r in _jsonl(path)}


_GENERATE = ImageCaptioner.generate


def _count_generated(monkeypatch, fail_at: int | None = None) -> list[int]:
    """Images given to each ``generate`` call, and (``fail_at``) an interruption at that call: a run stopped
    half way, as by a kill, after some chunks were written."""
    calls: list[int] = []

    def counted(self, images, **kwargs):
        if fail_at is not None and len(calls) == fail_at:
            raise RuntimeError("stopped half way")
        calls.append(len(images))
        return _GENERATE(self, images, **kwargs)

    monkeypatch.setattr(ImageCaptioner, "generate", counted)
    return calls


def test_cli_captions_good_images_and_records_bad_ones(bundle_dir, tmp_path, capsys):
    folder = tmp_path / "mixed"
    good = write_good_images(folder)
    bad = write_bad_images(folder)
    out = tmp_path / "out" / "captions.jsonl"
    status = main(
        [f"model={bundle_dir}", f"images={folder}", f"out={out}", "batch_size=3", "num_workers=2", "progress=false"]
    )
    assert status == 1
    assert f"captioned {len(good)} images, {len(bad)} failed -> {out}" in capsys.readouterr().out
    records = {Path(r["image"]).name: r for r in _jsonl(out)}
    assert set(records) == set(good) | set(bad)
    for name in good:
        assert records[name]["caption"] and "error" not in records[name], records[name]
    for name, word in bad.items():
        error = records[name].get("error", "")
        assert "caption" not in records[name] and error and "\n" not in error and word in error.lower(), (name, error)


def test_vanished_file_gets_an_error_record(bundle_dir, tmp_path):
    write_good_images(tmp_path / "imgs")
    inputs = list_inputs(tmp_path / "imgs")
    (tmp_path / "imgs" / "gray.png").unlink()  # gone between listing and reading
    summary = caption_files(load_bundle(bundle_dir), inputs, tmp_path / "out.jsonl", num_workers=0, progress=False)
    assert (summary.captioned, summary.failed) == (len(inputs) - 1, 1)
    record = _by_image(tmp_path / "out.jsonl")[str(tmp_path / "imgs" / "gray.png")]
    assert record["error"] == "file not found"


def test_rerun_after_an_interrupted_run_records_each_image_once(bundle_dir, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "imgs"
    names = write_good_images(folder)
    monkeypatch.setattr(captioning, "CHUNK_BATCHES", 2)  # chunks of 2 images at batch_size=1: 4 of them
    args = ["batch_size=1", "num_workers=0", "progress=false", f"model={bundle_dir}", f"images={folder}"]
    whole = tmp_path / "whole.jsonl"
    assert main([*args, f"out={whole}"]) == 0
    complete = whole.read_text().splitlines(keepends=True)

    out = tmp_path / "captions.jsonl"
    _count_generated(monkeypatch, fail_at=5)  # stopped in the third chunk: two are written
    with pytest.raises(RuntimeError, match="stopped half way"):
        main([*args, f"out={out}"])
    assert not out.exists() and len(list((tmp_path / "captions.jsonl.parts").glob("*.jsonl"))) == 2
    calls = _count_generated(monkeypatch)
    assert main([*args, f"out={out}"]) == 0
    assert sum(calls) == 4  # the images of the two finished chunks were kept, not redone
    lines = out.read_text().splitlines(keepends=True)
    assert lines == complete  # the same records, in input order, as the uninterrupted run
    counts = Counter(r["image"] for r in _jsonl(out))
    assert set(counts) == {str(folder / n) for n in names} and set(counts.values()) == {1}
    assert not (tmp_path / "captions.jsonl.parts").exists()
    before = out.stat()
    assert main([*args, f"out={out}"]) == 0 and sum(calls) == 4  # nothing left to do: nothing captioned
    assert out.read_text().splitlines(keepends=True) == lines and out.stat().st_mtime_ns == before.st_mtime_ns
    assert f"captioned {len(names)} images, 0 failed" in capsys.readouterr().out


def test_coco_and_csv_outputs_parse_back(bundle_dir, tmp_path):
    folder = tmp_path / "imgs"
    write_good_images(folder)
    coco = {
        "images": [
            {"id": 101, "file_name": "rgb.jpg"},
            {"id": 205, "file_name": "missing.jpg"},
            {"id": 309, "file_name": "cmyk.jpg"},
        ]
    }
    (tmp_path / "val.json").write_text(json.dumps(coco))
    base = [
        f"model={bundle_dir}",
        f"images={tmp_path / 'val.json'}",
        f"image_dir={folder}",
        "num_workers=0",
        "progress=false",
    ]
    assert main([*base, f"out={tmp_path / 'res.json'}", "format=coco"]) == 1
    results = json.loads((tmp_path / "res.json").read_text())
    assert [r["image_id"] for r in results] == [101, 309]
    assert all(set(r) == {"image_id", "caption"} and isinstance(r["caption"], str) for r in results)
    assert not (tmp_path / "res.json.parts").exists()
    assert main([*base, f"out={tmp_path / 'res.csv'}", "format=csv"]) == 1
    with open(tmp_path / "res.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(Path(r["image"]).name, r["image_id"]) for r in rows] == [
        ("rgb.jpg", "101"),
        ("missing.jpg", "205"),
        ("cmyk.jpg", "309"),
    ]
    assert (
        rows[0]["caption"] == results[0]["caption"] and rows[1]["error"] == "file not found" and not rows[1]["caption"]
    )


def test_coco_output_resumes_from_its_finished_chunks(bundle_dir, tmp_path, monkeypatch):
    folder = tmp_path / "imgs"
    write_good_images(folder)
    monkeypatch.setattr(captioning, "CHUNK_BATCHES", 3)  # chunks of 3, 3 and 2 images
    args = [f"model={bundle_dir}", f"images={folder}", "format=coco", "batch_size=1", "num_workers=0", "progress=false"]
    assert main([*args, f"out={tmp_path / 'whole.json'}"]) == 0
    out = tmp_path / "res.json"
    _count_generated(monkeypatch, fail_at=4)  # the first chunk written, the second not
    with pytest.raises(RuntimeError, match="stopped half way"):
        main([*args, f"out={out}"])
    calls = _count_generated(monkeypatch)
    assert main([*args, f"out={out}"]) == 0 and sum(calls) == 5
    results = json.loads(out.read_text())
    assert results == json.loads((tmp_path / "whole.json").read_text())
    assert [r["image_id"] for r in results] == list(range(8)) and not (tmp_path / "res.json.parts").exists()


def test_cli_sampling_with_a_seed_is_reproducible(bundle_dir, tmp_path):
    folder = tmp_path / "imgs"
    write_good_images(folder)
    args = [
        f"model={bundle_dir}",
        f"images={folder}",
        "do_sample=true",
        "temperature=2.0",
        "top_k=5",
        "seed=3",
        "num_workers=0",
        "progress=false",
    ]
    assert main([*args, f"out={tmp_path / 'a.jsonl'}"]) == 0 and main([*args, f"out={tmp_path / 'b.jsonl'}"]) == 0
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()


@pytest.mark.parametrize(
    "args,message",
    [
        (["model=m", "images=i", "out=o", "beams=3"], "unknown key 'beams'; did you mean 'num_beams'?"),
        (["model=m", "images=i"], "missing out=..."),
        (["model=m", "images=i", "out=o", "batch_size=many"], "batch_size="),
        (["model=m", "images=i", "out=o", "--fast"], "is not key=value"),
        (["model=nowhere", "images=i", "out=o"], "model not found: nowhere"),
    ],
)
def test_cli_usage_errors_are_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]


def test_cli_refuses_an_unknown_format_in_one_line_and_writes_nothing(bundle_dir, tmp_path, capsys):
    """``caption_files`` owns ``format``: the command line reaches it and says its line."""
    Image.new("RGB", (40, 40), (255, 0, 0)).save(tmp_path / "red.png")
    out = tmp_path / "captions.xml"
    assert main([f"model={bundle_dir}", f"images={tmp_path / 'red.png'}", f"out={out}", "format=xml"]) == 2
    assert capsys.readouterr().err == "error: format='xml' is unknown; choose one of ['jsonl', 'coco', 'csv']\n"
    assert sorted(os.listdir(tmp_path)) == ["red.png"]


@pytest.mark.slow
def test_console_script_end_to_end(bundle_dir, tmp_path):
    script = console_script("vitattn-caption")
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (40, 40), (255, 0, 0)).save(folder / "red.png")
    (folder / "broken.jpg").write_bytes(b"nope")
    out = tmp_path / "captions.csv"
    cmd = [
        str(script),
        f"model={bundle_dir}",
        f"images={folder / '*'}",
        f"out={out}",
        "format=csv",
        "device=cpu",
        "num_workers=1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"captioned 1 images, 1 failed -> {out}"
    with out.open(newline="") as f:
        rows = {Path(r["image"]).name: r for r in csv.DictReader(f)}
    assert rows["red.png"]["caption"] and rows["broken.jpg"]["error"]
    help_text = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and "vitattn-caption model=PATH" in help_text.stdout


def test_odd_file_names_are_recorded_once(bundle_dir, tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    names = ["café ☕.png", os.fsdecode(b"latin1-caf\xe9.png"), 'comma, "quote".png']
    for name in names:
        Image.new("RGB", (20, 20), (0, 128, 0)).save(folder / name)
    bundle = load_bundle(bundle_dir)
    for out in (tmp_path / "out.jsonl", tmp_path / "out.csv"):
        fmt = out.suffix[1:]
        for _ in range(2):  # the second run finds every image done
            summary = caption_files(bundle, list_inputs(folder), out, format=fmt, num_workers=0, progress=False)
            assert (summary.captioned, summary.failed) == (3, 0)
    assert sorted(_by_image(tmp_path / "out.jsonl")) == sorted(str(folder / n) for n in names)
    assert len((tmp_path / "out.jsonl").read_text(errors="replace").splitlines()) == 3
    with open(tmp_path / "out.csv", newline="", encoding="utf-8", errors="surrogateescape") as f:
        assert sorted(r["image"] for r in csv.DictReader(f)) == sorted(str(folder / n) for n in names)


def test_a_second_run_on_the_same_output_is_refused(bundle_dir, tmp_path):
    import fcntl

    Image.new("RGB", (20, 20)).save(tmp_path / "x.png")
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.parts").mkdir()
    with open(tmp_path / "out.jsonl.parts" / ".lock", "ab") as held:  # what a run holds while it runs
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(ValueError, match="out.jsonl is being written by another run"):
            caption_files(load_bundle(bundle_dir), list_inputs(tmp_path / "x.png"), out, num_workers=0, progress=False)


def test_cli_num_threads_sets_torch_threads(bundle_dir, tmp_path, monkeypatch):
    import torch

    from vitattn.cli import caption

    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (20, 20), (200, 30, 30)).save(folder / "a.png")
    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    code = caption.main(
        [
            f"model={bundle_dir}",
            f"images={folder}",
            f"out={tmp_path / 'o.jsonl'}",
            "num_threads=1",
            "progress=false",
            "num_workers=0",
        ]
    )
    assert code == 0 and seen == [1]
