"""Online pseudo-labels (vitattn.training.semi): the threshold, the views, the labelling pass, the EMA teacher,
FreeMatch's state, the unlabelled stream's resume and its split across ranks, and what the config refuses."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from tests.helpers import TINY, compose_train, make_image_folder
from vitattn.errors import ConfigError
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
from vitattn.training.systems import ClassificationSystem

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
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(ranks))
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
        (["head=caption"], "head=caption is not supported yet"),
        (["head=coca"], "head=coca is not supported"),
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


def test_the_model_card_says_what_a_semi_run_learned_from(tmp_path):
    from vitattn.bundle.card import _training

    cfg = compose_train([*TINY, "head=classification", "semi=fixmatch", "semi.images=pool/"], tmp_path)
    (line,) = [x for x in _training(cfg, None, ["shapes"]) if "without labels" in x]
    assert "pool/" in line and "the model itself" in line and "threshold 0.95" in line and "7 per labelled" in line
