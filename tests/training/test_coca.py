"""``head=coca``: the contrastive losses against references written from the logits, two ranks (gloo, DDP and FSDP)
against one process on both batches, the captioning path against the plain captioner's, a run end to end."""

import csv
import math
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from tests.helpers.datasets import make_coco, make_karpathy
from tests.helpers.images import make_image_folder
from tests.helpers.runs import TINY, TINY_SHAPES, ZERO_SHOT_CLASSES, compose_train
from vitattn.bundle import load_bundle, load_checkpoint
from vitattn.data.shards.writer import shapes_samples, write_shards
from vitattn.data.tokenizer import Vocabulary
from vitattn.errors import ConfigError
from vitattn.losses import ClipLoss, SigLipLoss
from vitattn.metrics.metric import RetrievalMetrics
from vitattn.models import CaptionDecoder, CocaCaptioner, ImageCaptioner, VisionTransformer
from vitattn.run_dir import RunDir
from vitattn.training import train
from vitattn.training.config import check_config
from vitattn.training.systems import CaptionSystem, CocaSystem
from vitattn.training.systems.coca import contrastive_model_config
from vitattn.training.systems.sharding import shard_layers

WORDS = "a red blue green circle square on the".split()
B, T = 4, 6  # pairs per rank; caption length, <bos> and <eos> included


def _unit(*shape: int) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(*shape), dim=-1)


def test_clip_loss_is_the_mean_of_both_cross_entropies_at_any_scale():
    image, text = _unit(5, 8), _unit(5, 8)
    for scale in (1 / 0.07, 300.0):  # no cap in the loss: the system clamps the parameter after each step
        logits = scale * image @ text.T  # (images, texts)
        reference = -(logits.log_softmax(1).diagonal().mean() + logits.log_softmax(0).diagonal().mean()) / 2
        torch.testing.assert_close(ClipLoss()(image, text, torch.tensor(math.log(scale))), reference)


def test_siglip_loss_sums_a_binary_loss_per_pair_over_the_texts_and_averages_over_the_images():
    image, text, bias = _unit(5, 8), _unit(5, 8), torch.tensor(-2.0)
    logits = 10.0 * image @ text.T + bias
    same = torch.eye(5, dtype=torch.bool)
    reference = -(torch.sigmoid(logits)[same].log().sum() + torch.sigmoid(-logits)[~same].log().sum()) / 5
    torch.testing.assert_close(SigLipLoss()(image, text, torch.tensor(math.log(10.0)), bias), reference)


def test_siglip_auto_bias_starts_random_embeddings_at_the_loss_minimum():
    n = 6
    eye = torch.eye(2 * n)
    image, text = eye[:n], eye[n:]  # every image orthogonal to every text: each logit is the bias
    head = {"loss": "siglip", "embed_dim": 8, "text_depth": 1, "text_num_heads": 2, "text_mlp_ratio": 2.0}
    for init, slope in (("auto", 0.0), (-10.0, -1.0)):  # d loss / d bias = n sigmoid(bias) - 1
        bias = torch.tensor(contrastive_model_config({**head, "init_logit_bias": init}, n)["init_logit_bias"])
        bias.requires_grad_()
        SigLipLoss()(image, text, torch.tensor(0.0), bias).backward()
        torch.testing.assert_close(bias.grad, torch.tensor(slope), atol=1e-3, rtol=0)


def _system(loss: str) -> CocaSystem:
    """A tiny CocaSystem, the same weights for the same seed."""
    torch.manual_seed(0)
    vocab = Vocabulary(WORDS)
    encoder = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
    decoder = dict(vocab_size=len(vocab), embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0, max_len=8, drop_rate=0.0)
    head = {"loss": loss, "embed_dim": 16, "text_depth": 1, "text_num_heads": 2, "text_mlp_ratio": 2.0}
    config = {"encoder": encoder, "decoder": decoder, "contrastive": contrastive_model_config(head, 2 * B)}
    system = CocaSystem(config, WORDS, contrastive_loss=loss)
    system.model.double()  # float64: the ranks' sums in another order stay far within 1e-6
    return system


def _batch() -> dict[str, torch.Tensor]:
    """Two ranks' batches, concatenated: captions of one length, so that each rank's caption loss averages as many
    tokens and the ranks' mean is the whole batch's."""
    generator = torch.Generator().manual_seed(1)
    words = torch.randint(4, 4 + len(WORDS), (2 * B, T - 2), generator=generator)
    tokens = torch.cat([torch.full((2 * B, 1), 1), words, torch.full((2 * B, 1), 2)], dim=1)  # (2B, T)
    images = torch.randn(2 * B, 3, 32, 32, generator=generator, dtype=torch.float64)
    return {"images": images, "tokens": tokens, "image_ids": torch.arange(2 * B)}  # as collate_captions gives it


class _Loss(nn.Module):
    """The system's training loss as a module's forward, as Lightning's DDP wrapper calls it."""

    def __init__(self, system: CocaSystem) -> None:
        super().__init__()
        self.system = system

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.system._loss(batch)


def _loss_and_gradients(system: CocaSystem, batch: dict, mode: str) -> dict:
    if mode == "ddp":
        ddp = DistributedDataParallel(_Loss(system))  # held until the backward, whose gradients it averages
        loss = ddp(batch)
    else:
        if mode == "fsdp":
            shard_layers(system.model, init_device_mesh("cpu", (dist.get_world_size(),)))
        loss = system._loss(batch)
    loss.backward()
    params = [(n, p) for n, p in system.model.named_parameters() if p.grad is not None]
    grads = {n: p.grad.full_tensor() if mode == "fsdp" else p.grad for n, p in params}
    return {"loss": loss.detach(), "contrastive": system._terms["contrastive_loss"], "grads": grads}


def _rank(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        rows = slice(rank * B, (rank + 1) * B)
        results = {}
        for loss in ("clip", "siglip"):
            for mode in ("ddp", "fsdp"):
                batch = {k: v[rows] for k, v in _batch().items()}
                results[loss, mode] = _loss_and_gradients(_system(loss), batch, mode)
            system, unequal = _system(loss), slice(0, 3) if rank == 0 else slice(3, 2 * B)  # 3 and 5 pairs
            with mock.patch.object(dist_nn, "all_gather", wraps=dist_nn.all_gather) as with_grad:
                system._loss({k: v[unequal] for k, v in _batch().items()})
            results[loss, "unequal"] = {
                "contrastive": system._terms["contrastive_loss"],
                "with_grad": with_grad.call_count,
            }
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each case's loss and gradients on two forked gloo processes (no imports of their own), each with its half of
    ``_batch``."""
    folder = tmp_path_factory.mktemp("ranks")
    mp.start_processes(_rank, args=(str(folder / "store"), str(folder / "out")), nprocs=2, start_method="fork")
    return [torch.load(folder / f"out.{rank}", weights_only=True) for rank in (0, 1)]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_two_ranks_give_the_loss_and_gradients_of_one_process_on_both_batches(loss, mode, two_ranks):
    expected = _loss_and_gradients(_system(loss), _batch(), "one")
    ranks = [results[loss, mode] for results in two_ranks]
    # the mean over the ranks of each rank's share; the contrastive term logged, that mean on every rank
    torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, expected["loss"], rtol=0, atol=1e-6)
    for rank in ranks:
        torch.testing.assert_close(rank["contrastive"], expected["contrastive"], rtol=0, atol=1e-6)
    for rank in ranks:  # DDP's and FSDP's mean of the ranks' gradients, on every rank
        assert rank["grads"].keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(rank["grads"][name], grad, rtol=0, atol=1e-6, msg=name)
    assert ranks[0]["loss"] != ranks[1]["loss"]  # each rank's loss is over its own rows
    assert expected["grads"]["logit_scale"].abs() > 1e-3 and expected["grads"]["text.cls_token"].abs().sum() > 1e-3


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_unequal_batches_log_one_process_loss_and_gather_with_gradients_only_what_the_loss_uses(loss, two_ranks):
    # 3 pairs on rank 0, 5 on rank 1: each rank's share weighs its rows, the logged term is the whole batch's
    expected = _loss_and_gradients(_system(loss), _batch(), "one")["contrastive"]
    for results in two_ranks:
        torch.testing.assert_close(results[loss, "unequal"]["contrastive"], expected, rtol=0, atol=1e-6)
        assert results[loss, "unequal"]["with_grad"] == {"clip": 2, "siglip": 1}[loss]  # siglip: the texts alone


def _captioner_and_coca() -> tuple[ImageCaptioner, CocaCaptioner]:
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
    decoder = CaptionDecoder(12, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, max_len=8, drop_rate=0.0)
    coca = CocaCaptioner(encoder, decoder, embed_dim=16, text_depth=1, text_num_heads=2, text_mlp_ratio=2.0)
    plain = ImageCaptioner.from_config({"encoder": encoder.config, "decoder": decoder.config})
    plain.load_state_dict(coca.state_dict(), strict=False)
    return plain.eval(), coca.eval()


@torch.no_grad()
def test_coca_captions_as_the_plain_captioner_with_its_weights_and_training_encodes_once():
    plain, coca = _captioner_and_coca()
    images, tokens = torch.randn(3, 3, 32, 32), torch.randint(4, 12, (3, T))
    for settings in ({}, {"num_beams": 3}, {"do_sample": True, "top_k": 4}):
        torch.manual_seed(0)
        expected = plain.generate(images, **settings)
        torch.manual_seed(0)
        assert torch.equal(coca.generate(images, **settings), expected), settings
    logits, image, text = coca.forward_coca(images, tokens, tokens)
    torch.testing.assert_close(logits, plain(images, tokens[:, :-1]))
    torch.testing.assert_close(image, coca.embed_images(images))
    torch.testing.assert_close(text, coca.embed_texts(tokens))
    torch.testing.assert_close(image.norm(dim=-1), torch.ones(3))


@torch.no_grad()
def test_a_text_embedding_ignores_the_padding():
    _, coca = _captioner_and_coca()
    tokens = torch.tensor([[1, 5, 6, 7, 2]])
    padded = torch.cat([tokens, torch.zeros(1, 3, dtype=torch.long)], dim=1)  # <pad> is 0
    torch.testing.assert_close(coca.embed_texts(padded), coca.embed_texts(tokens))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("head.contrastive.loss=triplet", "head.contrastive.loss='triplet' is unknown; choose clip or siglip"),
        ("head.caption_weight=-1", "head.caption_weight=-1 must be a number of 0 or more"),
        ("head.contrastive_weight=0 head.caption_weight=0", "head.contrastive_weight=0 and head.caption_weight=0"),
        ("head.contrastive_ramp_steps=-5", "head.contrastive_ramp_steps=-5 must be a whole number of steps, 0 or more"),
        ("head.contrastive.init_logit_bias=low", "head.contrastive.init_logit_bias='low' must be auto or a number"),
    ],
)
def test_a_bad_coca_loss_setting_is_refused_by_the_system_in_one_line_before_any_step(override, message, tmp_path):
    cfg = compose_train(["head=coca", *TINY, *TINY_SHAPES, *override.split()], tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        train(cfg)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "head.monitor=val/i2t_r5",
            "head.monitor=val/i2t_r5 head.monitor_mode=max: head=coca picks its best checkpoint by one of "
            "val/cider_d, val/i2t_r1, val/t2i_r1, val/zero_shot_top1, with head.monitor_mode=max",
        ),
        ("head.monitor=val/zero_shot_top1", "head.monitor=val/zero_shot_top1 needs head.zero_shot.data_root=DIR"),
    ],
)
def test_a_bad_coca_setting_is_refused_in_one_line(override, message, tmp_path):
    cfg = compose_train(["head=coca", "trainer.precision=32-true", *override.split()], tmp_path)
    with pytest.raises(ConfigError) as error:
        check_config(cfg)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_a_coca_run_logs_both_terms_and_its_bundle_captions_and_embeds(loss, tmp_path):
    overrides = ["head=coca", f"head.contrastive.loss={loss}", *TINY, *TINY_SHAPES, "trainer.fast_dev_run=true"]
    cfg = compose_train(overrides, tmp_path)
    result = train(cfg)
    logged = {k: float(v) for k, v in result.system.trainer.callback_metrics.items()}
    for stage in ("train", "val"):  # loss = 1.0 * contrastive + 2.0 * caption
        total = logged[f"{stage}/contrastive_loss"] + 2.0 * logged[f"{stage}/caption_loss"]
        assert logged[f"{stage}/loss"] == pytest.approx(total, rel=1e-5)
    assert result.metrics["val/cider_d"] >= 0.0
    assert 0 <= logged["val/i2t_r1"] <= logged["val/i2t_r5"] <= 1 and 0 <= logged["val/t2i_r1"] <= 1
    bundle, single = load_bundle(result.bundle_dir), load_checkpoint(tmp_path / "checkpoints" / "last.ckpt", "cpu")
    assert isinstance(bundle.model, CocaCaptioner) and (bundle.model.logit_bias is None) == (loss == "clip")
    images, tokens = torch.randn(2, 3, 32, 32), torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0]])
    with torch.no_grad():
        assert torch.equal(bundle.model.generate(images), single.model.generate(images))
        torch.testing.assert_close(bundle.model.embed_images(images), single.model.embed_images(images))
        texts = bundle.model.embed_texts(tokens)
    assert texts.shape == (2, cfg.model.embed_dim)
    torch.testing.assert_close(texts.norm(dim=-1), torch.ones(2))


@pytest.mark.parametrize(
    "monitor, best", [("val/i2t_r1", 1), ("val/t2i_r1", 2), ("val/zero_shot_top1", 0), ("val/cider_d", None)]
)
def test_the_best_checkpoint_is_the_one_with_the_best_value_of_head_monitor(monitor, best, tmp_path, monkeypatch):
    """Three validations whose retrieval recalls and zero-shot accuracies are set to differ from each other and
    from CIDEr-D: the best checkpoint kept is the step where the chosen monitor peaked."""
    recalls = iter([(0.1, 0.5), (0.9, 0.2), (0.3, 0.8)])  # (i2t_r1, t2i_r1) of validations 1, 2, 3
    accuracies = iter([0.7, 0.4, 0.6])  # zero_shot_top1 of validations 1, 2, 3

    def compute(self):
        i2t, t2i = next(recalls)
        return {"i2t_r1": i2t, "t2i_r1": t2i}

    def zero_shot_accuracy(self):
        return {"zero_shot_top1": torch.tensor(next(accuracies))}

    monkeypatch.setattr(RetrievalMetrics, "compute", compute)
    monkeypatch.setattr(CocaSystem, "_zero_shot_accuracy", zero_shot_accuracy)
    folder = make_image_folder(tmp_path / "folder", classes=("red", "blue"), per_class=1, size=8)
    overrides = ["head=coca", "trainer.precision=32-true", *TINY, *TINY_SHAPES, f"head.monitor={monitor}"]
    overrides += [f"head.zero_shot.data_root={folder}"]
    overrides += ["trainer.max_steps=6", "trainer.max_epochs=-1", "trainer.val_check_interval=2"]
    overrides += ["trainer.check_val_every_n_epoch=null", "trainer.num_sanity_val_steps=0", "test=false"]
    result = train(compose_train(overrides, tmp_path))
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("val/t2i_r1")]
    values = [float(row[monitor]) for row in rows]
    assert len(values) == 3 and values.count(max(values)) == 1
    at = values.index(max(values))
    assert best is None or at == best
    checkpoint = torch.load(RunDir(tmp_path).best_checkpoint, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == int(rows[at]["step"]) + 1 == 2 * (at + 1)
    assert result.weights.startswith(f"best ({monitor} {max(values):.4f} at step {2 * (at + 1)})")


@pytest.mark.parametrize(
    "data, extra",
    [
        ("coco", ["ema.decay=0.9"]),
        ("karpathy", ["data.captions_per_image=all"]),
        ("webdataset", ["trainer.precision=bf16-mixed"]),
        ("shapes", ["ema.decay=0.9"]),
    ],
)
def test_coca_trains_on_the_caption_data_paths_with_ema_and_bf16(data, extra, tmp_path):
    """COCO json, a Karpathy split (every reference of an image in the step), shards and the built-in data, with
    EMA or bf16: both terms logged, finite, summed with their weights."""
    if data == "karpathy":
        given = [f"data.{k}={v}" for k, v in make_karpathy(tmp_path / "karpathy", size=32).items()]
    elif data == "coco":
        given = [f"data.{k}={v}" for k, v in make_coco(tmp_path / "coco", num_train=8, num_val=4, size=32).items()]
    elif data == "webdataset":
        shards = write_shards(shapes_samples("train", 8, img_size=32), tmp_path / "shards", 4)
        given = [f"data.train_shards={shards[0].parent}", f"data.val_shards={shards[0]}", "data.num_workers=0"]
    else:
        given = list(TINY_SHAPES)
    overrides = ["head=coca", *TINY, f"data={data}", *given, *extra, "trainer.max_steps=2", "trainer.max_epochs=-1"]
    overrides += ["trainer.log_every_n_steps=1", "trainer.num_sanity_val_steps=0", "test=false"]
    if "trainer.precision=bf16-mixed" not in extra:
        overrides.append("trainer.precision=32-true")
    result = train(compose_train(overrides, tmp_path / "run"))
    assert result.global_step == 2
    with open(tmp_path / "run" / "csv" / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/contrastive_loss")]
    assert [int(r["step"]) for r in rows] == [0, 1]
    for row in rows:
        terms = [float(row[f"train/{k}"]) for k in ("loss", "contrastive_loss", "caption_loss")]
        assert all(math.isfinite(t) and t > 0 for t in terms)
        assert terms[0] == pytest.approx(terms[1] + 2.0 * terms[2], rel=1e-3)


@pytest.fixture(params=["coca", "caption"])
def zero_shot_run(request):
    """A head=coca (its scorer contrastive) or head=caption (caption likelihood) run validated at its last step
    with zero-shot classification of a six-class folder (the shared small runs of tests/conftest.py): the folder,
    the run, its logged metrics and its system as the last checkpoint holds it."""
    run = request.getfixturevalue(f"small_{request.param}_run")
    folder = Path(RunDir(run).load_config().head.zero_shot.data_root)
    system = (CocaSystem if request.param == "coca" else CaptionSystem).load_from_checkpoint(
        run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False
    )
    return folder, run, RunDir(run).load_result()["metrics"], system


def test_zero_shot_at_validation_is_what_vitattn_eval_gives_for_those_weights(zero_shot_run):
    from vitattn.evaluation import evaluate_zero_shot

    folder, run, logged, _ = zero_shot_run
    report = evaluate_zero_shot(load_checkpoint(run / "checkpoints" / "last.ckpt", "cpu"), data_root=folder)
    assert report.metrics["num_images"] == 24 and report.class_names == sorted(ZERO_SHOT_CLASSES)
    assert logged["val/zero_shot_top1"] == pytest.approx(report.metrics["top1"], abs=1e-6)
    assert logged["val/zero_shot_top5"] == pytest.approx(report.metrics["top5"], abs=1e-6)
    assert 0 < report.metrics["top5"] < 1  # six classes: top-5 can miss, so a top-k mix-up would show


def test_zero_shot_ranks_count_each_image_once_and_sum_as_one_process(zero_shot_run):
    """Each rank's counts (top-1 hits, top-5 hits, images) over its share, summed as the strategy sums them,
    equal one process's over the whole folder."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import Precision

    system = zero_shot_run[3].eval()
    counts = {}
    for world in (1, 2, 3):
        for rank in range(world):
            key = (world, rank)
            strategy = SimpleNamespace(reduce=lambda t, reduce_op, key=key: counts.setdefault(key, t.clone()))
            trainer = SimpleNamespace(
                world_size=world, global_rank=rank, strategy=strategy, precision_plugin=Precision()
            )
            system._trainer = trainer
            system._zero_shot_accuracy()
    single = counts[(1, 0)]
    assert single[2] == 24 and single[1] >= single[0]
    for world in (2, 3):
        torch.testing.assert_close(sum(counts[(world, r)] for r in range(world)), single)


@pytest.mark.parametrize(
    "setting, message",
    [
        ("head.zero_shot.data_root=MISSING", "head.zero_shot.data_root=MISSING: image folder not found: MISSING/val"),
        ("head.zero_shot.templates=a photo", "template 'a photo' has no {}"),
    ],
)
def test_a_bad_zero_shot_folder_or_template_is_one_line_before_training(setting, message, tmp_path):
    folder = make_image_folder(tmp_path / "folder", classes=("red", "blue"), per_class=1, size=8)
    missing = str(tmp_path / "absent")
    setting, message = setting.replace("MISSING", missing), message.replace("MISSING", missing)
    overrides = ["head=coca", "trainer.precision=32-true", *TINY, *TINY_SHAPES, f"head.zero_shot.data_root={folder}"]
    with pytest.raises(ConfigError) as error:
        train(compose_train([*overrides, setting], tmp_path / "run"))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "precision", "weights"), [("ddp", "32-true", torch.float32), ("fsdp", "bf16-mixed", torch.bfloat16)]
)
def test_zero_shot_on_two_ranks_is_what_vitattn_eval_gives_at_that_precision(strategy, precision, weights, tmp_path):
    """Two gloo processes, each classifying half of a 24-image folder, under DDP in fp32 and under FSDP2 with
    bf16-mixed (the validation's precision context: its bf16 weights meet bf16 inputs): the logged accuracy is that
    of the whole folder as ``vitattn-eval task=zero_shot`` classifies it at the same precision on the same weights
    (FSDP2's policy holds the weights in bf16, so the evaluated model's are cast to bf16 and run under autocast)."""
    import dataclasses
    import os
    import subprocess
    import sys

    from vitattn.evaluation import evaluate_zero_shot

    folder = make_image_folder(tmp_path / "folder", classes=ZERO_SHOT_CLASSES, per_class=4, size=36)
    run = tmp_path / "run"
    args = ["head=coca", f"trainer={strategy}", "trainer.accelerator=cpu", "trainer.devices=2"]
    args += [f"trainer.precision={precision}", *TINY, *TINY_SHAPES, f"head.zero_shot.data_root={folder}"]
    args += ["trainer.max_steps=3", "trainer.max_epochs=-1", "trainer.val_check_interval=3"]
    args += ["trainer.check_val_every_n_epoch=null", "trainer.num_sanity_val_steps=0"]
    args += ["test=false", "export_bundle=false", "logger=csv", f"hydra.run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "vitattn.cli.train", *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run / "csv" / "metrics.csv", newline="") as f:
        (row,) = [row for row in csv.DictReader(f) if row.get("val/zero_shot_top1")]
    bundle = load_checkpoint(run / "checkpoints" / "last.ckpt", "cpu")
    precision = "fp32" if weights == torch.float32 else "bf16"
    report = evaluate_zero_shot(
        dataclasses.replace(bundle, model=bundle.model.to(weights), precision=precision), data_root=folder
    )
    assert float(row["val/zero_shot_top1"]) == pytest.approx(report.metrics["top1"], abs=1e-6)
    assert float(row["val/zero_shot_top5"]) == pytest.approx(report.metrics["top5"], abs=1e-6)
