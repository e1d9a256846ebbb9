"""Learning benchmark: ``vitattn-train`` against a plain timm loop, same data, model size, steps, batch, threads.

    python -m benchmarks learning                     # both datasets, both tasks (see docs/learning.md)
    python -m benchmarks learning --quick             # a smoke run: 40 steps a side
    python -m benchmarks learning --steps 1000 --threads 2 --datasets emoji --tasks caption
    python -m benchmarks learning --update-doc        # also rewrite the table in docs/learning.md
    python -m benchmarks learning --train-seeds 0     # one training seed (default 0 1 2: means and ranges)
    python -m benchmarks learning --vitattn-args data.augment=false head.label_smoothing=0.0

For each dataset (``benchmarks/learning_data.py``: Debian packages, prepared into ``bench_data/``) and
task, ``vitattn-train`` runs as a subprocess with vitattn's own training defaults, only the model
size, batch, step count, threads and seed set; the plain side is a ~40-line loop in this process:
a timm ``VisionTransformer`` of the same size (plus, for captions, an ``nn.TransformerDecoder``
greedy captioner), AdamW, linear warmup + cosine, no augmentation. Both are scored on the val split
(vitattn's final evaluation of the split, ``test=true`` with no test split) with vitattn's metrics.

Writes the table to stdout and ``--out`` (default ``bench_results/learning.json``). The target is
vitattn >= the plain loop on every row: the mean of vitattn's runs over the training seeds
(``--train-seeds``, default 0 1 2; ``--quick`` one) against the mean of the plain loop's, each with its range.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models.vision_transformer import VisionTransformer as TimmViT
from timm.optim import param_groups_weight_decay
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence
from torchvision.datasets import ImageFolder
from torchvision.transforms.functional import pil_to_tensor

from benchmarks import learning_data
from benchmarks.report import markdown_table, update_doc
from benchmarks.timing import children_cpu, stopwatch
from vitattn.data import Vocabulary, load_coco_captions, read_image
from vitattn.metrics import compute_caption_metrics, distinct_share, exact_match

SCHEMA = "vitattn-learning-bench/1"
REPO = Path(__file__).resolve().parents[1]
TASKS = ("classification", "caption")
METRICS = {"classification": ("acc",), "caption": ("exact_match", "cider_d")}
METRIC_NAMES = {"acc": "val accuracy", "exact_match": "caption exact match", "cider_d": "CIDEr-D"}
DOC = REPO / "docs" / "learning.md"
DOC_START, DOC_END = "<!-- learning-bench:table:start -->", "<!-- learning-bench:table:end -->"


@dataclass
class BenchConfig:
    """What both sides share: model size, image size, batch, steps, threads, seed; and the plain loop's optimizer.

    The plain loop's AdamW settings are vitattn's defaults when this bench was written (lr 2e-3,
    weight decay 0.05, 200 warmup steps capped at a tenth of the run, cosine to 1 % of the peak);
    vitattn's side takes whatever its config says now.
    """

    steps: int = 500
    threads: int = 1
    batch_size: int = 64
    img_size: int = 32
    patch_size: int = 4
    embed_dim: int = 128
    depth: int = 4
    num_heads: int = 4
    mlp_ratio: float = 2.0
    decoder_depth: int = 2
    max_caption_len: int = 32
    seed: int = 0
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_steps: int = 200
    min_lr_ratio: float = 0.01
    vitattn_args: list[str] = field(default_factory=list)

    @property
    def encoder(self) -> dict[str, Any]:
        keys = ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio")
        return {k: getattr(self, k) for k in keys}


@dataclass
class Side:
    """One side of a row: metrics on the val split, optimizer steps taken, wall and CPU seconds, how it ran."""

    metrics: dict[str, float]
    steps: int
    seconds: float
    cpu_seconds: float
    command: str


def vitattn_overrides(
    task: str, data: learning_data.PreparedDataset | None, cfg: BenchConfig, run_dir: Path, source: list[str] = ()
) -> list[str]:
    """``vitattn-train`` overrides for ``task`` on ``data``: size, batch, steps and threads set, the rest vitattn's;
    ``source``: other data's keys in place of ``data``'s."""
    source = list(source) or _data_source(task, data, cfg)
    size = [f"model.{k}={v}" for k, v in cfg.encoder.items() if k != "img_size"]
    return [
        *source,
        f"data.img_size={cfg.img_size}",
        f"data.batch_size={cfg.batch_size}",
        "data.num_workers=0",
        "model=cpu",
        *size,
        f"trainer.max_steps={cfg.steps}",
        "trainer.max_epochs=-1",
        "trainer.limit_val_batches=0",  # evaluate once, at the end (test=true on the val split)
        "trainer.enable_progress_bar=false",
        "+trainer.enable_checkpointing=false",
        "callbacks=none",
        "logger=csv",
        f"num_threads={cfg.threads}",
        f"seed={cfg.seed}",
        "test=true",
        "export_bundle=false",
        *cfg.vitattn_args,
        f"hydra.run.dir={run_dir}",
    ]


def _data_source(task: str, data: learning_data.PreparedDataset, cfg: BenchConfig) -> list[str]:
    if task == "classification":
        return ["head=classification", "data=imagefolder", f"data.root={data.root}"]
    return [
        "head=caption",
        "data=coco",
        f"data.image_dir={data.root}",
        f"data.train_annotations={data.train_annotations}",
        f"data.val_annotations={data.val_annotations}",
        f"data.max_caption_len={cfg.max_caption_len}",
        f"head.decoder.depth={cfg.decoder_depth}",
    ]


def run_vitattn(task: str, data: learning_data.PreparedDataset, cfg: BenchConfig, run_dir: Path) -> Side:
    """Train with ``vitattn-train`` in a subprocess; its final evaluation of the val split is the score."""
    return run_overrides(task, vitattn_overrides(task, data, cfg, run_dir), cfg.threads, run_dir)


def run_overrides(task: str, overrides: list[str], threads: int, run_dir: Path) -> Side:
    """``vitattn-train overrides`` in a subprocess on ``threads`` threads, its log in ``run_dir``; the final
    evaluation's ``test/`` metrics (its ``test=true``) are the score."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "vitattn.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HYDRA_FULL_ERROR": "1"}
    with open(log, "w") as f, stopwatch(children_cpu) as took:
        done = subprocess.run(
            [sys.executable, "-m", "vitattn.cli.train", *overrides], stdout=f, stderr=subprocess.STDOUT, env=env
        )
    command = "vitattn-train " + " ".join(shlex.quote(o) for o in overrides)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:]
        raise RuntimeError(f"vitattn-train failed (exit {done.returncode}, log {log}): {' '.join(tail)}")
    row = _last_row_with(run_dir / "csv" / "metrics.csv", f"test/{METRICS[task][0]}")
    metrics = {k.split("/", 1)[1]: float(v) for k, v in row.items() if k.startswith("test/") and v != ""}
    return Side(metrics, int(row["step"]), took.seconds, took.cpu, command)


def _last_row_with(path: Path, key: str) -> dict[str, str]:
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get(key)]
    if not rows:
        raise RuntimeError(f"{path} has no {key}: the vitattn run logged no final evaluation")
    return rows[-1]


def _images(paths: Sequence[Path], img_size: int) -> Tensor:
    """(N, 3, S, S) float images, ImageNet-normalised, resized only if the file is another size."""
    mean = torch.tensor(IMAGENET_DEFAULT_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_DEFAULT_STD).view(3, 1, 1)
    out = []
    for path in paths:
        image = read_image(path)
        if image.size != (img_size, img_size):
            image = image.resize((img_size, img_size))
        out.append((pil_to_tensor(image).float() / 255 - mean) / std)
    return torch.stack(out)


def timm_vit(cfg: BenchConfig, num_classes: int) -> TimmViT:
    """timm's ``VisionTransformer`` of the bench's size: class token, pre-norm, GELU, qkv bias."""
    return TimmViT(**cfg.encoder, num_classes=num_classes, global_pool="token", qkv_bias=True)


def train_plain(model: nn.Module, loss_of: Callable[[Tensor], Tensor], num_items: int, cfg: BenchConfig) -> int:
    """AdamW, linear warmup + cosine, ``cfg.steps`` steps over reshuffled batches of item indices.

    Returns:
        The optimizer steps taken.
    """
    optimizer = torch.optim.AdamW(param_groups_weight_decay(model, cfg.weight_decay), lr=cfg.lr)
    warmup = max(1, min(cfg.warmup_steps, cfg.steps // 10))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, cfg.steps - warmup)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    generator = torch.Generator().manual_seed(cfg.seed)
    model.train()
    step = 0
    while step < cfg.steps:
        for batch in torch.randperm(num_items, generator=generator).split(cfg.batch_size):
            loss = loss_of(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if step == cfg.steps:
                break
    model.eval()
    return step


def _plain_description(cfg: BenchConfig, what: str) -> str:
    enc = ", ".join(f"{k}={v}" for k, v in cfg.encoder.items())
    return (
        f"plain loop: {what} timm VisionTransformer({enc}); AdamW lr={cfg.lr} wd={cfg.weight_decay}, "
        f"warmup {max(1, min(cfg.warmup_steps, cfg.steps // 10))} + cosine; batch {cfg.batch_size}; "
        f"{cfg.steps} steps; {cfg.threads} thread{'s' if cfg.threads != 1 else ''}; no augmentation"
    )


def plain_classification(data: learning_data.PreparedDataset, cfg: BenchConfig) -> Side:
    """Train and score the plain timm classifier on ``data``'s ImageFolder tree."""
    with stopwatch() as took:
        torch.manual_seed(cfg.seed)
        train, val = (ImageFolder(data.root / split) for split in ("train", "val"))
        x_train = _images([Path(p) for p, _ in train.samples], cfg.img_size)
        y_train = torch.tensor(train.targets)
        model = timm_vit(cfg, len(train.classes))
        steps = train_plain(model, lambda idx: F.cross_entropy(model(x_train[idx]), y_train[idx]), len(y_train), cfg)
        x_val, y_val = _images([Path(p) for p, _ in val.samples], cfg.img_size), torch.tensor(val.targets)
        with torch.no_grad():
            pred = torch.cat([model(x).argmax(-1) for x in x_val.split(256)])
        acc = (pred == y_val).float().mean().item()
    return Side({"acc": acc}, steps, took.seconds, took.cpu, _plain_description(cfg, "a"))


class PlainCaptioner(nn.Module):
    """timm ViT tokens -> pre-norm ``nn.TransformerDecoder`` (learned positions, GELU) -> words; greedy decoding."""

    def __init__(self, cfg: BenchConfig, vocab_size: int, pad_id: int) -> None:
        super().__init__()
        width = cfg.embed_dim
        self.encoder = timm_vit(cfg, 0)
        self.embed = nn.Embedding(vocab_size, width, padding_idx=pad_id)
        self.pos = nn.Parameter(torch.randn(1, cfg.max_caption_len, width) * 0.02)
        layer = nn.TransformerDecoderLayer(
            width, cfg.num_heads, int(width * cfg.mlp_ratio), 0.0, "gelu", batch_first=True, norm_first=True
        )
        self.decoder = nn.TransformerDecoder(layer, cfg.decoder_depth, norm=nn.LayerNorm(width))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, images: Tensor, tokens: Tensor, memory: Tensor | None = None) -> Tensor:
        """(B, 3, H, W), (B, T) -> (B, T, V) next-token logits (causal)."""
        memory = self.encoder.forward_features(images) if memory is None else memory
        T = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T)
        x = self.decoder(self.embed(tokens) + self.pos[:, :T], memory, tgt_mask=mask, tgt_is_causal=True)
        return self.head(x)

    @torch.no_grad()
    def generate(self, images: Tensor, vocab: Vocabulary, max_len: int) -> Tensor:
        """Greedy captions (B, <= max_len - 1) after ``<bos>``; pad and bos are never chosen."""
        memory = self.encoder.forward_features(images)
        tokens = torch.full((len(images), 1), vocab.bos_id, dtype=torch.long)
        done = torch.zeros(len(images), dtype=torch.bool)
        for _ in range(max_len - 1):
            logits = self(images, tokens, memory)[:, -1]
            logits[:, [vocab.pad_id, vocab.bos_id]] = float("-inf")
            nxt = logits.argmax(-1).masked_fill(done, vocab.pad_id)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            done |= nxt == vocab.eos_id
            if bool(done.all()):
                break
        return tokens[:, 1:]


def plain_caption(data: learning_data.PreparedDataset, cfg: BenchConfig, save_to: Path | None = None) -> Side:
    """Train and score the plain timm captioner on ``data``'s COCO caption files (all training words kept).

    ``save_to``: a JSON file for the val captions with their references.
    """
    with stopwatch() as took:
        torch.manual_seed(cfg.seed)
        train, val = load_coco_captions(data.train_annotations), load_coco_captions(data.val_annotations)
        vocab = Vocabulary.build([c for image in train for c in image.captions], min_freq=1)
        x_train = _images([data.root / image.file_name for image in train], cfg.img_size)
        refs = [[torch.tensor(vocab.encode(c, cfg.max_caption_len)) for c in image.captions] for image in train]
        model = PlainCaptioner(cfg, len(vocab), vocab.pad_id)
        pick = torch.Generator().manual_seed(cfg.seed + 1)

        def loss_of(idx: Tensor) -> Tensor:
            chosen = [refs[i][torch.randint(len(refs[i]), (), generator=pick).item()] for i in idx.tolist()]
            tokens = pad_sequence(chosen, batch_first=True, padding_value=vocab.pad_id)  # (B, T)
            logits = model(x_train[idx], tokens[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=vocab.pad_id)

        steps = train_plain(model, loss_of, len(train), cfg)
        x_val = _images([data.root / image.file_name for image in val], cfg.img_size)
        captions = [
            c for x in x_val.split(128) for c in vocab.decode_batch(model.generate(x, vocab, cfg.max_caption_len))
        ]
        references = [list(image.captions) for image in val]
        metrics = compute_caption_metrics(captions, references)
        metrics["exact_match"] = exact_match(captions, references)
        metrics["distinct"] = distinct_share(captions)
    if save_to is not None:
        records = [
            {"image_id": im.image_id, "caption": c, "references": list(im.captions)}
            for im, c in zip(val, captions, strict=True)
        ]
        save_to.write_text(json.dumps(records, ensure_ascii=False, indent=0) + "\n")
    what = f"a {cfg.decoder_depth}-layer nn.TransformerDecoder captioner (greedy, all training words) on a"
    return Side(metrics, steps, took.seconds, took.cpu, _plain_description(cfg, what))


def bench_row(data: learning_data.PreparedDataset, task: str, cfg: BenchConfig, out_dir: Path) -> list[dict[str, Any]]:
    """Run both sides of ``task`` on ``data``; one table row per metric."""
    torch.set_num_threads(cfg.threads)
    run_dir = out_dir / f"{data.name}-{task}-seed{cfg.seed}"
    ours = run_vitattn(task, data, cfg, run_dir)
    if task == "classification":
        plain = plain_classification(data, cfg)
    else:
        plain = plain_caption(data, cfg, save_to=run_dir / "plain_captions.json")
    rows = []
    for metric in METRICS[task]:
        mine, theirs = ours.metrics.get(metric, float("nan")), plain.metrics[metric]
        rows.append(
            {
                "dataset": data.name,
                "task": task,
                "metric": metric,
                "vitattn": mine,
                "plain": theirs,
                "status": "PASS" if mine >= theirs else "MISS",
                "note": _note(task, ours.metrics, plain.metrics),
                "steps": cfg.steps,
                "seed": cfg.seed,
                "vitattn_steps": ours.steps,
                "plain_steps": plain.steps,
                "threads": cfg.threads,
                "vitattn_seconds": ours.seconds,
                "plain_seconds": plain.seconds,
                "vitattn_cpu_seconds": ours.cpu_seconds,
                "plain_cpu_seconds": plain.cpu_seconds,
                "num_train": data.num_train,
                "num_val": data.num_val,
                "vitattn_command": ours.command,
                "plain_command": plain.command,
                "vitattn_metrics": ours.metrics,
                "plain_metrics": plain.metrics,
            }
        )
    return rows


def _note(task: str, ours: dict[str, float], plain: dict[str, float]) -> str:
    """Caption rows: the share of distinct captions on each side (near 0: one caption for every image)."""
    if task != "caption" or "distinct" not in ours:
        return ""
    return f"distinct captions {100 * ours['distinct']:.0f} % / {100 * plain['distinct']:.0f} %"


ROW_KEY = ("dataset", "task", "metric")
SIDE_METRICS = ("vitattn_metrics", "plain_metrics")


def combine_seeds(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per dataset, task and metric from the runs of each training seed: the means of both sides.

    The row keeps every seed's value (``vitattn_runs``, ``plain_runs``, ``seeds``); its status compares
    the means; seconds and the sides' other metrics are means too. A single seed gives the run itself
    (plus those lists).
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(tuple(run[k] for k in ROW_KEY), []).append(run)
    rows = []
    for group in groups.values():
        row = {k: v for k, v in group[0].items() if k != "seed"}
        row["seeds"] = [run.get("seed") for run in group]
        for side in ("vitattn", "plain"):
            row[f"{side}_runs"] = [run[side] for run in group]
        for key in ("vitattn", "plain", *(k for k in row if k.endswith("_seconds"))):
            row[key] = sum(run[key] for run in group) / len(group)
        row["status"] = "PASS" if row["vitattn"] >= row["plain"] else "MISS"
        if all(m in run for run in group for m in SIDE_METRICS):  # the note from the seeds' mean metrics
            for m in SIDE_METRICS:
                row[m] = {k: sum(run[m][k] for run in group) / len(group) for k in group[0][m]}
            row["note"] = _note(row["task"], *(row[m] for m in SIDE_METRICS))
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of the rows (``combine_seeds``'s: with several seeds, each cell is the mean and its range)."""
    header = ["dataset", "task", "metric", "vitattn", "plain timm", "target", "steps", "seeds", "threads"]
    lines = []
    for r in rows:
        seeds = r.get("seeds") or [r.get("seed")]
        lines.append(
            [r["dataset"], r["task"], METRIC_NAMES[r["metric"]], _cell(r, "vitattn"), _cell(r, "plain")]
            + [r["status"], r["steps"], len(seeds), r["threads"], f"{r['vitattn_seconds']:.0f}"]
            + [f"{r['plain_seconds']:.0f}", r.get("note", "")]
        )
    return markdown_table([*header, "vitattn s", "plain s", "note"], lines)


def _cell(row: dict[str, Any], side: str) -> str:
    """The side's value, and with several runs its range: ``78.0 % (77.3–79.9)``."""
    runs, metric = row.get(f"{side}_runs") or [row[side]], row["metric"]
    text = _fmt(row[side], metric)
    if len(runs) > 1:
        low, high = (_fmt(v, metric).removesuffix(" %") for v in (min(runs), max(runs)))
        text += f" ({low}–{high})"
    return text


def _fmt(value: float, metric: str) -> str:
    return f"{100 * value:.1f} %" if metric in ("acc", "exact_match") else f"{value:.3f}"


def commands_block(rows: Sequence[dict[str, Any]], argvs: Sequence[Sequence[str]]) -> str:
    """The bench's own commands and each vitattn run's, as a Markdown code block (paths relative to the repo).

    ``argvs``: the bench's arguments, one list per bench process whose runs are in ``rows``.
    """
    lines = [
        "```bash",
        *("python -m benchmarks learning " + " ".join(shlex.quote(a) for a in argv) for argv in argvs),
    ]
    seen = set()
    for r in rows:
        key = (r["dataset"], r["task"])
        if key not in seen:
            seen.add(key)
            command = r["vitattn_command"].replace(f"{REPO}{os.sep}", "")
            lines += [f"# {r['dataset']} {r['task']}", command, f"# {r['plain_command']}"]
    return "\n".join([*lines, "```"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per side (default 500, quick 40)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads on both sides (default 1)")
    p.add_argument("--quick", action="store_true", help="40 steps a side: checks that everything runs")
    p.add_argument("--datasets", nargs="+", choices=sorted(learning_data.DATASETS), default=["tuxpaint", "emoji"])
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--img-size", type=int, default=32, help="image side; the data is prepared at this size")
    p.add_argument("--patch-size", type=int, default=4)
    p.add_argument("--embed-dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=4, help="encoder layers")
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--decoder-depth", type=int, default=2, help="caption decoder layers")
    p.add_argument("--seed", type=int, default=0, help="data split seed (and the training seed with --quick)")
    p.add_argument(
        "--train-seeds",
        type=int,
        nargs="+",
        default=None,
        help="training seeds, each a run of both sides (default 0 1 2; --quick: --seed)",
    )
    p.add_argument("--vitattn-args", nargs="*", default=[], help="extra vitattn-train overrides (vitattn side only)")
    p.add_argument("--cache", type=Path, default=learning_data.DEFAULT_CACHE, help="dataset cache (bench_data/)")
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "learning.json")
    p.add_argument("--update-doc", action="store_true", help="rewrite the table in docs/learning.md")
    p.add_argument(
        "--doc-from", type=Path, nargs="+", default=None, help="only rewrite the doc's table from saved JSON files"
    )


def config_from(args: argparse.Namespace) -> BenchConfig:
    """The shared settings from the command line (options and ``BenchConfig`` fields share their names)."""
    steps = args.steps if args.steps is not None else (40 if args.quick else 500)
    if steps < 1 or args.threads < 1:
        raise ValueError(f"--steps {steps} and --threads {args.threads} must be at least 1")
    given = {f.name for f in fields(BenchConfig)} & vars(args).keys() - {"steps"}
    return BenchConfig(steps=steps, **{name: getattr(args, name) for name in given})


def train_seeds(args: argparse.Namespace) -> list[int]:
    """The training seeds: ``--train-seeds``, else 0 1 2 (``--quick``: ``--seed`` alone)."""
    if args.train_seeds:
        return list(args.train_seeds)
    return [args.seed] if args.quick else [0, 1, 2]


def run(args: argparse.Namespace) -> dict[str, Any]:
    argv = args.argv
    if args.doc_from is not None:
        saved = [json.loads(path.read_text()) for path in args.doc_from]
        rows = combine_seeds([run for result in saved for run in result.get("runs", result["rows"])])
        commands = commands_block(rows, [result["argv"] for result in saved])
        update_doc(DOC, DOC_START, DOC_END, f"{format_table(rows)}\n\n{commands}")
        print(f"table of {', '.join(map(str, args.doc_from))} written into {DOC}")
        return {"rows": rows}
    cfg = config_from(args)
    out_dir = args.out.parent / "learning_runs"
    runs: list[dict[str, Any]] = []
    datasets: dict[str, dict[str, Any]] = {}
    for name in args.datasets:
        data = learning_data.prepare(name, cfg.img_size, args.seed, args.cache)
        datasets[name] = data.info
        print(f"{name}: {data.num_train} train / {data.num_val} val images, {len(data.classes)} classes", flush=True)
        for task in args.tasks:
            for seed in train_seeds(args):
                for run in bench_row(data, task, replace(cfg, seed=seed), out_dir):
                    runs.append(run)
                    print(
                        f"  {name} {task} seed {seed} {run['metric']}: vitattn {run['vitattn']:.4f} "
                        f"({run['vitattn_seconds']:.0f} s), plain {run['plain']:.4f} ({run['plain_seconds']:.0f} s) "
                        f"{run['status']}",
                        flush=True,
                    )
    rows = combine_seeds(runs)
    table = format_table(rows)
    print("\n" + table)
    result = {
        "schema": SCHEMA,
        "argv": argv,
        "config": asdict(cfg),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__},
        "datasets": datasets,
        "rows": rows,
        "runs": runs,
        "table": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwritten to {args.out}")
    if args.update_doc:
        update_doc(DOC, DOC_START, DOC_END, f"{table}\n\n{commands_block(rows, [argv])}")
        print(f"table written into {DOC}")
    return result
