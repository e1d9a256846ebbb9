"""Learning from images without captions (``bootstrap.*``): a teacher labels a pool once, a keep policy selects
when the data is read, the student trains on its own data and the kept pool; validation keeps the human
references; leaked images are left out and counted; a resumed run never captions again; lineage is recorded."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

import vitattn.training.bootstrap as bootstrap
from tests.helpers.runs import SHAPES_RUN, TINY, compose_train
from vitattn.data.shapes import ShapesDataset
from vitattn.errors import ConfigError
from vitattn.training import train
from vitattn.training.bootstrap import BootstrapSettings, Keep, MixedTraining
from vitattn.training.build import build

SHORT = ["data.num_test=16", "trainer.max_steps=4", "trainer.check_val_every_n_epoch=50", "export_bundle=false"]


def _save(image: torch.Tensor, path: Path) -> None:
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(path)


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Path:
    """12 shapes training scenes the runs do not label (256 on), one validation image and one labelled one."""
    folder = tmp_path_factory.mktemp("pool")
    scenes = ShapesDataset("train", 300, 32, 0, "caption")
    for i in range(288, 300):
        _save(scenes[i]["image"], folder / f"scene{i}.png")
    _save(ShapesDataset("val", 16, 32, 0, "caption")[3]["image"], folder / "leak_val.png")
    _save(scenes[5]["image"], folder / "leak_labelled.png")
    return folder


def _student(run_dir: Path, *overrides: str, head: str = "caption"):
    cfg = compose_train([*TINY, f"head={head}", *SHAPES_RUN, *SHORT, *overrides], run_dir)
    return cfg


def test_a_student_trains_on_its_data_and_the_kept_pool_and_validates_on_human_references(
    shapes_caption_run, pool, tmp_path, monkeypatch
):
    captioned = []
    real = bootstrap._caption_pool
    monkeypatch.setattr(bootstrap, "_caption_pool", lambda *a: captioned.append(1) or real(*a))
    cfg = _student(tmp_path / "student", f"bootstrap.teacher={shapes_caption_run}", f"bootstrap.images={pool}")
    from vitattn.training.plan import resolve

    datamodule, _, _ = build(resolve(cfg), [])
    mixed = datamodule.train_dataset
    assert isinstance(mixed, MixedTraining) and captioned == [1]
    assert (mixed.human_size, len(mixed.pool)) == (256, 12)  # the two leaked images left out
    side = tmp_path / "student" / "bootstrap"
    records = [json.loads(line) for line in (side / "candidates.jsonl").read_text().splitlines()]
    assert len(records) == 14 and all(len(r["candidates"]) >= 1 for r in records)
    # a pool visit draws one of the image's kept captions (top 2 by the teacher's score), the same on a resume
    kept = {r["image"]: sorted(r["candidates"], key=lambda c: -c["score"])[:2] for r in records}
    for index in range(256, 268):
        item = mixed[(index, 7)]
        text = datamodule.vocab.decode(item["tokens"][0])
        assert text in [c["text"] for c in kept[datamodule.pool.name(index - 256)]]
        assert torch.equal(mixed[(index, 7)]["tokens"][0], item["tokens"][0])
    # validation: the human references alone
    val = ShapesDataset("val", 16, 32, 0, "caption")
    assert not isinstance(datamodule.val_dataset, MixedTraining)
    assert [datamodule.val_dataset[i]["references"] for i in range(16)] == [val.references(i) for i in range(16)]
    # the vocabulary spells the kept captions too
    kept_words = {w for cs in datamodule.pool.captions for c in cs for w in c.split()}
    assert kept_words <= set(datamodule.vocab.words)
    lineage = json.loads((side / "lineage.json").read_text())
    assert lineage["teacher"] == str(shapes_caption_run) and lineage["filter"] == "teacher"
    assert lineage["candidates"]["captioner"] == str(shapes_caption_run)
    assert lineage["kept"]["kept_images"] == 14

    # the same run folder again (a resume): nothing captioned, the teacher not even loaded
    monkeypatch.setattr(bootstrap, "load_model", lambda *a, **k: pytest.fail("the teacher was loaded again"))
    again, _, _ = build(resolve(cfg), [])
    assert captioned == [1] and len(again.train_dataset.pool) == 12


def test_keep_policies_keep_what_they_say():
    ranked = [[(0.9, "a"), (0.2, "b"), (0.5, "c")], [(None, "d"), (0.1, "e")], [(0.6, "f")]]
    keep = bootstrap._keep_candidates
    assert keep(ranked, Keep()) == [["a", "c", "b"], ["e"], ["f"]]  # best first; a null score never kept
    assert keep(ranked, Keep(top_k=1)) == [["a"], ["e"], ["f"]]
    assert keep(ranked, Keep(min_score=0.5)) == [["a", "c"], [], ["f"]]
    # the 50th percentile of the five scores (0.1 0.2 0.5 0.6 0.9) is 0.5
    assert keep(ranked, Keep(percentile=50)) == [["a", "c"], [], ["f"]]
    assert keep(ranked, Keep(top_k=1, percentile=60)) == [["a"], [], ["f"]]


def test_class_pseudo_labels_keep_a_confidence_floor_or_each_class_s_top_share(tmp_path):
    probabilities = [[0.9, 0.1], [0.6, 0.4], [0.55, 0.45], [0.3, 0.7], [0.2, 0.8], [0.45, 0.55]]
    side = tmp_path / "labels.jsonl"
    side.write_text(
        "".join(json.dumps({"image": f"i{n}", "probabilities": p}) + "\n" for n, p in enumerate(probabilities))
    )

    def kept(**keep):
        pool = bootstrap._read_labels(BootstrapSettings(keep=Keep(**keep)), side, 2)
        return sorted(zip(pool.sources, pool.labels))

    assert kept() == [("i0", 0), ("i1", 0), ("i2", 0), ("i3", 1), ("i4", 1), ("i5", 1)]
    assert kept(min_score=0.65) == [("i0", 0), ("i3", 1), ("i4", 1)]
    # each class's top half (its confidences' 50th percentile and up): balanced however the teacher leans
    assert kept(percentile=50) == [("i0", 0), ("i1", 0), ("i3", 1), ("i4", 1)]
    assert kept(top_k=1) == [("i0", 0), ("i4", 1)]


def test_a_classifier_student_learns_from_a_classifier_teacher_and_refuses_a_captioner(
    shapes_classifier_run, shapes_caption_run, pool, tmp_path
):
    from vitattn.training.plan import resolve

    cfg = _student(
        tmp_path / "s",
        f"bootstrap.teacher={shapes_classifier_run}",
        f"bootstrap.images={pool}",
        "bootstrap.keep.percentile=50",
        "bootstrap.keep.top_k=null",
        head="classification",
    )
    datamodule, _, _ = build(resolve(cfg), [])
    mixed = datamodule.train_dataset
    records = [json.loads(line) for line in (tmp_path / "s" / "bootstrap" / "labels.jsonl").read_text().splitlines()]
    assert len(records) == 14
    image, label = mixed[mixed.human_size]
    assert image.dtype == torch.uint8 and image.shape == (3, 32, 32)
    predicted = {r["image"]: max(range(len(r["probabilities"])), key=r["probabilities"].__getitem__) for r in records}
    assert all(predicted[datamodule.pool.name(i)] == datamodule.pool.labels[i] for i in range(len(datamodule.pool)))
    cfg = _student(
        tmp_path / "t", f"bootstrap.teacher={shapes_caption_run}", f"bootstrap.images={pool}", head="classification"
    )
    with pytest.raises(
        ConfigError, match="is a caption model; a head=classification student learns from a classification teacher"
    ):
        build(resolve(cfg), [])


def test_a_pool_with_no_kept_candidate_is_refused_before_training(shapes_caption_run, pool, tmp_path):
    cfg = _student(
        tmp_path / "s",
        f"bootstrap.teacher={shapes_caption_run}",
        f"bootstrap.images={pool}",
        "bootstrap.keep.min_score=5",
    )
    with pytest.raises(ConfigError, match="no pool image kept a candidate"):
        train(cfg)
    assert not (tmp_path / "s" / "checkpoints").exists()


def test_a_second_round_reuses_side_files_and_records_the_teacher_s_lineage(shapes_caption_run, pool, tmp_path):
    from vitattn.training.plan import resolve

    first = tmp_path / "first"
    build(resolve(_student(first, f"bootstrap.teacher={shapes_caption_run}", f"bootstrap.images={pool}")), [])
    second = tmp_path / "second"
    cfg = _student(second, f"bootstrap.candidates={first}", "bootstrap.keep.top_k=1")
    datamodule, _, _ = build(resolve(cfg), [])
    assert all(len(c) == 1 for c in datamodule.pool.captions)  # another keep: the same side files, read again
    assert not (second / "bootstrap" / "candidates.jsonl").exists()  # nothing captioned
    lineage = json.loads((second / "bootstrap" / "lineage.json").read_text())
    assert lineage["side_files"] == str(first / "bootstrap" / "candidates.jsonl")
    assert lineage["teacher"] == str(shapes_caption_run)
    third = OmegaConf.to_container(cfg.bootstrap)
    assert third["candidates"] == str(first)


def test_a_pool_of_shards_is_read_by_sample_key(shapes_caption_run, tmp_path):
    from vitattn.data.shards.writer import shapes_samples, write_shards
    from vitattn.training.plan import resolve

    write_shards(shapes_samples("train", 6, img_size=32, seed=9), tmp_path / "shards", 4)
    images = str(tmp_path / "shards" / "{00000..00001}.tar")
    cfg = _student(tmp_path / "s", f"bootstrap.teacher={shapes_caption_run}", f"bootstrap.images='{images}'")
    datamodule, _, _ = build(resolve(cfg), [])
    assert sorted((tmp_path / "s" / "bootstrap" / "candidates").iterdir()) == sorted(
        tmp_path / "s" / "bootstrap" / "candidates" / n for n in ("00000.jsonl", "00001.jsonl", "manifest.json")
    )
    pool = datamodule.pool
    assert len(pool) == 6 and all(isinstance(source, tuple) for source in pool.sources)
    item = datamodule.train_dataset[(256, 0)]
    assert item["image"].shape == (3, 32, 32) and item["image_id"] == -1


def test_the_model_card_says_what_the_run_learned_from(tmp_path):
    from vitattn.bundle.card import _training

    cfg = compose_train([*TINY, "bootstrap.teacher=runs/teacher", "bootstrap.images=pool/"], tmp_path)
    (line,) = [x for x in _training(cfg, None, ["shapes"]) if "without captions" in x]
    assert "teacher runs/teacher" in line and "filter teacher" in line and "5 candidates" in line and "top_k 2" in line
    plain = compose_train([*TINY], tmp_path)
    assert not [x for x in _training(plain, None, ["shapes"]) if "without captions" in x]


@pytest.mark.slow
def test_a_run_killed_while_captioning_resumes_and_captions_each_pool_image_once(shapes_caption_run, tmp_path):
    """kill -9 of the training process mid-captioning: its captioner dies with it; the same command resumes
    the finished chunks and captions the others once."""
    import os
    import signal
    import subprocess
    import time

    from tests.helpers.processes import process_tree, scan_processes
    from tests.helpers.runs import console_script

    folder = tmp_path / "pool"
    folder.mkdir()
    scenes = ShapesDataset("train", 300, 32, 0, "caption")
    for i in range(260, 280):
        _save(scenes[i]["image"], folder / f"scene{i}.png")
    stall = folder / "zzz_stall.png"
    os.mkfifo(stall)  # read last: its reader blocks, so the first run cannot finish
    run = tmp_path / "student"
    cmd = [str(console_script("vitattn-train")), *TINY, "head=caption", *SHAPES_RUN, *SHORT]
    cmd += [f"bootstrap.teacher={shapes_caption_run}", f"bootstrap.images={folder}", "bootstrap.batch_size=2"]
    cmd += [f"hydra.run.dir={run}", "num_threads=1", "trainer.enable_progress_bar=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    parts = run / "bootstrap" / "candidates.jsonl.parts"
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while not list(parts.glob("*.jsonl")) and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.05)
    assert first.poll() is None and list(parts.glob("*.jsonl")), (tmp_path / "first.log").read_text()[-3000:]
    tree = process_tree(first.pid)
    assert len(tree) >= 2  # the training process and its captioner
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    deadline = time.monotonic() + 30
    while [p for p in tree if p in scan_processes()] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in tree if p in scan_processes()], "the captioner outlived the killed run"
    stall.unlink()
    _save(scenes[280]["image"], stall)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "16 of 21 images are already captioned" in again.stderr
    records = [json.loads(line) for line in (run / "bootstrap" / "candidates.jsonl").read_text().splitlines()]
    assert sorted(r["image"] for r in records) == sorted(str(p) for p in folder.iterdir())  # each once
