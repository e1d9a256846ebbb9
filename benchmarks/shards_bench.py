"""Shards benchmark: the same images as WebDataset shards and as files, trained on and captioned; resume start-up.

    python -m benchmarks.shards_bench                        # the rows in docs/benchmarks.md (a few minutes here)
    python -m benchmarks.shards_bench --images 400 --steps 20  # a smoke run

Rows (each ratio from one run of this script, the two sides back to back, one torch thread):

1. training steps/s, ``data=webdataset`` on local shards vs ``data=imagefolder`` with ``data.cache=ram``
   (the same JPEG bytes, 64 px shapes; the tiny classifier of the tests at 32 px, and ``model=cpu``, the
   CPU preset of ``make train``, at 64 px), one loader worker each: the
   steady rate (from the end of step 10 to the last, epoch ends included: about 60 steps an epoch) and
   the rate of the whole ``fit`` (its start-up included: the loader's first batch, the RAM cache's build
   is before ``fit``);
2. captioning images/s, ``caption_shards`` (one output per shard) vs ``caption_to_file`` (the same images
   as files, one jsonl), with a random tiny captioner;
3. resume start-up against a 10,000-shard output folder: listing the finished outputs, removing
   temporaries and planning the rest (captioning), and planning a half-trained epoch of 10,000 shards x
   10,000 samples whose trained positions come from a checkpoint (training).

Writes a Markdown table to stdout and ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import torch

from vitattn.bundle import load_bundle
from vitattn.data.shapes import CLASS_NAMES
from vitattn.data.shards import expand_shards, read_shard
from vitattn.data.shards.epoch_split import EpochOrder, PositionSet, split_epoch
from vitattn.data.shards.writer import shapes_samples, write_shards
from vitattn.inference import caption_files, caption_shards, list_inputs
from vitattn.inference.captioning import assign_units, unfinished_shards
from vitattn.training import train
from vitattn.training.config import compose_train

# Quiet, one thread, one loader worker, batches of 32, no validation.
RUN = (
    "data.batch_size=32 data.num_workers=1 trainer.enable_progress_bar=false trainer.enable_model_summary=false "
    "logger=none callbacks=none num_threads=1 test=false export_bundle=false head=classification "
    "trainer.max_epochs=-1 trainer.limit_val_batches=0"
).split()
MODELS = {  # the tests' tiny classifier (32 px, width 32, depth 2); the CPU preset of make train at 64 px
    "tiny": "model.embed_dim=32 model.depth=2 model.num_heads=2 model.patch_size=8 data.img_size=32".split(),
    "cpu": "model=cpu data.img_size=64".split(),
}
TINY = [*MODELS["tiny"], *RUN]


def _data(root: Path, images: int) -> tuple[Path, Path]:
    """Shapes as shards of 500 and the same JPEG files as an ImageFolder tree (train and val)."""
    shards = root / "shards"
    write_shards(shapes_samples("train", images, img_size=64), shards / "train", 500, class_names=CLASS_NAMES)
    write_shards(shapes_samples("val", 64, img_size=64), shards / "val", 500, class_names=CLASS_NAMES)
    tree = root / "tree"
    for url in expand_shards(str(shards / "train")):
        for sample in read_shard(url):
            folder = tree / "train" / f"{int(sample['cls']):02d}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{sample['__key__']}.jpg").write_bytes(sample["jpg"])
    (tree / "val").symlink_to(tree / "train")  # not validated (limit_val_batches=0); every class present
    return shards, tree


class StepTimes(pl.Callback):
    """When each training step of the run ends (``ends[0]``: the start of training)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ends = [time.perf_counter()]

    def on_train_batch_end(self, *args: object) -> None:
        self.ends.append(time.perf_counter())


STEADY_FROM = 10  # steps before the steady rate is timed


def _steps_per_second(overrides: list[str], out: Path) -> tuple[float, float]:
    """(steady steps/s from step ``STEADY_FROM`` on, steps/s of the whole ``fit``) of a training run."""
    timer, build = StepTimes(), pl.Trainer.__init__

    def with_timer(trainer: pl.Trainer, *args: object, callbacks: list | None = None, **kwargs: object) -> None:
        build(trainer, *args, callbacks=[*(callbacks or []), timer], **kwargs)

    with mock.patch.object(pl.Trainer, "__init__", with_timer):  # the run's own Trainer, plus the timer
        result = train(compose_train([*RUN, *overrides, f"paths.output_dir={out}"]))
    ends = timer.ends
    return (len(ends) - 1 - STEADY_FROM) / (ends[-1] - ends[STEADY_FROM]), result.steps_per_second


def training_rows(root: Path, shards: Path, tree: Path, steps: int, repeats: int, model: str = "tiny") -> list[dict]:
    classes = [f"{i:02d}" for i in range(len(CLASS_NAMES))]
    (shards / "train" / "classes.txt").write_text("".join(f"{c}\n" for c in classes))
    limit = f"trainer.max_steps={steps}"
    sides = {
        "shards": ["data=webdataset", f"data.train_shards={shards / 'train'}", f"data.val_shards={shards / 'val'}"],
        "cache": ["data=imagefolder", f"data.root={tree}", "data.cache=ram"],
    }
    rates: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for r in range(repeats):  # alternating, so that neither side has the machine's quiet minutes alone
        for side, overrides in sides.items():
            run = root / f"run-{model}-{side}-{r}"
            rates[side].append(_steps_per_second([*MODELS[model], *overrides, limit], run))
    best = {side: max(rates[side]) for side in sides}  # the repeat with the best steady rate
    what = f"training steps/s, model {model}, shards vs RAM cache"
    return [
        {
            "row": f"{what}, steady (steps {STEADY_FROM}-{steps}, best of {repeats})",
            "ours": best["shards"][0],
            "reference": best["cache"][0],
        },
        {"row": f"{what}, whole fit (same runs)", "ours": best["shards"][1], "reference": best["cache"][1]},
    ]


def caption_row(root: Path, shards: Path, tree: Path, repeats: int) -> dict:
    # a tiny captioner trained for a few steps on the shards (its captions' speed is what counts)
    caption = [o for o in TINY if not o.startswith(("head=", "export_bundle=", "data.num_workers="))]
    run = root / "run-captioner"
    train(
        compose_train(
            [*caption, "head=caption", "data=webdataset", f"data.train_shards={shards / 'val'}"]
            + [f"data.val_shards={shards / 'val'}", "trainer.max_steps=2", f"paths.output_dir={run}"]
        )
    )
    bundle = load_bundle(run / "bundle")
    urls, inputs = expand_shards(str(shards / "train")), list_inputs(str(tree / "train"))
    shard_rates, file_rates = [], []
    for r in range(repeats):
        started = time.perf_counter()
        done = caption_shards(bundle, urls, root / f"captions-{r}", num_workers=1, progress=False)
        shard_rates.append(done.captioned / (time.perf_counter() - started))
        started = time.perf_counter()
        files = caption_files(bundle, inputs, root / f"captions-{r}.jsonl", num_workers=1, progress=False)
        file_rates.append(files.captioned / (time.perf_counter() - started))
    return {
        "row": f"captioning images/s, shards vs files ({len(inputs)} images, best of {repeats})",
        "ours": max(shard_rates),
        "reference": max(file_rates),
    }


def resume_rows(root: Path, shards_count: int = 10_000) -> list[dict]:
    out = root / "resume"
    out.mkdir()
    urls = [f"pipe:cat /data/{i:05d}.tar" for i in range(shards_count)]
    for i in range(0, shards_count, 2):  # half of them finished
        (out / f"{i:05d}.jsonl").write_text("{}\n")
    sizes = [10_000] * shards_count
    started = time.perf_counter()
    todo = unfinished_shards(urls, out, "jsonl")  # what caption_shards lists before any rank writes
    assign_units([sizes[i] for i in todo], 64)
    caption_s = time.perf_counter() - started

    order = EpochOrder(sizes, seed=0, epoch=3)
    trained = PositionSet()  # what 64 ranks x 8 workers leave after half an epoch: runs with holes
    rng, per = random.Random(0), order.total // 512
    for w in range(512):
        start = w * per
        trained.ranges.append((start, start + per // 2 - 600))
        trained.ranges += [(p, p + 1) for p in sorted(rng.sample(range(start + per // 2 - 600, start + per // 2), 400))]
    trained = PositionSet(trained.ranges)
    state = json.dumps({"epoch": 3, "trained": trained.ranges})
    started = time.perf_counter()
    restored = PositionSet(json.loads(state)["trained"])
    split_epoch(restored.complement(order.total), 64, 8, 256)
    train_s = time.perf_counter() - started
    return [
        {"row": f"caption resume start-up, {shards_count} shards, half done", "seconds": caption_s},
        {
            "row": f"training resume plan, {shards_count} shards x 10,000 samples, half an epoch, 64 ranks x 8 workers",
            "seconds": train_s,
            "state_bytes": len(state),
        },
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cpu-steps", type=int, default=100, help="steps of the model=cpu rows")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench_results/shards.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards, tree = _data(root, args.images)
        rows = [
            *training_rows(root, shards, tree, args.steps, args.repeats),
            *training_rows(root, shards, tree, args.cpu_steps, args.repeats, model="cpu"),
            caption_row(root, shards, tree, args.repeats),
            *resume_rows(root),
        ]
    print("| row | ours | reference | ratio |\n|---|---:|---:|---:|")
    for row in rows:
        if "seconds" in row:
            print(f"| {row['row']} | {row['seconds']:.2f} s | | |")
        else:
            print(
                f"| {row['row']} | {row['ours']:.2f} | {row['reference']:.2f} | {row['ours'] / row['reference']:.3f}x |"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
