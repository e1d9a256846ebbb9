import csv
import json
import os
import random
import struct
import subprocess
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import console_script, make_caption_bundle
from vitattn.bundle import load_bundle
from vitattn.cli.caption import main
from vitattn.data.images import BadImageError
from vitattn.inference import caption_images, caption_to_file, list_inputs, read_image, read_records


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    return make_caption_bundle(tmp_path_factory.mktemp("model") / "bundle")


def _png_header(path: Path, width: int, height: int) -> None:
    """A PNG that declares ``width x height`` 1-bit pixels and holds none: a decompression bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))


def write_good_images(folder: Path) -> dict[str, tuple]:
    """One image of every mode the reader must convert; name -> (expected size, expected pixel (x, y) -> RGB)."""
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30), (200, 30, 30)).save(folder / "rgb.jpg", quality=95)
    Image.new("L", (30, 30), 128).save(folder / "gray.png")
    rgba = Image.new("RGBA", (30, 30), (0, 0, 255, 255))
    rgba.paste((0, 0, 0, 0), (0, 0, 15, 30))  # left half fully transparent
    rgba.save(folder / "rgba.png")
    Image.new("RGB", (30, 30), (0, 200, 0)).convert("P", palette=Image.Palette.ADAPTIVE).save(folder / "palette.png")
    Image.new("CMYK", (30, 30), (0, 255, 255, 0)).save(folder / "cmyk.jpg", quality=95)
    Image.fromarray(np.array([[0, 32896, 65535] * 10] * 30, dtype=np.uint16)).save(folder / "gray16.png")
    rotated = Image.new("RGB", (40, 20), (10, 10, 200))
    exif = rotated.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display
    rotated.save(folder / "exif_rotated.jpg", exif=exif, quality=95)
    frames = [Image.new("RGB", (30, 30), c) for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(folder / "animated.gif", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return {
        "rgb.jpg": ((40, 30), {(5, 5): (200, 30, 30)}),
        "gray.png": ((30, 30), {(5, 5): (128, 128, 128)}),
        "rgba.png": ((30, 30), {(2, 2): (255, 255, 255), (25, 2): (0, 0, 255)}),
        "palette.png": ((30, 30), {(5, 5): (0, 200, 0)}),
        "cmyk.jpg": ((30, 30), {(5, 5): (255, 0, 0)}),
        "gray16.png": ((30, 30), {(0, 0): (0, 0, 0), (1, 0): (128, 128, 128), (2, 0): (255, 255, 255)}),
        "exif_rotated.jpg": ((20, 40), {(5, 5): (10, 10, 200)}),
        "animated.gif": ((30, 30), {(5, 5): (255, 0, 0)}),
    }


def write_bad_images(folder: Path) -> dict[str, str]:
    """One file of every kind that cannot be captioned; name -> a word the error must contain."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0" + random.Random(0).randbytes(300))
    Image.effect_noise((64, 64), 50).convert("RGB").save(folder / "truncated.png")
    whole = (folder / "truncated.png").read_bytes()
    (folder / "truncated.png").write_bytes(whole[: len(whole) // 2])
    (folder / "empty.png").write_bytes(b"")
    (folder / "notes.jpg").write_text("this is not an image\n")
    _png_header(folder / "bomb.png", 30_000, 30_000)  # over twice the limit: DecompressionBombError
    _png_header(folder / "bomb_warning.png", 10_000, 10_000)  # over the limit: a warning PIL would let pass
    (folder / "folder.png").mkdir()
    return {
        "corrupt.jpg": "",
        "truncated.png": "truncated",
        "empty.png": "empty",
        "notes.jpg": "not an image",
        "bomb.png": "decompression",
        "bomb_warning.png": "decompression",
        "folder.png": "directory",
    }


def test_read_image_converts_every_mode(tmp_path):
    for name, (size, pixels) in write_good_images(tmp_path).items():
        image = read_image(tmp_path / name)
        assert image.mode == "RGB" and image.size == size, name
        for xy, rgb in pixels.items():
            assert np.abs(np.subtract(image.getpixel(xy), rgb)).max() <= 6, (name, xy, image.getpixel(xy))


def test_read_image_refuses_decompression_bombs(tmp_path):
    _png_header(tmp_path / "warn.png", 10_000, 10_000)
    with pytest.raises(BadImageError, match="warn.png: decompression bomb refused: .*decompression bomb DOS attack"):
        read_image(tmp_path / "warn.png")
    skipped = read_image(tmp_path / "warn.png", on_error="skip")
    assert isinstance(skipped, BadImageError) and skipped.reason.startswith("decompression bomb refused")


def test_list_inputs_kinds(tmp_path):
    write_good_images(tmp_path / "imgs")
    (tmp_path / "imgs" / "sub").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "sub" / "deep.png")
    (tmp_path / "imgs" / "readme.txt").write_text("skip me")
    listed = list_inputs(tmp_path / "imgs")
    assert [x.path for x in listed] == sorted(x.path for x in listed) and [x.image_id for x in listed] == list(range(9))
    assert str(tmp_path / "imgs" / "sub" / "deep.png") in {x.path for x in listed}
    assert len(list_inputs(str(tmp_path / "imgs" / "*.png"))) == 4
    (tmp_path / "list.txt").write_text("# images\nrgb.jpg\n\ngray.png\nrgb.jpg\n")
    assert [x.path for x in list_inputs(tmp_path / "list.txt", image_dir=tmp_path / "imgs")] == [
        str(tmp_path / "imgs" / "gray.png"),
        str(tmp_path / "imgs" / "rgb.jpg"),
    ]
    coco = {"images": [{"id": 42, "file_name": "rgb.jpg"}, {"id": 7, "file_name": "gray.png"}], "annotations": []}
    (tmp_path / "imgs" / "val.json").write_text(json.dumps(coco))
    assert [(Path(x.path).name, x.image_id) for x in list_inputs(tmp_path / "imgs" / "val.json")] == [
        ("rgb.jpg", 42),
        ("gray.png", 7),
    ]
    with pytest.raises(FileNotFoundError, match="missing: no such folder, file or glob"):
        list_inputs(tmp_path / "missing")
    with pytest.raises(ValueError, match="matches no files"):
        list_inputs(str(tmp_path / "*.webp"))


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
    return [json.loads(line) for line in path.read_text().splitlines()]


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
    summary = caption_to_file(load_bundle(bundle_dir), inputs, tmp_path / "out.jsonl", num_workers=0, progress=False)
    assert (summary.captioned, summary.failed) == (len(inputs) - 1, 1)
    record = read_records(tmp_path / "out.jsonl")[str(tmp_path / "imgs" / "gray.png")]
    assert record["error"] == "file not found"


def test_rerun_after_an_interrupted_run_records_each_image_once(bundle_dir, tmp_path, capsys):
    folder = tmp_path / "imgs"
    names = write_good_images(folder)
    out = tmp_path / "captions.jsonl"
    args = [f"model={bundle_dir}", f"images={folder}", f"out={out}", "batch_size=2", "num_workers=0", "progress=false"]
    assert main(args) == 0
    complete = out.read_text().splitlines(keepends=True)
    # A run killed half way: three whole lines, then half of the fourth.
    out.write_text("".join(complete[:3]) + complete[3][: len(complete[3]) // 2])
    assert main(args) == 0
    lines = out.read_text().splitlines(keepends=True)
    assert lines[:3] == complete[:3]  # finished records were kept, not redone
    counts = Counter(r["image"] for r in _jsonl(out))
    assert set(counts) == {str(folder / n) for n in names} and set(counts.values()) == {1}
    assert sorted(lines) == sorted(complete)  # same captions as the uninterrupted run
    assert main(args) == 0  # nothing left to do: the file is unchanged
    assert out.read_text().splitlines(keepends=True) == lines
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
    assert not (tmp_path / "res.json.partial.jsonl").exists()
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


def test_coco_output_resumes_from_its_partial_file(bundle_dir, tmp_path):
    folder = tmp_path / "imgs"
    write_good_images(folder)
    out = tmp_path / "res.json"
    partial = tmp_path / "res.json.partial.jsonl"
    record = {"image": str(folder / "animated.gif"), "image_id": 0, "caption": "kept from the first run"}
    partial.write_text(json.dumps(record) + "\n" + '{"image": "cut')
    assert (
        main(
            [f"model={bundle_dir}", f"images={folder}", f"out={out}", "format=coco", "num_workers=0", "progress=false"]
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert len(results) == 8 and results[0] == {"image_id": 0, "caption": "kept from the first run"}
    assert [r["image_id"] for r in results] == list(range(8)) and not partial.exists()


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
        (["model=m", "images=i", "out=o", "format=xml"], "format='xml' is unknown"),
        (["model=m", "images=i", "out=o", "--fast"], "is not key=value"),
        (["model=nowhere", "images=i", "out=o"], "model not found: nowhere"),
    ],
)
def test_cli_usage_errors_are_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]


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
            summary = caption_to_file(bundle, list_inputs(folder), out, format=fmt, num_workers=0, progress=False)
            assert (summary.captioned, summary.failed) == (3, 0)
    assert sorted(read_records(tmp_path / "out.jsonl")) == sorted(str(folder / n) for n in names)
    assert len((tmp_path / "out.jsonl").read_text(errors="replace").splitlines()) == 3
    with open(tmp_path / "out.csv", newline="", encoding="utf-8", errors="surrogateescape") as f:
        assert sorted(r["image"] for r in csv.DictReader(f)) == sorted(str(folder / n) for n in names)


def test_a_second_run_on_the_same_output_is_refused(bundle_dir, tmp_path):
    import fcntl

    Image.new("RGB", (20, 20)).save(tmp_path / "x.png")
    out = tmp_path / "out.jsonl"
    with open(out, "ab") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(ValueError, match="being written by another run"):
            caption_to_file(
                load_bundle(bundle_dir), list_inputs(tmp_path / "x.png"), out, num_workers=0, progress=False
            )


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
