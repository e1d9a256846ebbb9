"""``merge_tokens=R`` on vitattn-caption, vitattn-eval and vitattn-serve: each runs the shared captioner (trained
without merging) with R, as ``Captioner.load(merge_tokens=R)`` runs it; a bad or too large R is one line."""

import json
from pathlib import Path

import pytest
from PIL import Image

import vitattn.serve
from vitattn import Captioner
from vitattn.cli import caption as caption_cli
from vitattn.cli import evaluate as evaluate_cli
from vitattn.cli import serve as serve_cli
from vitattn.data.shapes import ShapesDataset
from vitattn.inference.api import to_pixels

R = 8  # of the shared run's 17 tokens: 8, then the 4 the second layer can (5 left)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Path]:
    """24 shapes images as PNG files."""
    folder = tmp_path_factory.mktemp("photos")
    data = ShapesDataset("test", 24, img_size=32, seed=1, task="caption")
    for i in range(len(data)):
        Image.fromarray(data.image(i).permute(1, 2, 0).numpy()).save(folder / f"{i:02d}.png")
    return sorted(folder.iterdir())


@pytest.fixture(scope="module")
def captions(shapes_caption_run, photos) -> dict:
    """The Python API's captions of ``photos``: unmerged (None) and with ``merge_tokens=R``; they differ."""
    found = {m: Captioner.load(shapes_caption_run, merge_tokens=m).caption(photos) for m in (None, R)}
    assert found[None] != found[R]
    return found


def test_vitattn_caption_captions_with_the_merge_tokens_given(shapes_caption_run, photos, captions, tmp_path):
    out = tmp_path / "captions.jsonl"
    argv = [f"model={shapes_caption_run}", f"images={photos[0].parent}", f"out={out}", f"merge_tokens={R}"]
    assert caption_cli.main([*argv, "num_workers=0", "progress=false"]) == 0
    written = {Path(r["image"]).name: r["caption"] for r in map(json.loads, out.read_text().splitlines())}
    assert [written[p.name] for p in photos] == captions[R]


def test_vitattn_eval_scores_and_reports_the_merge_tokens_given(shapes_caption_run, tmp_path, capsys):
    common = [f"model={shapes_caption_run}", "split=val", "num_workers=0", "progress=false"]
    assert evaluate_cli.main([*common, f"out={tmp_path / 'plain'}"]) == 0
    assert "token merging" not in capsys.readouterr().out
    assert evaluate_cli.main([*common, f"out={tmp_path / 'merged'}", f"merge_tokens=[{R},2]"]) == 0
    assert f"\ntoken merging (ToMe): merge_tokens=[{R},2]\n" in capsys.readouterr().out
    reports = {name: json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("plain", "merged")}
    assert (reports["plain"]["merge_tokens"], reports["merged"]["merge_tokens"]) == (0, [R, 2])
    scored = {name: (tmp_path / name / "captions.jsonl").read_text() for name in ("plain", "merged")}
    assert scored["plain"] != scored["merged"]


def test_vitattn_serves_with_the_merge_tokens_given(shapes_caption_run, photos, captions, monkeypatch):
    class Served(Exception):
        pass

    workers = []

    def no_server(apis, **kwargs):
        for api in apis:
            api.setup("cpu")  # what each inference worker does
        workers.extend(apis)
        raise Served

    monkeypatch.setattr(vitattn.serve, "build_server", no_server)
    with pytest.raises(Served):
        serve_cli.run(serve_cli.parse_args([f"model={shapes_caption_run}", f"merge_tokens={R}"]))
    assert [api.api_path for api in workers] == ["/predict", "/classify"]
    assert [api.bundle.merge_tokens for api in workers] == [R, R]
    pixels = to_pixels(photos, workers[0].transform)
    assert workers[0].captioner.caption_pixels(pixels)[0] == captions[R]


def test_a_bad_or_too_large_merge_tokens_is_one_line(shapes_caption_run, photos, tmp_path, capsys):
    model = f"model={shapes_caption_run}"
    for main, argv in [
        (caption_cli.main, [model, f"images={photos[0]}", f"out={tmp_path / 'c.jsonl'}"]),
        (evaluate_cli.main, [model, f"out={tmp_path / 'eval'}"]),
        (serve_cli.main, [model]),
    ]:
        assert main([*argv, "merge_tokens=half"]) == 2
        assert capsys.readouterr().err == (
            "error: merge_tokens='half' must be the tokens each encoder layer merges (ToMe), a whole number "
            "(0: off) or one per layer as [8,8,4,4]\n"
        )
        assert main([*argv, "merge_tokens=9"]) == 2  # refused as the model loads, before anything runs
        assert capsys.readouterr().err == "error: merge_tokens=9 is too large for 17 tokens: at most 8\n"
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text('{"image_id": 0, "caption": "a red circle"}\n')
    assert evaluate_cli.main([model, f"predictions={predictions}", "merge_tokens=4"]) == 2
    assert capsys.readouterr().err == (
        "error: merge_tokens set how captions are generated; predictions= scores captions already made\n"
    )
