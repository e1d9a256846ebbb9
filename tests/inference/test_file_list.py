"""What to caption: ``list_inputs`` over folders, globs, text lists, COCO files and paths."""

import json
import os
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers.images import write_good_images
from vitattn.inference import InputList, list_inputs


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


def test_list_inputs_walks_folders_without_following_links(tmp_path):
    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / ".hidden").mkdir()
    for p in ("a/1.png", "a/deep/2.JPG", "b.gif", ".hidden/3.png", ".4.png", "notes.txt"):
        (tmp_path / p).write_bytes(b"")
    (tmp_path / "a" / "loop").symlink_to(tmp_path)
    listed = list_inputs(tmp_path)
    assert isinstance(listed, InputList) and listed.ids is None
    assert listed.paths == sorted(str(tmp_path / p) for p in ("a/1.png", "a/deep/2.JPG", "b.gif"))
    assert [x.image_id for x in listed] == [0, 1, 2] and listed[1].path == listed.paths[1]


def test_list_inputs_names_a_folder_it_cannot_read(tmp_path, monkeypatch):
    (tmp_path / "a" / "locked").mkdir(parents=True)
    (tmp_path / "a" / "1.png").write_bytes(b"")
    scandir = os.scandir

    def refuse(path):
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", str(path))  # as os.scandir names it
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refuse)
    with pytest.raises(ValueError) as err:
        list_inputs(tmp_path)  # not a list without the locked folder's images
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"images={tmp_path}: cannot read the folder ")
    assert str(tmp_path / "a" / "locked") in message and "Permission denied" in message
