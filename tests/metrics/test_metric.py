"""``CaptionMetrics`` against ``score_captions`` on the whole corpus: in one process, from a plain LightningModule
that is not vitattn's, and on two gloo processes fed by a ``DistributedSampler`` (with and without its padding)."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, DistributedSampler

from vitattn.metrics import CaptionMetrics, score_captions

# (image id, caption, references): captions that share words with other images' references, so that CIDEr-D's
# document frequencies and BLEU's brevity penalty depend on the whole corpus.
CORPUS = [
    (0, "a dog runs on the grass", ["a dog running on grass", "a brown dog on the lawn"]),
    (1, "a cat sits on a red sofa", ["a cat on a sofa", "a small cat sitting on a red couch"]),
    (2, "a man rides a bike", ["a man riding a bicycle down the street"]),
    (3, "two dogs play with a ball", ["two dogs playing with a ball on the grass", "dogs and a ball"]),
    (4, "a cat on the grass", ["a cat lying in the grass", "a grey cat outside"]),
    (5, "a woman holds an umbrella", ["a woman with an umbrella in the rain", "a person holding an umbrella"]),
    (6, "a dog on a sofa", ["a dog sleeping on a couch"]),
    (7, "a red bus on the street", ["a red double decker bus on a street", "a bus driving down the road"]),
    (8, "a man with a dog", ["a man walking his dog", "a man and a dog in the park"]),
]


def _expected(items=CORPUS, synthetic: bool = False) -> dict[str, float]:
    return score_captions(items, synthetic)


def _update(metric: CaptionMetrics, items, with_ids: bool = True) -> None:
    ids, captions, references = zip(*items)
    metric.update(list(captions), list(references), list(ids) if with_ids else None)


def test_caption_metrics_equals_score_captions_on_the_whole_corpus():
    metric = CaptionMetrics()
    for start in range(0, len(CORPUS), 4):  # several batches
        _update(metric, CORPUS[start : start + 4])
    _update(metric, CORPUS[:2])  # repeats of images already seen: scored once
    assert metric.compute() == _expected()
    assert set(_expected()) == {"bleu1", "bleu2", "bleu3", "bleu4", "rouge_l", "cider_d", "distinct", "num_images"}
    assert [item[0] for item in metric.corpus] == list(range(len(CORPUS)))


def test_caption_metrics_synthetic_adds_exact_match_and_reset_starts_over():
    metric = CaptionMetrics(synthetic=True)
    _update(metric, CORPUS[:3])
    assert metric.compute() == _expected(CORPUS[:3], synthetic=True) and "exact_match" in metric.compute()
    metric.reset()
    assert metric.corpus == [] and metric.captions == []
    _update(metric, CORPUS[3:])
    assert metric.compute() == _expected(CORPUS[3:], synthetic=True)


def test_caption_metrics_without_image_ids_scores_every_caption():
    metric = CaptionMetrics()
    _update(metric, CORPUS + CORPUS[:1], with_ids=False)  # nothing tells the repeat apart
    expected = _expected([(i, c, r) for i, (_, c, r) in enumerate(CORPUS + CORPUS[:1])])
    assert metric.compute() == expected and expected["num_images"] == len(CORPUS) + 1


def test_caption_metrics_holding_captions_moves_hashes_and_computes_on_cpu():
    metric = CaptionMetrics(compute_on_cpu=True)
    _update(metric, CORPUS)
    metric.to(torch.float64).to("cpu")  # what a LightningModule does with its children
    assert metric in set(torch.nn.Sequential(metric).modules())  # named_modules hashes each module, states and all
    assert metric.compute() == _expected()


@pytest.mark.parametrize(
    ("captions", "references", "image_ids", "message"),
    [
        (["a", "b"], [["a"]], None, "2 captions but 1 reference lists"),
        (["a"], [["a"]], [0, 1], "1 captions but 2 image_ids"),
        (["a", "b"], [["a"], []], None, "caption 1 needs a list of references, got none"),
        (["a"], ["a cat"], None, "caption 0 needs a list of references, got the str 'a cat'"),
        ("a cat", [["a cat"]], None, "captions must be a list"),
    ],
)
def test_caption_metrics_update_rejects_bad_input(captions, references, image_ids, message):
    with pytest.raises(ValueError, match=message):
        CaptionMetrics().update(captions, references, image_ids)


def test_caption_metrics_update_rejects_image_ids_in_some_updates_only():
    metric = CaptionMetrics()
    metric.update(["a"], [["a"]], [0])
    with pytest.raises(ValueError, match="image_ids given in some updates but not in others"):
        metric.update(["b"], [["b"]])


# ------------------------------------------------------------------------------ a user's LightningModule


class _Captioner(pl.LightningModule):
    """A user's module: it 'generates' the corpus' captions and scores them with ``CaptionMetrics``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.caption_metrics = CaptionMetrics()
        self.computed: dict[str, float] = {}

    def validation_step(self, batch: list[int], batch_idx: int) -> None:
        items = [CORPUS[i] for i in batch]
        self.caption_metrics.update([c for _, c, _ in items], [r for _, _, r in items], [i for i, _, _ in items])

    def on_validation_epoch_end(self) -> None:
        self.computed = self.caption_metrics.compute()
        self.log_dict(self.computed)
        self.caption_metrics.reset()


def test_caption_metrics_in_a_plain_lightning_module_logs_the_corpus_scores(tmp_path):
    module = _Captioner()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        limit_val_batches=3,  # every batch of the corpus: 4 + 4 + 1
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.validate(module, DataLoader(list(range(len(CORPUS))), batch_size=4))
    expected = _expected()
    assert module.computed == expected
    logged = {k: v.item() for k, v in trainer.callback_metrics.items()}
    assert logged == {k: torch.tensor(float(v)).item() for k, v in expected.items()}  # as Lightning stores a float


# -------------------------------------------------------------------------------------------- two ranks


def _rank(rank: int, store: str, out: str, num_images: int, with_ids: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        sampler = DistributedSampler(range(num_images), num_replicas=2, rank=rank, shuffle=True, seed=0)
        metric = CaptionMetrics()
        for batch in DataLoader(list(sampler), batch_size=2):
            _update(metric, [CORPUS[i] for i in batch.tolist()], with_ids)
        local = len(metric.captions)
        scores = metric.compute()
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"scores": scores, "local": local, "after": len(metric.captions)}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("num_images", "with_ids"),
    [
        pytest.param(len(CORPUS), True, id="padded"),  # odd: the sampler repeats one image on one rank
        pytest.param(len(CORPUS) - 1, True, id="not-padded"),
        pytest.param(len(CORPUS) - 1, False, id="not-padded-no-ids"),
    ],
)
def test_caption_metrics_on_two_ranks_equal_one_process_on_the_whole_corpus(tmp_path, num_images, with_ids):
    args = (str(tmp_path / "store"), str(tmp_path / "out"), num_images, with_ids)
    mp.start_processes(_rank, args=args, nprocs=2, start_method="fork")  # forked: no imports of their own
    ranks = [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in (0, 1)]
    assert sum(r["local"] for r in ranks) == num_images + num_images % 2  # the padding repeat is really there
    expected = _expected(CORPUS[:num_images])
    for r in ranks:
        assert r["scores"] == expected  # exactly: one corpus, scored once, on every rank
        assert r["after"] == r["local"]  # compute leaves each rank its own captions to accumulate
