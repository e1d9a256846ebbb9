"""Learning from images without captions (``bootstrap.*``): a teacher labels a pool once, a keep policy selects
when the data is read, the student trains on its own data and the kept pool; validation keeps the human
references; leaked images are left out and counted; a resumed run never captions again; lineage is recorded."""

import json
import random
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torchvision.transforms.functional import pil_to_tensor

import vitattn.training.bootstrap.side_files as side_files
from tests.helpers.images import make_image_folder
from tests.helpers.runs import SHAPES_RUN, TINY, TINY_SHAPES, compose_train
from vitattn.data.images import read_image
from vitattn.data.shapes import ShapesDataset
from vitattn.data.tokenizer import TokenizedCaptions, Vocabulary
from vitattn.errors import ConfigError
from vitattn.training import train
from vitattn.training.bootstrap import BootstrapSettings, Keep, MixedTraining, Pool, PoolLabels
from vitattn.training.build import build
from vitattn.training.datamodules import ImageFolderDataModule
from vitattn.training.plan import resolve

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
    real = side_files.caption_in_child
    monkeypatch.setattr(side_files, "caption_in_child", lambda *a: captioned.append(1) or real(*a))
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
    monkeypatch.setattr(side_files, "load_model", lambda *a, **k: pytest.fail("the teacher was loaded again"))
    again, _, _ = build(resolve(cfg), [])
    assert captioned == [1] and len(again.train_dataset.pool) == 12


def test_keep_policies_keep_what_they_say():
    ranked = [[(0.9, "a"), (0.2, "b"), (0.5, "c")], [(None, "d"), (0.1, "e")], [(0.6, "f")]]

    def keep(ranked, policy):
        return policy.captions(ranked)

    assert keep(ranked, Keep(top_k=None)) == [["a", "c", "b"], ["e"], ["f"]]  # best first; a null score never kept
    assert keep(ranked, Keep()) == [["a", "c"], ["e"], ["f"]]  # BLIP-2's top 2 by default
    assert keep(ranked, Keep(top_k=1)) == [["a"], ["e"], ["f"]]
    assert keep(ranked, Keep(top_k=None, min_score=0.5)) == [["a", "c"], [], ["f"]]
    # the 50th percentile of the five scores (0.1 0.2 0.5 0.6 0.9) is 0.5
    assert keep(ranked, Keep(top_k=None, percentile=50)) == [["a", "c"], [], ["f"]]
    assert keep(ranked, Keep(top_k=1, percentile=60)) == [["a"], [], ["f"]]


def _labels(folder: Path, probabilities: list[list[float]]) -> Path:
    side = folder / "labels.jsonl"
    side.write_text(
        "".join(json.dumps({"image": f"i{n}", "probabilities": p}) + "\n" for n, p in enumerate(probabilities))
    )
    return side


def test_class_pseudo_labels_keep_a_confidence_floor_and_top_k_never_bounds_a_class(tmp_path):
    side = _labels(tmp_path, [[0.9, 0.1], [0.6, 0.4], [0.55, 0.45], [0.3, 0.7], [0.2, 0.8], [0.45, 0.55]])

    def kept(**keep):
        pool = side_files.read_labels(BootstrapSettings(keep=Keep(**keep)), side, 2)
        return sorted(zip(pool.sources, pool.labels))

    every = [("i0", 0), ("i1", 0), ("i2", 0), ("i3", 1), ("i4", 1), ("i5", 1)]
    assert kept() == every and kept(top_k=1) == every and kept(top_k=None) == every  # one hard label an image
    assert kept(min_score=0.65) == [("i0", 0), ("i3", 1), ("i4", 1)]
    assert kept(percentile=50) == [("i0", 0), ("i1", 0), ("i3", 1), ("i4", 1)]  # 3 in all: 2 a class (rounded)


def test_percentile_keeps_the_same_count_of_every_class_however_the_teacher_leans(tmp_path):
    # the teacher calls six images class 0 and two class 1
    probabilities = [[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.65, 0.35], [0.6, 0.4], [0.55, 0.45], [0.3, 0.7], [0.4, 0.6]]
    side = _labels(tmp_path, probabilities)

    def kept(percentile):
        pool = side_files.read_labels(BootstrapSettings(keep=Keep(percentile=percentile)), side, 2)
        return Counter(zip(pool.sources, pool.labels))

    # 50: half of the 8 images, 2 of each class, its most confident
    assert kept(50) == Counter({("i0", 0): 1, ("i1", 0): 1, ("i6", 1): 1, ("i7", 1): 1})
    # 25: 6 in all, 3 of each class; class 1 has two, so its most confident comes twice (noisy student's balance)
    assert kept(25) == Counter({("i0", 0): 1, ("i1", 0): 1, ("i2", 0): 1, ("i6", 1): 2, ("i7", 1): 1})


def test_the_config_restates_the_code_s_bootstrap_defaults_and_keeps_every_class_label(tmp_path):
    cfg = compose_train([*TINY, "bootstrap.teacher=runs/teacher", "bootstrap.images=pool/"], tmp_path)
    settings = BootstrapSettings.from_config(OmegaConf.to_container(cfg.bootstrap))
    assert settings == BootstrapSettings(teacher="runs/teacher", images="pool/")  # one default: the code's
    side = _labels(tmp_path, [[0.9, 0.1], [0.6, 0.4], [0.55, 0.45], [0.3, 0.7], [0.2, 0.8], [0.45, 0.55]])
    assert len(side_files.read_labels(settings, side, 2)) == 6  # the default keeps every pseudo-label


def test_bootstrap_filter_is_checked_where_the_settings_are_made(tmp_path):
    node = {"teacher": "runs/teacher", "images": "pool/"}
    with pytest.raises(ConfigError, match="^bootstrap.filter=tecaher is not teacher, none, or a caption model"):
        BootstrapSettings.from_config({**node, "filter": "tecaher"})
    for good in ("teacher", "none", str(tmp_path), "hf-hub:org/filter"):
        assert BootstrapSettings.from_config({**node, "filter": good}).filter == good
    import vitattn.training.bootstrap as bootstrap

    assert not hasattr(bootstrap, "FILTERS") and not hasattr(bootstrap.settings, "FILTERS")


class _Captions(torch.utils.data.Dataset):
    """50 images of five references each."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> dict:
        references = [f"image {word}" for word in ("one", "two", "three", "four", "five")]
        return {"image": torch.zeros(3, 4, 4), "caption": references[0], "references": references, "image_id": i}


def test_each_human_repeat_draws_its_own_reference_and_the_same_one_again_on_a_resume():
    human = _Captions()
    vocab = Vocabulary.build(human[0]["references"])
    mixed = MixedTraining(TokenizedCaptions(human, vocab, 8, 1), 4, [])
    for seed in (3, 7):
        drawn = [[vocab.decode(mixed[(r * 50 + i, seed)]["tokens"][0]) for r in range(4)] for i in range(50)]
        alike = sum(len(set(d)) == 1 for d in drawn)
        assert alike <= 3, f"{alike} of 50 images drew one reference for all 4 repeats (independent draws: 0.4)"
        assert all(mixed[(r * 50 + 9, seed)]["tokens"][0].tolist() == vocab.encode(drawn[9][r]) for r in range(4))


class _Stop(Exception):
    pass


@pytest.mark.parametrize("head", ["caption", "classification"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_teacher_labels_the_pool_in_the_run_s_precision(head, precision, pool, tmp_path, monkeypatch):
    monkeypatch.setenv("VITATTN_NATIVE_BF16", "1")  # a CPU with bf16 units, where precision=auto is bf16
    seen = []

    def teacher(path, **kwargs):
        seen.append(kwargs.get("precision"))
        if head == "classification":
            raise _Stop
        return SimpleNamespace(task="caption")

    def caption(job):
        seen.append(f"precision={job.precision}")
        raise _Stop

    monkeypatch.setattr(side_files, "load_model", teacher)
    monkeypatch.setattr(side_files, "caption_in_child", caption)
    cfg = compose_train(
        [*TINY, f"head={head}", *TINY_SHAPES, *SHORT, f"trainer.precision={precision}"]
        + [f"bootstrap.teacher={tmp_path}", f"bootstrap.images={pool}"],
        tmp_path / "s",
    )
    with pytest.raises(_Stop):
        build(resolve(cfg), [])
    wanted = "fp32" if precision == "32-true" else "bf16"
    assert seen == ([wanted] if head == "classification" else [wanted, f"precision={wanted}"])


def test_only_global_rank_zero_labels_the_pool(pool, tmp_path, monkeypatch):
    from lightning.pytorch.utilities import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 0)  # the plan sets it: restored after
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    # the first process of the second node, before fit: Lightning's launcher has set only NODE_RANK there
    with monkeypatch.context() as m:
        m.setenv("NODE_RANK", "1")
        m.setattr(side_files, "label_pool", lambda *a: pytest.fail("a process of node 1 labelled the pool"))
        waits = []
        m.setattr(side_files, "wait_for_rank_zero", lambda *a: waits.append(a) or (_ for _ in ()).throw(_Stop()))
        overrides = [*TINY, "head=classification", *TINY_SHAPES, *SHORT, f"bootstrap.teacher={tmp_path}"]
        cfg = compose_train([*overrides, f"bootstrap.images={pool}"], tmp_path / "s")
        with pytest.raises(_Stop):  # it waits for rank 0's side files, as long as labelling the pool may take
            build(resolve(cfg), [])
        assert waits == [(tmp_path / "s" / "bootstrap" / "labels.jsonl", 7 * 24 * 3600)]
    # which process is rank 0 in each launcher's environment: tests/training/test_plan.py (global_rank)


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
    from vitattn.run_dir import RunConfig

    cfg = compose_train([*TINY, "bootstrap.teacher=runs/teacher", "bootstrap.images=pool/"], tmp_path)
    (line,) = [x for x in _training(RunConfig.of(cfg), None, ["shapes"]) if "without captions" in x]
    assert "teacher runs/teacher" in line and "filter teacher" in line and "5 candidates" in line and "top_k 2" in line
    plain = compose_train([*TINY], tmp_path)
    assert not [x for x in _training(RunConfig.of(plain), None, ["shapes"]) if "without captions" in x]


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


def test_the_student_s_vocabulary_is_the_human_one_and_pool_words_outside_it_are_never_targets(pool, tmp_path, caplog):
    human = ShapesDataset("train", 64, 32, 0, "caption").captions
    side = tmp_path / "candidates.jsonl"
    records = [
        {
            "image": str(pool / "scene288.png"),
            "candidates": [{"text": "a zebra", "score": -0.1}, {"text": human[1], "score": -0.5}],
        },
        {"image": str(pool / "scene289.png"), "candidates": [{"text": "zebra crossing", "score": -0.2}]},
        {"image": str(pool / "scene290.png"), "candidates": [{"text": human[2], "score": -0.3}]},
    ]
    side.write_text("".join(json.dumps(r) + "\n" for r in records))
    side.with_name(side.name + ".manifest.json").write_text("{}")
    run = [*TINY, "head=caption", *TINY_SHAPES, *SHORT]
    plain, _, _ = build(resolve(compose_train(run, tmp_path / "plain")), [])
    datamodule, _, _ = build(resolve(compose_train([*run, f"bootstrap.candidates={side}"], tmp_path / "s")), [])
    assert datamodule.vocab == plain.vocab  # the human captions' vocabulary, as without a pool
    assert datamodule.pool.sources == [str(pool / "scene288.png"), str(pool / "scene290.png")]
    assert datamodule.pool.captions == [[human[1]], [human[2]]]  # "a zebra" dropped; scene289 kept nothing
    kept = json.loads((tmp_path / "s" / "bootstrap" / "lineage.json").read_text())["kept"]
    assert (kept["kept_captions_outside_vocabulary"], kept["pool_images_left_without_caption"]) == (2, 1)
    assert "2 kept pool captions hold a word outside the vocabulary of the human captions" in caplog.text


def test_pool_images_take_the_training_transform_with_randaugment_added_and_the_leak_rule_holds(tmp_path):
    root = make_image_folder(tmp_path / "tree", per_class=2, size=32)
    folder = tmp_path / "pool"
    folder.mkdir()
    rng = np.random.default_rng(5)
    for name in ("a", "b"):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{name}.png")
    shutil.copy(root / "train" / "cat" / "0.png", folder / "c_labelled.png")  # a labelled image again
    augment = {"scale": [1.0, 1.0], "ratio": [1.0, 1.0], "hflip": 1.0}  # the crop keeps all 32 px; always flipped

    def mixed(randaugment):
        datamodule = ImageFolderDataModule(root, augment=augment, img_size=32, batch_size=2, cache="none")
        datamodule.setup()
        datamodule.pool = Pool([str(p) for p in sorted(folder.iterdir())], labels=[0, 1, 0])
        counts = datamodule.use_pool(BootstrapSettings(teacher="t", images="p", randaugment=randaugment))
        return datamodule, counts

    def flipped(path):
        return pil_to_tensor(read_image(path)).flip(-1)  # (3, 32, 32) uint8, mirrored

    datamodule, counts = mixed("rand-m9-n0")  # a RandAugment of no operation: the crop and the flip alone
    assert counts["pool_identical_to_labelled"] == 1  # compared through the evaluation transform, augmented or not
    data, sources = datamodule.train_dataset, datamodule.pool.sources
    assert sources == [str(folder / "a.png"), str(folder / "b.png")]
    for i in range(2):
        assert torch.equal(data[data.human_size + i][0], flipped(sources[i]))  # the training transform's flip
    datamodule, _ = mixed("rand-m9-n2-mstd0")
    data = datamodule.train_dataset
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    changed = [not torch.equal(data[data.human_size + i % 2][0], flipped(sources[i % 2])) for i in range(16)]
    assert any(changed)  # RandAugment's operations, on top of the flip
    assert all(torch.equal(data[i][0], flipped(datamodule.train_files()[i])) for i in range(4))  # humans: none


def test_soft_class_labels_learn_the_teacher_s_stored_probabilities_by_a_soft_cross_entropy():
    from vitattn.training.systems.classification import ClassificationSystem

    torch.manual_seed(0)
    config = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3)
    system = ClassificationSystem(config, ["a", "b", "c"])
    system.log = lambda *a, **k: None  # no trainer: the loss alone
    images = torch.randn(2, 3, 32, 32)
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])
    logits = system.model(images)
    by_hand = -(probs * torch.log_softmax(logits, -1)).sum(-1).mean()  # noisy student's soft target
    torch.testing.assert_close(system._training_loss((images, probs)), by_hand)
    hard = -torch.log_softmax(logits, -1)[[0, 1], [0, 2]].mean()  # the argmax as a hard label: not the same loss
    assert not torch.allclose(by_hand, hard)
    torch.testing.assert_close(system._training_loss((images, torch.tensor([0, 2]))), hard)


def test_soft_pool_targets_are_the_stored_probabilities_of_the_kept_images_and_humans_one_hot(tmp_path):
    rows = [[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.3, 0.7]]  # class 0 three times, class 1 once
    side = _labels(tmp_path, rows)
    pool = side_files.read_labels(BootstrapSettings(soft=True, keep=Keep(percentile=50)), side, 2)
    # a balanced count of 1 per class (50 % of 4 images, 2 classes), each class's most confident, its own row
    assert sorted(zip(pool.sources, pool.labels, pool.targets)) == [("i0", 0, rows[0]), ("i3", 1, rows[3])]
    assert side_files.read_labels(BootstrapSettings(keep=Keep(percentile=50)), side, 2).targets is None  # hard
    for n in range(2):
        _save(torch.full((3, 8, 8), 60 * n, dtype=torch.uint8), tmp_path / f"p{n}.png")
    kept = Pool([str(tmp_path / "p0.png"), str(tmp_path / "p1.png")], labels=[0, 1], targets=[rows[1], rows[3]])
    human = [(torch.zeros(3, 8, 8, dtype=torch.uint8), 1)]
    mixed = MixedTraining(human, 1, PoolLabels(kept, pil_to_tensor), 2)
    batch = torch.utils.data.default_collate([mixed[0], mixed[1], mixed[2]])  # one kind of target: it collates
    torch.testing.assert_close(batch[1], torch.tensor([[0.0, 1.0], rows[1], rows[3]]))


def test_a_soft_run_is_refused_where_it_cannot_hold(tmp_path):
    with pytest.raises(ConfigError, match="^bootstrap.soft=true: soft targets are the teacher's class probabilities"):
        side_files.prepare_pool(BootstrapSettings(candidates=str(tmp_path), soft=True), "caption", tmp_path, {})
    cfg = _student(
        tmp_path / "s", "bootstrap.candidates=c", "bootstrap.soft=true", "head.mixup=0.8", head="classification"
    )
    with pytest.raises(ConfigError, match="^bootstrap.soft=true takes no head.mixup / head.cutmix"):
        build(resolve(cfg), [])
    with pytest.raises(ConfigError, match="^bootstrap.labelled_images=copy must be drop or keep"):
        BootstrapSettings.from_config({"candidates": "c.jsonl", "labelled_images": "copy"})


def test_a_filter_trained_apart_judges_the_teacher_s_class_labels(tmp_path):
    # the teacher calls both images class 0; the filter doubts the first
    side = tmp_path / "labels.jsonl"
    records = [
        {"image": "i0", "probabilities": [0.9, 0.1], "filter_probabilities": [0.4, 0.6]},
        {"image": "i1", "probabilities": [0.6, 0.4], "filter_probabilities": [0.95, 0.05]},
    ]
    side.write_text("".join(json.dumps(r) + "\n" for r in records))
    pool = side_files.read_labels(BootstrapSettings(keep=Keep(min_score=0.5)), side, 2)
    assert (pool.sources, pool.labels) == (["i1"], [0])  # the filter's confidence, not the teacher's 0.9


def test_a_classification_teacher_writes_its_filter_s_probabilities_beside_its_own(tmp_path, monkeypatch):
    from torchvision.transforms.functional import to_tensor

    for n in range(3):
        _save(torch.full((3, 8, 8), 50 * n, dtype=torch.uint8), tmp_path / f"p{n}.png")

    def model(bias):  # logits from the image's mean: each image its own probabilities
        return lambda images: images.mean((1, 2, 3))[:, None] * torch.tensor([1.0, -1.0]) + torch.tensor(bias)

    def fake(path, **kwargs):
        bias = [0.0, 0.0] if path == "teacher" else [2.0, 0.0]
        return SimpleNamespace(
            task="classification", class_names=["a", "b"], model=model(bias), device="cpu", transform=to_tensor
        )

    monkeypatch.setattr(side_files, "load_model", fake)
    settings = BootstrapSettings(teacher="teacher", images=str(tmp_path), filter="filter")
    side = tmp_path / "out" / "labels.jsonl"
    side_files.label_pool(settings, "classification", side, {"class_names": ["a", "b"]})
    for record in map(json.loads, side.read_text().splitlines()):
        m = to_tensor(read_image(record["image"])).mean()
        teacher, judged = torch.softmax(torch.stack([m, -m]), 0), torch.softmax(torch.stack([m + 2, -m]), 0)
        torch.testing.assert_close(torch.tensor(record["probabilities"]), teacher, atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(record["filter_probabilities"]), judged, atol=1e-6, rtol=0)
    monkeypatch.setattr(
        side_files,
        "load_model",
        lambda path, **k: SimpleNamespace(task="caption", class_names=None) if path == "filter" else fake(path),
    )
    with pytest.raises(ConfigError, match="^bootstrap.filter=filter: a classification student's filter is a classi"):
        side_files.label_pool(settings, "classification", tmp_path / "again.jsonl", {"class_names": ["a", "b"]})


def test_labelled_images_keep_trains_on_the_teacher_s_labels_of_labelled_images_never_on_val_images(tmp_path):
    root = make_image_folder(tmp_path / "tree", per_class=2, size=32)
    folder = tmp_path / "pool"
    folder.mkdir()
    shutil.copy(root / "train" / "cat" / "0.png", folder / "labelled.png")
    shutil.copy(root / "val" / "dog" / "1.png", folder / "val.png")

    def mixed(labelled_images, soft=None):
        datamodule = ImageFolderDataModule(root, img_size=32, batch_size=2, cache="none")
        datamodule.setup()
        datamodule.pool = Pool([str(folder / "labelled.png"), str(folder / "val.png")], labels=[1, 0], targets=soft)
        settings = BootstrapSettings(teacher="t", images="p", labelled_images=labelled_images)
        return datamodule, datamodule.use_pool(settings)

    datamodule, counts = mixed("keep")  # distillation: the labelled image's teacher label trained on too
    assert counts["pool_identical_to_labelled"] == 1 and counts["pool_identical_to_val_or_test"] == 1
    assert datamodule.pool.sources == [str(folder / "labelled.png")] and datamodule.pool.labels == [1]
    assert len(datamodule.train_dataset) == 4 + 1
    data, _ = mixed("keep", soft=[[0.2, 0.8], [0.9, 0.1]])
    data = data.train_dataset  # soft: the pool's stored probabilities, the human labels one-hot
    assert data[4][1].tolist() == pytest.approx([0.2, 0.8]) and data[0][1].tolist() == [1.0, 0.0]  # 0: a cat
    with pytest.raises(ConfigError, match="every kept pool image is a validation, test or labelled image"):
        mixed("drop")


def test_the_student_is_its_own_run_and_takes_its_own_noise(pool, tmp_path):
    from vitattn.layers.transformer import DecoderLayer, EncoderLayer

    side = tmp_path / "candidates.jsonl"
    human = ShapesDataset("train", 64, 32, 0, "caption").captions
    side.write_text(json.dumps({"image": str(pool / "scene288.png"), "candidates": [{"text": human[1], "score": 0}]}))
    side.with_name(side.name + ".manifest.json").write_text("{}")
    noise = ["model.drop_path_rate=0.3", "model.drop_rate=0.2", "head.decoder.drop_rate=0.4"]
    run = [*TINY, "head=caption", *TINY_SHAPES, *SHORT, f"bootstrap.candidates={side}", *noise]
    _, system, _ = build(resolve(compose_train(run, tmp_path / "s")), [])
    encoder = [m for m in system.model.encoder.modules() if isinstance(m, EncoderLayer)]
    decoder = [m for m in system.model.decoder.modules() if isinstance(m, DecoderLayer)]
    assert encoder[-1].drop_path2.p == pytest.approx(0.3)  # timm's rise over the layers, to the rate at the last
    assert encoder[-1].dropout1.p == pytest.approx(0.2) and decoder[0].dropout3.p == pytest.approx(0.4)


def test_the_captioning_child_loads_its_teacher_and_filter_in_the_job_s_precision(monkeypatch, tmp_path):
    from vitattn.inference import jobs
    from vitattn.inference.captioning import Processes

    loaded = []

    def load(path, **kwargs):
        loaded.append((path, kwargs["precision"]))
        if path == "filter":
            raise _Stop
        return SimpleNamespace(task="caption", precision=kwargs["precision"], merge_tokens=None)

    monkeypatch.setattr(jobs, "load_model", load)
    settings = BootstrapSettings(teacher="teacher", images=str(tmp_path), filter="filter")
    job = side_files.caption_job(settings, tmp_path / "c.jsonl", {"precision": "bf16"})
    with pytest.raises(_Stop):
        jobs.run_caption_job(job, Processes())
    assert loaded == [("teacher", "bf16"), ("filter", "bf16")]
    assert jobs.CaptionJob.from_json(job.to_json()) == job  # what the child process reads back
