"""The contrastive losses with every positive: against a loss written plainly from the logits, on one process and
on 2 and 3 gloo processes with unequal batches (one process on the concatenation); in fp32 under autocast; the
temperature clamped after the optimizer step."""

import math
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.training.test_coca import _batch, _system
from vitattn.losses import CONTRASTIVE_LOSSES, MAX_LOGIT_SCALE, loss_over_ranks

PAD = 0
# Each image's texts as token ids (<bos> 1, <eos> 2, <pad> 0): image 0 has two references; the text of images 1, 4
# and 7 is the same, so are those of 2 and 6 (6 on another rank with 2 processes), and 8's second equals 5's.
TEXTS = [
    [[1, 5, 6, 2], [1, 7, 2]],
    [[1, 8, 2]],
    [[1, 5, 9, 9, 2]],
    [[1, 6, 2]],
    [[1, 8, 2]],
    [[1, 9, 5, 2]],
    [[1, 5, 9, 9, 2]],
    [[1, 8, 2]],
    [[1, 7, 7, 2], [1, 9, 5, 2]],
]
E = 6  # embedding width


def _data() -> dict[str, torch.Tensor]:
    """Every image's features, every text's features, its image and its ids (padded to the longest), float64."""
    generator = torch.Generator().manual_seed(0)
    rows = [row for texts in TEXTS for row in texts]
    width = max(map(len, rows))
    return {
        "image": torch.randn(len(TEXTS), 5, generator=generator, dtype=torch.float64),
        "text": torch.randn(len(rows), 4, generator=generator, dtype=torch.float64),
        "text_image": torch.tensor([i for i, texts in enumerate(TEXTS) for _ in texts]),
        "text_ids": torch.tensor([row + [PAD] * (width - len(row)) for row in rows]),
    }


def _contrastive(loss: str, image, text, model, text_image, text_ids) -> torch.Tensor:
    """The ``loss`` module's value with ``model``'s temperature and, for SigLIP, its bias; the ids padded to the
    model's length, as ``CocaSystem`` pads them (the ranks' widths differ)."""
    text_ids = F.pad(text_ids, (0, model.max_len - text_ids.shape[1]), value=model.decoder.pad_id)
    bias = model.logit_bias if loss == "siglip" else None
    return CONTRASTIVE_LOSSES[loss]()(image, text, model.logit_scale, bias, text_image, text_ids)


class _Towers(torch.nn.Module):
    """Two linear maps to unit embeddings, a temperature and a bias: the parameters DDP would average."""

    max_len = 8

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.image_proj = torch.nn.Linear(5, E, bias=False, dtype=torch.float64)
        self.text_proj = torch.nn.Linear(4, E, bias=False, dtype=torch.float64)
        self.logit_scale = torch.nn.Parameter(torch.tensor([math.log(10.0)], dtype=torch.float64))
        self.logit_bias = torch.nn.Parameter(torch.tensor([-2.0], dtype=torch.float64))
        self.decoder = SimpleNamespace(pad_id=PAD)

    def forward(self, data: dict, loss: str) -> torch.Tensor:
        image = F.normalize(self.image_proj(data["image"]), dim=-1)
        text = F.normalize(self.text_proj(data["text"]), dim=-1)
        return _contrastive(loss, image, text, self, data["text_image"], data["text_ids"])

    def embeddings(self, data: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.image_proj(data["image"]), dim=-1), F.normalize(self.text_proj(data["text"]), dim=-1)


def _reference(loss: str, towers: _Towers, data: dict) -> torch.Tensor:
    """The loss written from the logits: a text is a positive of image i when it is one of i's texts or reads as
    one of them; CLIP's target spread evenly over the positives of each row, both ways; SigLIP's labels +-1."""
    image, text = towers.embeddings(data)
    words = [tuple(t for t in row.tolist() if t != PAD) for row in data["text_ids"]]
    owner = data["text_image"].tolist()
    own = [{words[k] for k in range(len(words)) if owner[k] == i} for i in range(len(image))]
    positive = torch.tensor([[words[j] in own[i] for j in range(len(text))] for i in range(len(image))])
    logits = towers.logit_scale.exp() * image @ text.T  # (images, texts)
    if loss == "siglip":
        labels = 2 * positive.double() - 1
        return -F.logsigmoid(labels * (logits + towers.logit_bias)).sum() / len(image)
    per_image = -(positive / positive.sum(1, keepdim=True) * logits.log_softmax(1)).sum(1).mean()
    per_text = -(positive / positive.sum(0, keepdim=True) * logits.log_softmax(0)).sum(0).mean()
    return (per_image + per_text) / 2


def _loss_and_gradients(loss: str, data: dict, reference: bool = False) -> dict[str, torch.Tensor]:
    towers = _Towers()
    value = _reference(loss, towers, data) if reference else towers(data, loss)
    value.backward()
    grads = {name: p.grad for name, p in towers.named_parameters() if p.grad is not None}
    return {"loss": value.detach(), **grads}


def _share(data: dict, first: int, last: int) -> dict[str, torch.Tensor]:
    """Images ``first`` to ``last`` and their texts, as a rank holds them: its own image indices, and its ids cut
    to its longest text (the ranks' widths differ)."""
    mine = (data["text_image"] >= first) & (data["text_image"] < last)
    ids = data["text_ids"][mine]
    return {
        "image": data["image"][first:last],
        "text": data["text"][mine],
        "text_image": data["text_image"][mine] - first,
        "text_ids": ids[:, : int((ids != PAD).sum(1).max())],
    }


def test_the_losses_are_the_hand_written_ones_with_every_reference_and_equal_texts_positive():
    data = _data()
    for loss in ("clip", "siglip"):
        expected = _loss_and_gradients(loss, data, reference=True)
        got = _loss_and_gradients(loss, data)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-10, msg=f"{loss} {key}")


def _rank(rank: int, world: int, sizes: list[int], store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        first = sum(sizes[:rank])
        data = _share(_data(), first, first + sizes[rank])
        results = {loss: _loss_and_gradients(loss, data) for loss in ("clip", "siglip")}
        for result in results.values():
            result["logged"] = loss_over_ranks(result["loss"])
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sizes", [[5, 4], [4, 3, 2]])
def test_ranks_with_unequal_batches_give_the_loss_and_gradients_of_one_process(sizes, tmp_path):
    """Each rank's images (and their texts) of ``sizes``; the mean over ranks of each rank's loss and of its
    parameters' gradients (DDP's and FSDP's average) is the hand-written loss of all of them together. Forked
    ranks (no imports of their own: under a second each), so the fast suite sees what only unequal batches show,
    a SigLIP normaliser over the rank's own images (open_clip's)."""
    assert sum(sizes) == len(TEXTS)
    args = (len(sizes), sizes, str(tmp_path / "store"), str(tmp_path / "out"))
    mp.start_processes(_rank, args=args, nprocs=len(sizes), start_method="fork")
    ranks = [torch.load(tmp_path / f"out.{rank}", weights_only=True) for rank in range(len(sizes))]
    for loss in ("clip", "siglip"):
        expected = _loss_and_gradients(loss, _data(), reference=True)
        for key, value in expected.items():
            mean = sum(rank[loss][key] for rank in ranks) / len(ranks)
            torch.testing.assert_close(mean, value, rtol=0, atol=1e-6, msg=f"{loss} {key}")
        assert len({float(rank[loss]["loss"]) for rank in ranks}) == len(ranks)  # each rank's own rows
        for rank in ranks:  # what every rank logs: the loss of one process
            torch.testing.assert_close(rank[loss]["logged"], expected["loss"], rtol=0, atol=1e-6, msg=f"{loss} logged")


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_the_loss_runs_in_fp32_with_autocast_off(loss):
    """Under CPU autocast in bf16, the loss of bf16 embeddings is the fp32 loss of those embeddings to fp32's
    precision (a bf16 matmul of the logits would be off by about 1e-2)."""
    towers, data = _Towers(), _data()
    image, text = (x.bfloat16() for x in towers.embeddings(data))  # what the towers give under autocast
    model = SimpleNamespace(logit_scale=towers.logit_scale.float(), logit_bias=towers.logit_bias.float())
    model.max_len, model.decoder = towers.max_len, towers.decoder
    args = (model, data["text_image"], data["text_ids"])
    with torch.no_grad():
        expected = _contrastive(loss, image.float(), text.float(), *args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _contrastive(loss, image, text, *args)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_fp32_embeddings_under_bf16_autocast_give_the_hand_written_loss(loss):
    """The loss of fp32 embeddings under the caller's bf16 autocast is the float64 hand-written one to fp32's
    precision: the loss turns autocast off (bf16 logits would be off by about 1e-2)."""
    towers, data = _Towers(), _data()
    image, text = (x.float() for x in towers.embeddings(data))
    model = SimpleNamespace(logit_scale=towers.logit_scale.float(), logit_bias=towers.logit_bias.float())
    model.max_len, model.decoder = towers.max_len, towers.decoder
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = _contrastive(loss, image, text, model, data["text_image"], data["text_ids"])
    expected = _reference(loss, towers, data).detach()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_gradient_reaches_the_temperature_at_and_above_its_cap():
    data = _data()
    for log_scale in (torch.tensor(MAX_LOGIT_SCALE, dtype=torch.float32).item(), math.log(150.0)):
        towers = _Towers()
        towers.logit_scale.data.fill_(log_scale)
        towers(data, "clip").backward()
        assert towers.logit_scale.grad.abs() > 1e-4, log_scale


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_temperature_past_the_cap_comes_back_after_the_optimizer_step(accumulate):
    """A scale set at log 1000 is clamped in place to log 100 (as float32 rounds it) by the step of a Trainer."""
    system = _system("clip").float()
    system.model.logit_scale.data.fill_(math.log(1000.0))
    batches = [{k: v.float() if v.is_floating_point() else v for k, v in _batch().items()}] * accumulate
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(system, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    cap = torch.tensor(MAX_LOGIT_SCALE, dtype=torch.float32)
    assert trainer.global_step == 1 and system.model.logit_scale.item() == cap.item()


def test_the_contrastive_weight_ramps_from_zero_over_its_steps_at_training_only():
    """Half the ramp: half the weight in the loss; at evaluation and past the ramp the full weight."""
    system = _system("clip")
    system.contrastive_weight, system.contrastive_ramp_steps = 3.0, 10
    batch = _batch()
    caption, contrastive = (term.detach().double() for term in system._pair_terms(batch, 0.0))
    steps = {}
    system.trainer = SimpleNamespace(global_step=0)  # global_step reads the trainer's
    for step in (0, 5, 10, 40):
        system.trainer.global_step = step
        steps[step] = system._loss(batch).detach().double()
    assert torch.allclose(steps[0], 2.0 * caption)
    assert torch.allclose(steps[5], 2.0 * caption + 1.5 * contrastive)
    assert torch.allclose(steps[10], 2.0 * caption + 3.0 * contrastive) and torch.allclose(steps[40], steps[10])
    system.eval()
    system.trainer.global_step = 0
    assert torch.allclose(system._loss(batch).detach().double(), steps[10])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_coca_trains_on_shards_on_two_processes_with_unequal_batches(tmp_path):
    """Nine samples, two ranks, batch 4: rank 0 trains on five and rank 1 on four, so a step's batches differ."""
    import csv
    import os
    import subprocess
    import sys

    from tests.helpers.runs import TINY
    from vitattn.data.shards.writer import shapes_samples, write_shards

    shards = write_shards(shapes_samples("train", 9, img_size=32), tmp_path / "shards", 3)
    run = tmp_path / "run"
    args = ["head=coca", "data=webdataset", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    args += [*TINY, "data.batch_size=4", f"data.train_shards={shards[0].parent}", f"data.val_shards={shards[0]}"]
    args += ["data.num_workers=0", "trainer.precision=32-true", "trainer.max_epochs=1", "trainer.log_every_n_steps=1"]
    args += [
        "trainer.num_sanity_val_steps=0",
        "test=false",
        "export_bundle=false",
        "logger=csv",
        f"hydra.run.dir={run}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "vitattn.cli.train", *args], capture_output=True, text=True, timeout=350, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run / "csv" / "metrics.csv", newline="") as f:
        losses = [
            float(row["train/contrastive_loss"]) for row in csv.DictReader(f) if row.get("train/contrastive_loss")
        ]
    assert len(losses) == 2 and all(math.isfinite(loss) and loss > 0 for loss in losses)
