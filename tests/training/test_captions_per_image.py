"""``data.captions_per_image``: K of an image's references teacher-forced on one encoding of it, drawn from the
epoch's seed and the sample, so a resumed epoch draws what an uninterrupted one does (files, shapes, shards)."""

import json
import random
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.datasets import make_karpathy
from vitattn.data.shapes import ShapesDataset
from vitattn.data.shards.epoch_split import PositionSet
from vitattn.data.shards.writer import shapes_samples, write_shards
from vitattn.data.tokenizer import collate_captions, draw_captions
from vitattn.metrics.tokenize import coco_tokenize
from vitattn.models import ImageCaptioner
from vitattn.training.datamodules import KarpathyDataModule, ShapesDataModule, WebDatasetDataModule


def _words(caption: str) -> str:
    return " ".join(coco_tokenize(caption))


def test_draw_captions_takes_k_distinct_then_every_one_and_repeats():
    refs = ["a", "b", "c"]
    for seed in range(20):
        two = draw_captions(refs, 2, random.Random(seed))
        assert len(set(two)) == 2 and set(two) <= set(refs)
        five = draw_captions(refs, 5, random.Random(seed))
        assert five[:3] == refs and set(five[3:]) <= set(refs)  # each image weighs K captions
    assert draw_captions(refs, "all", random.Random(0)) == refs
    assert {tuple(draw_captions(refs, 2, random.Random(s))) for s in range(50)} > {("a", "b")}  # not a fixed pick


@pytest.fixture(scope="module")
def karpathy(tmp_path_factory):
    return make_karpathy(tmp_path_factory.mktemp("karpathy"), size=32)


def _karpathy(karpathy, per_image, **settings) -> KarpathyDataModule:
    settings = {"img_size": 32, "batch_size": 3, "num_workers": 0, "augment": False, "cache": "none", **settings}
    dm = KarpathyDataModule(karpathy["dataset_json"], karpathy["image_dir"], captions_per_image=per_image, **settings)
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("per_image", [2, "all"])
def test_a_batch_holds_k_captions_of_each_image_and_the_image_of_each(karpathy, per_image):
    dm = _karpathy(karpathy, per_image)
    items = [dm.train_dataset[i, 7] for i in range(4)]  # 3 to 5 references each
    batch = collate_captions(items, dm.vocab.pad_id)
    counts = [2 if per_image == 2 else len(item["references"]) for item in items]
    assert batch["images"].shape[0] == 4 and batch["tokens"].shape[0] == sum(counts)
    assert batch["caption_image"].tolist() == [i for i, n in enumerate(counts) for _ in range(n)]
    for row, image in zip(batch["tokens"], batch["caption_image"].tolist()):
        assert dm.vocab.decode(row) in {_words(r) for r in items[image]["references"]}
    first = [dm.vocab.decode(r) for r, i in zip(batch["tokens"], batch["caption_image"]) if i == 0]
    assert len(set(first)) == len(first)  # K distinct references where the image has K


def test_the_model_encodes_each_image_once_and_reads_it_for_each_of_its_captions():
    torch.manual_seed(0)
    encoder = dict(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2)
    decoder = dict(vocab_size=11, embed_dim=16, depth=1, num_heads=2)
    model = ImageCaptioner.from_config({"encoder": encoder, "decoder": decoder})
    model.eval()
    images, tokens = torch.randn(3, 3, 16, 16), torch.randint(4, 11, (7, 5))
    caption_image = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    encoded: list[int] = []
    model.encoder.patch_embed.register_forward_hook(lambda module, args, out: encoded.append(len(args[0])))
    logits = model(images, tokens, caption_image)
    assert encoded == [3]  # one encoding of the three images, not seven
    torch.testing.assert_close(logits, model(images[caption_image], tokens), rtol=0, atol=1e-6)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_draws_the_captions_an_uninterrupted_one_draws(karpathy, workers):
    def epoch_tokens(dm, stop=None):
        out = []
        for batch in dm.train_dataloader():
            out.append(batch["tokens"].tolist())
            if len(out) == stop:
                break
        return out

    torch.manual_seed(0)
    whole = epoch_tokens(_karpathy(karpathy, 2, num_workers=workers))
    torch.manual_seed(0)
    first = _karpathy(karpathy, 2, num_workers=workers)
    seen = epoch_tokens(first, stop=1)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
    torch.manual_seed(1)  # another global seed: the order and the draws come from the state
    second = _karpathy(karpathy, 2, num_workers=workers)
    second.load_state_dict(state)
    assert seen + epoch_tokens(second) == whole
    torch.manual_seed(0)
    again = _karpathy(karpathy, 2, num_workers=workers)
    epoch_tokens(again)
    assert epoch_tokens(again) != whole  # the next epoch draws anew


def test_shapes_train_on_the_canonical_caption_or_k_of_the_valid_ones():
    canonical = ShapesDataModule(img_size=32, num_train=6, num_val=2, num_test=2)
    canonical.setup("fit")
    scenes = ShapesDataset("train", 6, 32)
    assert [canonical.vocab.decode(canonical.train_dataset[i]["tokens"]) for i in range(6)] == [
        _words(scenes.caption(i)) for i in range(6)
    ]
    every = ShapesDataModule(img_size=32, num_train=6, num_val=2, num_test=2, captions_per_image="all")
    every.setup("fit")
    for i in range(6):
        drawn = [every.vocab.decode(t) for t in every.train_dataset[i, 3]["tokens"]]
        assert drawn == [_words(r) for r in scenes.references(i)]


def test_shard_draws_are_those_of_the_sample_and_epoch_whatever_the_plan(tmp_path):
    write_shards(shapes_samples("train", 20, img_size=32), tmp_path / "train", 6)
    write_shards(shapes_samples("val", 4, img_size=32), tmp_path / "val", 4)

    def datamodule(workers: int, buffer: int, epoch: int) -> WebDatasetDataModule:
        dm = WebDatasetDataModule(
            str(tmp_path / "train"), str(tmp_path / "val"), img_size=32, batch_size=4, num_workers=workers,
            shuffle_buffer=buffer, captions_per_image=3, augment=False, count_cache=tmp_path / "cache",
        )  # fmt: skip
        dm.trainer = SimpleNamespace(current_epoch=epoch, global_rank=0, world_size=1)  # what the plan reads
        dm.setup("fit")
        return dm

    def draws(workers: int, buffer: int, epoch: int = 0, resume: dict | None = None) -> dict[str, list[list[int]]]:
        dm = datamodule(workers, buffer, epoch)
        if resume is not None:
            dm.load_state_dict(resume)
        out = {}
        for shard_batch in dm.train_dataloader():
            batch = shard_batch.batch
            for j, key in enumerate(shard_batch.keys):
                rows = batch["tokens"][batch["caption_image"] == j].tolist()
                out[key] = [[t for t in row if t != dm.vocab.pad_id] for row in rows]  # padded to the batch's longest
        return out

    one = draws(0, 0)
    assert len(one) == 20 and all(len(rows) == 3 for rows in one.values())
    assert draws(2, 8) == one  # another plan and read order, the same captions per sample
    stopped = datamodule(0, 0, 0)
    stopped.epoch, stopped.trained = 0, PositionSet([(0, 8)])  # 8 samples trained when it stopped
    rest = draws(0, 0, resume=json.loads(json.dumps(stopped.state_dict())))
    assert len(rest) == 12 and rest == {key: one[key] for key in rest}  # the rest of the epoch, drawn as before
    assert draws(0, 0, epoch=1) != one  # each epoch draws anew


@pytest.mark.parametrize("value", [0, -1, "most", 1.5, True])
def test_a_bad_captions_per_image_is_one_line(karpathy, value):
    with pytest.raises(ValueError, match=r"^data.captions_per_image=.* must be a whole number of at least 1, or all$"):
        KarpathyDataModule(karpathy["dataset_json"], karpathy["image_dir"], captions_per_image=value)
