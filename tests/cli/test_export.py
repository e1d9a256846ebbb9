"""``vitattn-export format=hub``: a folder that round-trips through the Hub cache, and a card that tells the run."""

import json
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import ModelCard

from tests.helpers.bundles import put_in_hub_cache
from vitattn import Captioner
from vitattn.cli.export import main as export_main

IMAGES = [np.full((32, 32, 3), v, np.uint8) for v in (0, 90, 180, 255)]


@pytest.fixture
def caption_run(small_caption_run):
    """The shared small captioner (tests/conftest.py), validated and tested: its ``result.json`` holds metrics."""
    return small_caption_run


def test_a_hub_folder_round_trips_and_its_card_has_the_runs_numbers(caption_run, tmp_path, hub_cache, no_network):
    out = tmp_path / "hub"
    assert export_main([f"model={caption_run}", f"out={out}", "format=hub", "license=mit"]) == 0
    put_in_hub_cache(hub_cache, "org/tiny", out)
    assert Captioner.load("hf-hub:org/tiny").caption(IMAGES) == Captioner.load(caption_run).caption(IMAGES)
    card = ModelCard.load(out / "README.md")
    assert (card.data.library_name, card.data.pipeline_tag, card.data.license) == ("vitattn", "image-to-text", "mit")
    section = card.text.split("## Test metrics", 1)[1].split("\n## ", 1)[0]
    rows = [r.strip("|").split("|") for r in section.splitlines() if r.startswith("| ") and "---" not in r][1:]
    result = json.loads((caption_run / "result.json").read_text())
    assert {k.strip(): float(v) for k, v in rows} == result["metrics"]


def test_a_hub_onnx_folder_round_trips_and_captions_as_pytorch(caption_run, tmp_path, hub_cache, no_network):
    out = tmp_path / "hub"
    assert export_main([f"model={caption_run}", f"out={out}", "format=hub", "hub_format=onnx"]) == 0
    put_in_hub_cache(hub_cache, "org/tiny-onnx", out)
    loaded = Captioner.load("hf-hub:org/tiny-onnx")
    assert (loaded.runtime, loaded.precision) == ("onnx", "fp32")
    assert loaded.caption(IMAGES) == Captioner.load(caption_run).caption(IMAGES)
    assert ModelCard.load(out / "README.md").data.library_name == "vitattn"


def test_push_to_hub_uploads_the_whole_folder_with_its_card(caption_run, tmp_path, monkeypatch, capsys, no_network):
    from huggingface_hub import HfApi

    calls = []
    monkeypatch.setattr(
        HfApi,
        "create_repo",
        lambda self, repo_id, **kw: calls.append(("create", repo_id, kw)) or (f"https://huggingface.co/{repo_id}"),
    )

    def upload_folder(self, repo_id, folder_path, **kw):
        calls.append(("upload", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    out = tmp_path / "hub"
    assert export_main([f"model={caption_run}", f"out={out}", "format=hub", "push_to_hub=org/tiny"]) == 0
    (create, repo_id, kw), upload = calls
    assert (create, repo_id, kw["repo_type"], kw["private"]) == ("create", "org/tiny", "model", False)
    assert upload == ("upload", "org/tiny", sorted(p.name for p in out.iterdir()))
    assert "README.md" in upload[2] and len(upload[2]) > 1
    assert "uploaded to https://huggingface.co/org/tiny" in capsys.readouterr().out


def test_push_to_hub_offline_is_one_line_exit_2(caption_run, tmp_path, hub_offline, capsys):
    args = [f"model={caption_run}", f"out={tmp_path / 'hub'}", "format=hub", "push_to_hub=org/tiny"]
    assert export_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "HF_HUB_OFFLINE" in err and "\n" not in err
