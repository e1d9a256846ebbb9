"""The learning and learning-data sections (learning_bench.py, learning_data.py) on tiny data in their format."""

import json
import math
import os

import pytest
from PIL import Image, ImageDraw
from torchvision.datasets import ImageFolder

from benchmarks import cli, learning_bench, learning_data
from benchmarks.report import update_doc
from tests.helpers.runs import compose_train
from vitattn.data import load_coco_captions

COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 220), "green": (40, 170, 60)}


def _shape(colour: str, kind: str, offset: int) -> Image.Image:
    image = Image.new("RGBA", (40 + offset, 40), (0, 0, 0, 0))  # transparent margin, as the stamps have
    box = (offset, 4, offset + 30, 34)
    draw = ImageDraw.Draw(image)
    (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=COLOURS[colour])
    return image


def synthetic_items(per_class: int = 6) -> list:
    """Coloured circles and squares: class = colour, caption = "a <colour> <shape>"."""
    return [
        learning_data.Item(
            f"{kind}{i}",
            colour,
            (f"A {colour} {kind}.",),
            lambda c=colour, k=kind, i=i: _shape(c, k, i),
        )
        for colour in COLOURS
        for i in range(per_class)
        for kind in ("circle", "square")
    ]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning") / "shapes-16px-seed0"
    return learning_data.write_dataset(root, "shapes", synthetic_items(), img_size=16, seed=0)


# ------------------------------------------------------------------------------ data preparation


def test_square_on_white_crops_pads_and_flattens():
    image = Image.new("RGBA", (60, 20), (0, 0, 0, 0))
    ImageDraw.Draw(image).rectangle((10, 5, 29, 14), fill=(255, 0, 0, 255))  # a 20 x 10 red bar
    out = learning_data.square_on_white(image, 16)
    assert out.mode == "RGB" and out.size == (16, 16)
    assert out.getpixel((0, 0)) == (255, 255, 255)  # padding is white, not black
    assert out.getpixel((8, 8))[0] > 200 and out.getpixel((8, 8))[1] < 60  # the bar fills the width


def test_tuxpaint_descriptions_take_english_lines_only():
    text = "A blackbird.\nde.utf8=Eine Amsel.\nen_GB.utf8=A blackbird.\nen_AU.utf8=A black bird.\nfr.utf8=Un merle.\n"
    assert learning_data.tuxpaint_descriptions(text) == ("A blackbird.", "A black bird.")
    assert learning_data.tuxpaint_descriptions("de.utf8=Eine Amsel.\n") == ()


def test_parse_emoji_test_keeps_fully_qualified_with_groups():
    text = (
        "# group: Smileys & Emotion\n"
        "1F600 ; fully-qualified # 😀 E1.0 grinning face\n"
        "263A ; unqualified # ☺ E0.6 smiling face\n"
        "# group: People & Body\n"
        "1F44B 1F3FD ; fully-qualified # 👋🏽 E1.0 waving hand: medium skin tone\n"
    )
    assert learning_data.parse_emoji_test(text) == [
        ("😀", "Smileys & Emotion", "grinning face"),
        ("👋🏽", "People & Body", "waving hand: medium skin tone"),
    ]


def test_split_is_stratified_seeded_and_drops_single_image_classes():
    items = synthetic_items(per_class=5) + [learning_data.Item("only", "lonely", ("x",), lambda: None)]
    a = learning_data.split_items(items, 0.2, seed=3)
    b = learning_data.split_items(items, 0.2, seed=3)
    assert [it.name for it in a["val"]] == [it.name for it in b["val"]]
    for colour in COLOURS:
        assert sum(it.label == colour for it in a["val"]) == 2  # round(0.2 * 10)
        assert sum(it.label == colour for it in a["train"]) == 8
    assert all(it.label != "lonely" for split in a.values() for it in split)
    c = learning_data.split_items(items, 0.2, seed=4)
    assert [it.name for it in c["val"]] != [it.name for it in a["val"]]


def test_written_dataset_reads_as_imagefolder_and_coco(tiny_data):
    root = tiny_data.root
    train, val = ImageFolder(root / "train"), ImageFolder(root / "val")
    assert train.classes == val.classes == sorted(COLOURS) == tiny_data.classes
    assert (len(train), len(val)) == (tiny_data.num_train, tiny_data.num_val) == (30, 6)
    with Image.open(train.samples[0][0]) as image:
        assert image.size == (16, 16) and image.mode == "RGB"
    images = load_coco_captions(tiny_data.train_annotations) + load_coco_captions(tiny_data.val_annotations)
    assert len({im.image_id for im in images}) == 36
    assert all((root / im.file_name).is_file() for im in images)
    assert images[0].captions[0].startswith("A ")
    assert json.loads((root / "dataset.json").read_text())["per_class"] == dict.fromkeys(sorted(COLOURS), 12)


def test_failed_apt_get_download_is_one_line_naming_the_package(tmp_path, monkeypatch):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "apt-get").write_text("#!/bin/sh\necho 'E: Failed to fetch http://example/x.deb' >&2\nexit 100\n")
    (fake / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(learning_data.DataError) as err:
        learning_data.fetch_packages(["tuxpaint-stamps-default"], tmp_path / "cache")
    message = str(err.value)
    assert "\n" not in message
    assert "tuxpaint-stamps-default" in message and "Failed to fetch" in message
    assert "apt-get download tuxpaint-stamps-default" in message and str(tmp_path / "cache" / "debs") in message


def test_cached_deb_is_unpacked_without_downloading(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no apt-get: a download would fail
    debs = tmp_path / "cache" / "debs"
    debs.mkdir(parents=True)
    (debs / "pkg_1.0_all.deb").write_bytes(b"")
    calls = []
    monkeypatch.setattr(learning_data, "_run", lambda cmd, what, **kw: calls.append(cmd) or "")
    root = learning_data.fetch_packages(["pkg"], tmp_path / "cache")
    assert calls == [["dpkg-deb", "-x", str(debs / "pkg_1.0_all.deb"), str(root)]]
    assert learning_data.package_version(tmp_path / "cache", "pkg") == "1.0"
    learning_data.fetch_packages(["pkg"], tmp_path / "cache")  # unpacked once: the marker is there
    assert len(calls) == 1


# ------------------------------------------------------------------------------ the bench


@pytest.mark.parametrize("task", learning_bench.TASKS)
def test_vitattn_overrides_compose(task, tiny_data, tmp_path):
    cfg = learning_bench.BenchConfig(steps=7, threads=1, img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2)
    overrides = learning_bench.vitattn_overrides(task, tiny_data, cfg, tmp_path / "run")
    composed = compose_train([o for o in overrides if not o.startswith("hydra.")], tmp_path / "run")
    assert composed.head.task == task and composed.trainer.max_steps == 7 and composed.num_threads == 1
    assert (composed.model.embed_dim, composed.model.depth, composed.model.patch_size) == (16, 1, 8)
    assert composed.data.img_size == 16 and composed.data.batch_size == cfg.batch_size


def test_table_and_doc_markers(tmp_path):
    row = dict(
        dataset="d",
        task="caption",
        metric="cider_d",
        vitattn=0.5,
        plain=0.25,
        status="PASS",
        steps=9,
        threads=1,
        vitattn_seconds=3.0,
        plain_seconds=2.0,
        vitattn_command="vitattn-train x=1",
        plain_command="plain loop",
    )
    table = learning_bench.format_table([row])
    assert "| d | caption | CIDEr-D | 0.500 | 0.250 | PASS | 9 | 1 | 1 | 3 | 2 |  |" in table
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{learning_bench.DOC_START}\nold\n{learning_bench.DOC_END}\nafter\n")
    commands = learning_bench.commands_block([row], [["--quick"]])
    update_doc(doc, learning_bench.DOC_START, learning_bench.DOC_END, f"{table}\n\n{commands}")
    text = doc.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("after\n")
    assert table in text and "vitattn-train x=1" in text and "python -m benchmarks learning --quick" in text


def _run(seed, vitattn, plain, dataset="d", metric="acc"):
    """One training seed's run of both sides, as ``bench_row`` writes it."""
    return dict(
        dataset=dataset,
        task="classification",
        metric=metric,
        seed=seed,
        vitattn=vitattn,
        plain=plain,
        status="PASS" if vitattn >= plain else "MISS",
        steps=9,
        threads=2,
        vitattn_seconds=3.0 + seed,
        plain_seconds=2.0,
        vitattn_command=f"vitattn-train seed={seed}",
        plain_command="p",
    )


def test_seeds_combine_into_means_with_ranges_and_the_status_compares_the_means():
    # seed 0 alone would pass and seed 1 alone would miss: the row compares the means (0.7 vs 0.75)
    runs = [_run(0, 0.8, 0.7), _run(1, 0.6, 0.8), _run(0, 0.9, 0.1, dataset="e")]
    rows = learning_bench.combine_seeds(runs)
    assert [(r["dataset"], r["seeds"]) for r in rows] == [("d", [0, 1]), ("e", [0])]
    d = rows[0]
    assert d["vitattn"] == pytest.approx(0.7) and d["plain"] == pytest.approx(0.75) and d["status"] == "MISS"
    assert d["vitattn_runs"] == [0.8, 0.6] and d["vitattn_seconds"] == pytest.approx(3.5)
    table = learning_bench.format_table(rows)
    assert "| d | classification | val accuracy | 70.0 % (60.0–80.0) | 75.0 % (70.0–80.0) | MISS | 9 | 2 | 2 |" in table
    assert "| e | classification | val accuracy | 90.0 % | 10.0 % | PASS | 9 | 1 | 2 |" in table


def test_caption_note_gives_the_seeds_mean_share_of_distinct_captions():
    runs = [_run(seed, 0.5, 0.5, metric="exact_match") for seed in (0, 1)]
    for run, (mine, theirs) in zip(runs, [(0.5, 0.2), (1.0, 0.4)]):
        run.update(task="caption", vitattn_metrics={"distinct": mine}, plain_metrics={"distinct": theirs})
    (row,) = learning_bench.combine_seeds(runs)
    assert row["note"] == "distinct captions 75 % / 30 %"


def test_three_training_seeds_unless_quick_or_given():
    def args(argv):
        return cli.parser().parse_args(["learning", *argv])

    assert learning_bench.train_seeds(args([])) == [0, 1, 2]
    assert learning_bench.train_seeds(args(["--quick", "--seed", "4"])) == [4]
    assert learning_bench.train_seeds(args(["--train-seeds", "5", "6"])) == [5, 6]


def test_doc_from_saved_runs_rewrites_only_the_table(tmp_path, monkeypatch):
    # two bench processes (one per seed here) write a JSON each; the doc's table combines them
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"rows": [], "runs": [_run(0, 0.5, 0.75)], "argv": ["--steps", "9"]}))
    second.write_text(json.dumps({"rows": [], "runs": [_run(1, 0.7, 0.75)], "argv": ["--train-seeds", "1"]}))
    doc = tmp_path / "doc.md"
    doc.write_text(f"{learning_bench.DOC_START}\n{learning_bench.DOC_END}\n")
    monkeypatch.setattr(learning_bench, "DOC", doc)
    cli.main(["learning", "--doc-from", str(first), str(second)])
    text = doc.read_text()
    assert "| d | classification | val accuracy | 60.0 % (50.0–70.0) | 75.0 % (75.0–75.0) | MISS | 9 | 2 | 2 |" in text
    assert "python -m benchmarks learning --steps 9" in text and "python -m benchmarks learning --train-seeds 1" in text
    assert "vitattn-train seed=0" in text


@pytest.mark.slow
def test_bench_runs_both_sides_for_the_same_steps(tiny_data, tmp_path):
    cfg = learning_bench.BenchConfig(
        steps=3, threads=1, batch_size=8, img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, decoder_depth=1
    )
    rows = [row for task in learning_bench.TASKS for row in learning_bench.bench_row(tiny_data, task, cfg, tmp_path)]
    assert [(r["task"], r["metric"]) for r in rows] == [
        ("classification", "acc"),
        ("caption", "exact_match"),
        ("caption", "cider_d"),
    ]
    for r in rows:
        assert r["vitattn_steps"] == r["plain_steps"] == r["steps"] == 3
        for side in ("vitattn", "plain"):
            value = r[side]
            assert math.isfinite(value) and value >= 0
            if r["metric"] != "cider_d":
                assert value <= 1
            assert r[f"{side}_seconds"] > 0
        assert r["vitattn_command"].startswith("vitattn-train ") and "trainer.max_steps=3" in r["vitattn_command"]
    assert rows[1]["note"].startswith("distinct captions ")
    saved = json.loads((tmp_path / "shapes-caption-seed0" / "plain_captions.json").read_text())
    assert len(saved) == tiny_data.num_val and all(set(s) == {"image_id", "caption", "references"} for s in saved)
    table = learning_bench.format_table(rows)
    assert table.count("\n") == 1 + len(rows)
