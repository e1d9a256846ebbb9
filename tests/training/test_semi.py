"""Online pseudo-labels (vitattn.training.semi): the threshold, the views, the labelling pass, the EMA teacher,
FreeMatch's state, the unlabelled stream's resume and its split across ranks, and what the config refuses."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DistributedSampler

from tests.helpers.datasets import make_coco
from tests.helpers.images import make_image_folder
from tests.helpers.runs import TINY, compose_train
from vitattn.data.preprocess import CAPTION_SAFE_OPS, Augment, Cutout, caption_weak_transform, strong_view
from vitattn.data.tokenizer import Vocabulary, tokenizer_labels
from vitattn.errors import ConfigError
from vitattn.models.generate import sequence_log_prob
from vitattn.training import train
from vitattn.training.build import semi_settings
from vitattn.training.config import check_config
from vitattn.training.datamodules.image_folder import ImageFolderDataModule
from vitattn.training.semi import (
    FixedThreshold,
    FreeMatchThreshold,
    SemiSettings,
    unlabelled_loss,
)
from vitattn.training.systems import CaptionSystem, ClassificationSystem

CONFIG = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "num_classes": 3}


def _system(method: str = "fixmatch", **settings) -> ClassificationSystem:
    torch.manual_seed(0)
    system = ClassificationSystem({**CONFIG, "drop_rate": 0.5, "drop_path_rate": 0.5}, ["a", "b", "c"])
    system.log = lambda *a, **k: None  # no trainer attached
    system.use_semi(SemiSettings(method=method, images="pool/", **settings))
    return system


def test_the_fixed_threshold_masks_what_it_says():
    logits = torch.tensor([[math.log(96), math.log(2), math.log(2)], [math.log(95), math.log(5), 0.0 - 99]])
    logits = torch.cat([logits, torch.tensor([[math.log(2), math.log(94), math.log(4)]])])
    probs = logits.softmax(-1)  # largest: 0.96, 0.95, 0.94
    assert FixedThreshold(0.95)(probs).tolist() == [True, True, False]
    strong = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
    # by hand: -log softmax(strong)[label] of the images kept, over all 3 images
    ce = [-(s[label] - torch.logsumexp(s, 0)) for s, label in zip(strong, [0, 0, 1])]
    expected = (ce[0] + ce[1]) / 3
    torch.testing.assert_close(unlabelled_loss(strong, probs, FixedThreshold(0.95)(probs)), expected)


@pytest.mark.parametrize("soft", [False, True])
def test_the_labelling_pass_runs_without_dropout_or_gradient_and_the_strong_view_is_learned(soft):
    system = _system(threshold=0.0, soft=soft)
    model, calls = system.model, []
    model.register_forward_hook(lambda m, args, out: calls.append((args[0], m.training, torch.is_grad_enabled(), out)))
    model.train()
    weak, strong = torch.randn(4, 3, 32, 32, requires_grad=True), torch.randn(4, 3, 32, 32, requires_grad=True)
    loss = system._unlabelled(weak, strong)
    (w, w_training, w_grad, w_out), (s, s_training, s_grad, s_out) = calls
    assert w is weak and s is strong
    assert (w_training, w_grad) == (False, False) and (s_training, s_grad) == (True, True) and model.training
    assert all(m.training for m in model.modules())  # dropout and drop-path back on after the pass
    model.eval()
    torch.testing.assert_close(w_out, model(weak).detach())  # the labels: dropout and drop-path off
    model.train()
    probs = w_out.float().softmax(-1)
    target = probs if soft else F.one_hot(probs.argmax(-1), 3).float()
    torch.testing.assert_close(loss, torch.sum(-target * s_out.log_softmax(-1), -1).mean())
    loss.backward()
    assert strong.grad is not None and strong.grad.abs().sum() > 0
    assert weak.grad is None  # the labels carry no gradient


def test_the_ema_teacher_labels_and_updates_as_said():
    system = _system(threshold=0.0, ema_decay=0.9)
    teacher = system.teacher.module
    assert not any(k.startswith("teacher") for k in system.state_dict())  # outside the ema average and the export
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    with torch.no_grad():
        for p in system.model.parameters():
            p.add_(torch.randn_like(p))
    calls = []
    teacher.register_forward_hook(lambda m, args, out: calls.append(m.training))
    system._unlabelled(torch.randn(2, 3, 32, 32), torch.randn(2, 3, 32, 32))
    assert calls == [False]  # the teacher labelled, in eval mode
    system.teacher.update(system.model)
    now = system.model.state_dict()
    for key, value in teacher.state_dict().items():
        torch.testing.assert_close(value, 0.9 * before[key] + 0.1 * now[key])
    checkpoint = {}
    system.on_save_checkpoint(checkpoint)
    resumed = _system(threshold=0.0, ema_decay=0.9)  # its teacher: a copy of the same initial weights
    resumed.on_load_checkpoint(checkpoint)
    for key, value in resumed.teacher.module.state_dict().items():
        torch.testing.assert_close(value, teacher.state_dict()[key])  # a resumed run continues the teacher


def test_freematch_thresholds_follow_the_confidences_and_survive_a_checkpoint():
    hook = FreeMatchThreshold(3, momentum=0.9)
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.35, 0.33, 0.32]])
    mask = hook(probs)
    time_p = 0.9 / 3 + 0.1 * (0.7 + 0.6 + 0.35) / 3  # by hand: EMA of the mean largest probability, from 1/K
    p_model = 0.9 / 3 + 0.1 * probs.mean(0)
    torch.testing.assert_close(hook.time_p, torch.tensor(time_p))
    torch.testing.assert_close(hook.p_model, p_model)
    expected = [bool(p >= time_p * p_model[c] / p_model.max()) for p, c in [(0.7, 0), (0.6, 1), (0.35, 0)]]
    assert mask.tolist() == expected == [True, True, False]  # 0.35 passes 1/3, the level before this batch
    system = _system("freematch", momentum=0.9)
    system.semi_threshold(probs)
    resumed = _system("freematch", momentum=0.9)
    resumed.load_state_dict(system.state_dict())
    for hook_ in (system.semi_threshold, resumed.semi_threshold):
        hook_(probs.flip(0))
    torch.testing.assert_close(resumed.semi_threshold.p_model, system.semi_threshold.p_model)
    torch.testing.assert_close(resumed.semi_threshold.time_p, system.semi_threshold.time_p)


def _datamodule(root, rank: int, ranks: int, monkeypatch) -> ImageFolderDataModule:
    monkeypatch.setattr(rank_zero_only, "rank", rank)  # the plan's global rank, as a run without a Trainer has it
    monkeypatch.setenv("WORLD_SIZE", str(ranks))
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # the run's seed (a train() before sets it)
    datamodule = ImageFolderDataModule(root / "tree", img_size=16, batch_size=2, cache="none")
    datamodule.setup("fit")
    datamodule.use_unlabelled(SemiSettings(method="fixmatch", images=str(root / "pool" / "train"), ratio=1))
    return datamodule


def _steps(datamodule, count: int, first_epoch: int = 0):
    """(labelled indices, unlabelled indices) of ``count`` steps, epoch after epoch as Lightning numbers them."""
    seen, epoch, loader = [], first_epoch, datamodule.train_dataloader()
    while True:
        loader.sampler.set_epoch(epoch)
        for _ in loader:
            seen.append((datamodule._train_loader.last_indices, datamodule._unlabelled_stream.loader.last_indices))
            if len(seen) == count:
                return seen, epoch
        epoch += 1


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("semi")
    make_image_folder(root / "tree", per_class=4, size=16)  # 8 labelled: 2 steps a rank an epoch on 2 ranks
    make_image_folder(root / "pool", classes=("x",), per_class=7, size=16)  # 7 unlabelled: 2 steps a rank a pass
    return root


def test_the_unlabelled_views_come_normalised_beside_the_labelled_batch(folders, monkeypatch):
    datamodule = _datamodule(folders, 0, 1, monkeypatch)
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["weak"].shape == batch["strong"].shape == (2, 3, 16, 16) and batch["weak"].dtype == torch.uint8
    assert not torch.equal(batch["weak"], batch["strong"])
    ready = datamodule.ready_batch(batch)
    mean, std = (torch.tensor(datamodule.preprocess[k]).view(3, 1, 1) for k in ("mean", "std"))
    for view in ("weak", "strong"):
        torch.testing.assert_close(ready[view], (batch[view] / 255 - mean) / std)
    torch.testing.assert_close(ready["labelled"][0], (batch["labelled"][0] / 255 - mean) / std)


@pytest.mark.parametrize("stop", [1, 2, 3])
def test_both_streams_resume_exactly_mid_epoch(folders, monkeypatch, stop):
    whole, _ = _steps(_datamodule(folders, 1, 2, monkeypatch), 7)
    first = _datamodule(folders, 1, 2, monkeypatch)
    seen, epoch = _steps(first, stop)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
    assert set(state) == {"train_loader", "unlabelled_loader"}
    second = _datamodule(folders, 1, 2, monkeypatch)
    second.load_state_dict(state)
    loader = second.train_dataloader()
    rest = []
    epoch += len(loader) == state["train_loader"]["batches"]  # an epoch that ended: Lightning starts the next
    for e in range(epoch, epoch + 4):  # Lightning continues the interrupted epoch, then the next ones
        loader.sampler.set_epoch(e)
        rest += [(second._train_loader.last_indices, second._unlabelled_stream.loader.last_indices) for _ in loader]
    assert seen + rest[: 7 - stop] == whole


def test_a_run_resumed_mid_epoch_trains_the_samples_of_an_uninterrupted_one(folders, tmp_path):
    """Through a checkpoint: 1 step, then resumed to 3 (mid-epoch and mid-pass) against 3 straight."""
    base = [*TINY, "head=classification", "data=imagefolder", f"data.root={folders / 'tree'}", "data.batch_size=2"]
    base += ["semi=fixmatch", f"semi.images={folders / 'pool' / 'train'}", "semi.ratio=1", "test=false"]
    base += ["head.label_smoothing=0", "export_bundle=false"]
    base += ["+callbacks.sample_keys._target_=vitattn.training.callbacks.SampleKeys"]

    def run(name: str, steps: int, *extra: str) -> tuple[list[str], list[tuple[int, str]]]:
        folder = tmp_path / name
        overrides = [*base, f"+callbacks.sample_keys.folder={folder}", f"trainer.max_steps={steps}", *extra]
        train(compose_train(overrides, folder))
        lines = [json.loads(x) for x in (folder / "semi" / "pseudo_labels.rank0.jsonl").read_text().splitlines()]
        return (folder / "keys.rank0.txt").read_text().splitlines(), [(x["step"], x["key"]) for x in lines]

    whole = run("whole", 3)
    run("part", 1)
    part = run("part", 3, f"ckpt_path={tmp_path / 'part' / 'checkpoints' / 'last.ckpt'}")
    assert [len(x) for x in whole] == [3, 6]  # 3 labelled batches, 2 unlabelled images each
    assert part == whole  # the same labelled keys a step, the same unlabelled images at the same steps


def test_the_unlabelled_stream_covers_every_image_once_a_pass_across_ranks(folders, monkeypatch):
    shares = []
    for rank in range(2):
        steps, _ = _steps(_datamodule(folders, rank, 2, monkeypatch), 2)  # one pass: 4 of the 7 images, a rank
        shares.append([i for _, unlabelled in steps for i in unlabelled])
        theirs = DistributedSampler(range(7), 2, rank, shuffle=True, seed=1)  # the labelled stream's seed + 1
        assert shares[-1] == list(theirs)  # padded as DistributedSampler pads
    assert sorted(set(shares[0] + shares[1])) == list(range(7)) and len(shares[0] + shares[1]) == 8


def test_a_semi_run_trains_logs_its_pseudo_labels_and_checkpoints_its_teacher(folders, tmp_path):
    overrides = [*TINY, "head=classification", "data=imagefolder", f"data.root={folders / 'tree'}"]
    overrides += ["data.batch_size=4", "semi=freematch", f"semi.images={folders / 'pool' / 'train'}", "semi.ratio=2"]
    overrides += ["semi.ema_decay=0.9", "ema.decay=0.9", "head.mixup=0.2", "trainer.max_epochs=2", "test=false"]
    result = train(compose_train([*overrides, "export_bundle=false"], tmp_path / "run"))
    assert result.global_step == 4
    lines = [json.loads(x) for x in (tmp_path / "run" / "semi" / "pseudo_labels.rank0.jsonl").read_text().splitlines()]
    assert len(lines) == 4 * 7 and {x["label"] for x in lines} <= {"cat", "dog"}
    assert {x["key"] for x in lines} == {str(p) for p in (folders / "pool" / "train" / "x").iterdir()}
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert "semi_teacher" in checkpoint and "semi_threshold.p_model" in checkpoint["state_dict"]
    assert not any("teacher" in k for k in checkpoint["state_dict"])


def test_shapes_learn_from_a_pool_of_shards_read_by_sample_key(tmp_path):
    """``semi.images`` of shards (each sample's image, named by its key) beside data=shapes (the weak view: the
    evaluation transform, since shapes are not augmented)."""
    from vitattn.data.shards.writer import shapes_samples, write_shards

    write_shards(shapes_samples("train", 6, img_size=32, seed=9), tmp_path / "shards", 4)
    images = str(tmp_path / "shards" / "{00000..00001}.tar")
    overrides = [*TINY, "head=classification", "data.num_train=8", "data.num_val=4", "semi=fixmatch"]
    overrides += ["head.label_smoothing=0"]
    overrides += [f"semi.images='{images}'", "semi.ratio=1", "data.batch_size=4", "trainer.max_steps=2"]
    train(compose_train([*overrides, "test=false", "export_bundle=false"], tmp_path / "run"))
    lines = (tmp_path / "run" / "semi" / "pseudo_labels.rank0.jsonl").read_text().splitlines()
    keys = {json.loads(x)["key"] for x in lines}
    assert len(lines) == 6 and len(keys) == 6 and all("/" not in k for k in keys)  # one pass: 4, then 2


def test_a_caption_semi_run_logs_each_pool_image_s_caption(folders, tmp_path):
    files = make_coco(tmp_path / "coco", num_train=8, num_val=4, size=32)
    overrides = [*TINY, "head=caption", "trainer.precision=32-true", "data=coco", "data.batch_size=4"]
    overrides += [f"data.{k}={v}" for k, v in files.items()]
    overrides += ["semi=fixmatch", f"semi.images={folders / 'pool' / 'train'}", "semi.ratio=1", "semi.ema_decay=0.5"]
    result = train(compose_train([*overrides, "trainer.max_epochs=1", "test=false", "export_bundle=false"], tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "semi" / "pseudo_labels.rank0.jsonl").read_text().splitlines()]
    assert result.global_step == 2 and all(isinstance(x["label"], str) for x in lines)
    assert len(lines) == len({x["key"] for x in lines}) == 7  # one pass of the 7: a batch of 4, then 3


def test_a_missing_pool_is_refused_in_one_line(folders, tmp_path):
    overrides = [*TINY, "head=classification", "data=imagefolder", f"data.root={folders / 'tree'}"]
    overrides += ["semi=fixmatch", f"semi.images={tmp_path / 'missing'}"]
    with pytest.raises(ConfigError, match=f"^semi.images={tmp_path / 'missing'}: no such folder") as err:
        train(compose_train([*overrides, "test=false", "export_bundle=false"], tmp_path / "run"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["semi.images=pool/"], "^semi.images=pool/ needs a method to label them: add semi=fixmatch"),
        (["semi=fixmatch"], "^semi=fixmatch labels images without labels: give semi.images=POOL"),
        (["semi=fixmatch", "semi.images=p", "semi.ratio=0"], "^semi.ratio=0 must be a whole number"),
        (["semi=fixmatch", "semi.images=p", "semi.threshold=1.5"], "^semi.threshold=1.5 must be a probability"),
    ],
)
def test_the_semi_keys_are_refused_in_one_line_naming_the_key(overrides, line):
    with pytest.raises(ConfigError, match=line) as err:
        semi_settings(compose_train([*TINY, "head=classification", *overrides]))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["head=caption", "semi=freematch"], "^semi=freematch adapts a threshold per class; head=caption has no"),
        (["head=coca"], "^semi=fixmatch with head=coca is not supported"),
        (["head=caption", "finetune=scst", "finetune.init=x"], "does not combine with finetune=scst"),
        (["head=classification", "bootstrap.teacher=t", "bootstrap.images=p"], "two sources of pseudo-labels"),
        (["head=classification", "data=webdataset", "data.train_shards=a.tar"], "data=webdataset"),
        (["head=classification", "trainer=fsdp", "trainer.accelerator=cpu"], "does not work with trainer=fsdp"),
    ],
)
def test_what_semi_does_not_combine_with_is_refused_in_one_line(overrides, line):
    cfg = compose_train([*TINY, "semi=fixmatch", "semi.images=pool/", *overrides])
    with pytest.raises(ConfigError, match=line) as err:
        check_config(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("smoothing", "threshold", "refused"), [(0.1, 0.95, True), (0.1, 0.9, False), (0.0, 0.95, False)]
)
def test_a_threshold_that_label_smoothing_puts_out_of_reach_is_refused_in_one_line(smoothing, threshold, refused):
    """Four classes: a model trained towards the smoothed target gives a class at most 1 - 0.1 + 0.1/4 = 0.925."""
    system = ClassificationSystem({**CONFIG, "num_classes": 4}, ["a", "b", "c", "d"], label_smoothing=smoothing)
    settings = SemiSettings(method="fixmatch", images="pool/", threshold=threshold)
    line = r"^semi\.threshold=0\.95 is never reached with head\.label_smoothing=0\.1 over 4 classes \(no class gets "
    if refused:
        with pytest.raises(ConfigError, match=line + r"more than 0\.925\); FixMatch trains without smoothing"):
            system.use_semi(settings)
    else:
        system.use_semi(settings)
        assert system.semi is settings


def test_the_model_card_says_what_a_semi_run_learned_from(tmp_path):
    from vitattn.bundle.card import _training
    from vitattn.run_dir import RunConfig

    cfg = compose_train([*TINY, "head=classification", "semi=fixmatch", "semi.images=pool/"], tmp_path)
    (line,) = [x for x in _training(RunConfig.of(cfg), None, ["shapes"]) if "without labels" in x]
    assert "pool/" in line and "the model itself" in line and "threshold 0.95" in line and "7 per labelled" in line


def _captioner(generate: dict | None = None, **settings) -> CaptionSystem:
    torch.manual_seed(0)
    vocab = Vocabulary.build(["a red square", "a blue circle left of a green triangle", "two small squares"])
    encoder = {**CONFIG, "num_classes": 0, "drop_rate": 0.5, "drop_path_rate": 0.5}
    ids = dict(pad_id=vocab.pad_id, bos_id=vocab.bos_id, eos_id=vocab.eos_id, unk_id=vocab.unk_id)
    decoder = {"vocab_size": len(vocab), "embed_dim": 32, "num_heads": 2, "max_len": 8, "memory_dim": 32, **ids}
    config = {"encoder": encoder, "decoder": {**decoder, "drop_rate": 0.5}}
    system = CaptionSystem(config, tokenizer_labels(vocab), generate=generate)
    system.log = lambda *a, **k: None  # no trainer attached
    system.use_semi(SemiSettings(method="fixmatch", images="pool/", **settings))
    return system


def test_a_caption_pseudo_label_is_the_greedy_caption_its_confidence_the_mean_token_probability():
    system = _captioner(threshold=0.0)
    model, calls = system.model, []
    model.decoder.register_forward_hook(lambda m, a, out: calls.append((m.training, torch.is_grad_enabled())))
    weak, strong = torch.randn(3, 3, 32, 32, requires_grad=True), torch.randn(3, 3, 32, 32, requires_grad=True)
    model.train()
    loss = system._unlabelled(weak, strong)
    assert all(c == (False, False) for c in calls[:-1]) and calls[-1] == (True, True)  # labelled, then learned
    assert all(m.training for m in model.modules())
    pseudo = system.last_pseudo
    model.eval()
    with torch.no_grad():
        greedy = model.generate(weak)
        # oracle: each prefix's log-probability decoded step by step with the cache, as the search scores tokens
        prefixes = [
            sequence_log_prob(model.start_search(weak, i, 1, True)[0], greedy[:, :i], model.special_ids)
            for i in range(1, greedy.shape[1] + 1)
        ]  # T' x (B,)
    assert torch.equal(pseudo["tokens"], greedy)
    real = greedy != model.special_ids.pad_id
    per_token = torch.stack([prefixes[0], *[b - a for a, b in zip(prefixes, prefixes[1:])]], dim=1).exp() * real
    torch.testing.assert_close(pseudo["confidence"], per_token.sum(1) / real.sum(1))
    model.train()
    loss.backward()
    assert strong.grad is not None and strong.grad.abs().sum() > 0 and weak.grad is None


def test_a_caption_pseudo_label_is_decoded_up_to_the_generation_length():
    """head.generate.max_new_tokens bounds the pseudo-captions as it bounds validation's (null: max_len - 1)."""
    system = _captioner(generate={"max_new_tokens": 2}, threshold=0.0)
    system.model.eval()
    weak = torch.randn(3, 3, 32, 32)
    system._unlabelled(weak, torch.randn(3, 3, 32, 32))
    with torch.no_grad():
        greedy = system.model.generate(weak, max_new_tokens=2)  # (U, 2)
        full = system.model.generate(weak)  # (U, up to 8 - 1)
    assert torch.equal(system.last_pseudo["tokens"], greedy)
    assert full.shape[1] > 2  # the bound cut something


def test_a_caption_pseudo_label_is_kept_above_the_threshold_and_learned_on_the_strong_view():
    system = _captioner(threshold=0.0)
    system.model.eval()  # no dropout: the same logits twice
    weak, strong = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)
    system._unlabelled(weak, strong)
    confidence = system.last_pseudo["confidence"]
    threshold = float(confidence.median())
    system.semi_threshold.threshold = threshold
    loss = system._unlabelled(weak, strong)
    mask, generated = system.last_pseudo["mask"], system.last_pseudo["tokens"]
    assert mask.tolist() == (confidence >= threshold).tolist() and 0 < mask.sum() < 4
    ids = system.model.special_ids
    tokens = torch.cat([torch.full((4, 1), ids.bos_id), generated], dim=1)
    logits = system.model(strong, tokens[:, :-1]).log_softmax(-1)
    by_hand = []
    for row, caption, kept in zip(logits, generated, mask):
        n = int((caption != ids.pad_id).sum())
        by_hand.append(-row[torch.arange(n), caption[:n]].mean() * kept)
    torch.testing.assert_close(loss, torch.stack(by_hand).mean())


def test_a_caption_s_views_neither_flip_nor_change_colours():
    augment = Augment(hflip=1.0, color_jitter=0.4)
    weak = caption_weak_transform(32, augment, {"interpolation": "bicubic"})
    strong = strong_view(weak, "rand-m10-n2-mstd101-inc1", 32, (0.5, 0.5, 0.5), captions=True)
    names = {type(t).__name__ for t in strong.transforms}
    assert not names & {"RandomHorizontalFlip", "ColorJitter", "Cutout"}
    (randaugment,) = [t for t in strong.transforms if type(t).__name__ == "RandAugment"]
    assert {op.name for op in randaugment.ops} == set(CAPTION_SAFE_OPS)
    classes = strong_view(weak, "rand-m10-n2-mstd101-inc1", 32, (0.5, 0.5, 0.5))
    assert isinstance(classes.transforms[-1], Cutout)  # FixMatch's Cutout for classes
