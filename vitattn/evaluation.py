"""Evaluate a trained model on a split: caption metrics, or top-1 / top-5 accuracy and a confusion matrix.

Dimension letters: B batch, K classes, T' generated tokens.

Where the data comes from:

- captions: a COCO caption file (``references`` + ``image_dir``), or the training run's own data
  config (``RUN/config.yaml``): the built-in shapes split is regenerated (with the model's
  vocabulary) and a COCO run's val / test annotations are used. Captions are generated with the
  bundle's decoding defaults and any overrides, or read from a ``predictions`` file (JSON Lines from
  ``vitattn-caption``, or COCO results ``[{"image_id", "caption"}]``) and matched to the references
  by image id.
- classification: an ImageFolder split ``data_root/<split>/<class>/<image>`` (class folders are
  matched to the model's classes by name), or the run's shapes / ImageFolder data.

Scores are computed once over the whole split, each image once; ``write_report`` puts
``metrics.json`` (and ``captions.jsonl`` or the confusion matrix) into a folder, each file atomically.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from vitattn.bundle import Bundle
from vitattn.fileio import atomic_write
from vitattn.metrics import compute_caption_metrics, distinct_share, exact_match

__all__ = [
    "EvalReport",
    "evaluate_captions",
    "evaluate_classification",
    "exact_match",
    "find_run_dir",
    "format_report",
    "read_predictions",
    "save_confusion_matrix",
    "write_report",
]

log = logging.getLogger(__name__)

SPLITS = ("val", "test")
RUN_CONFIG = "config.yaml"
_SHAPES = "vitattn.data.ShapesDataModule"
_IMAGE_FOLDER = "vitattn.data.ImageFolderDataModule"
_COCO = "vitattn.data.CocoCaptionDataModule"
_LABELS = {
    "bleu1": "BLEU-1",
    "bleu2": "BLEU-2",
    "bleu3": "BLEU-3",
    "bleu4": "BLEU-4",
    "rouge_l": "ROUGE-L",
    "cider_d": "CIDEr-D",
    "exact_match": "exact match",
    "distinct": "distinct captions",
    "top1": "top-1 accuracy",
    "top5": "top-5 accuracy",
    "num_images": "images",
    "num_failed": "images failed",
    "num_missing": "images without a prediction",
}


@dataclass
class EvalReport:
    """One evaluation: what was scored, how, and the scores.

    Attributes:
        task: ``caption`` or ``classification``.
        split: ``val`` or ``test``.
        data: where the images and references (or labels) came from.
        metrics: caption: ``bleu1..4``, ``rouge_l``, ``cider_d``, ``distinct``, ``exact_match``
            (synthetic references only); classification: ``top1``, ``top5``; both: ``num_images``
            scored, and ``num_failed`` / ``num_missing`` when some images could not be scored.
        decoding: the ``generate`` keyword arguments used (empty for predictions and classification).
        predictions: the predictions file scored, if any.
        captions: ``(image_id, caption, references)`` per scored image, sorted by id (caption task).
        confusion: (K, K) counts, rows true class, columns predicted (classification task).
        class_names: the model's classes (classification task).
    """

    task: str
    split: str
    data: str
    metrics: dict[str, float]
    decoding: dict[str, Any] = field(default_factory=dict)
    predictions: str | None = None
    captions: list[tuple[Any, str, list[str]]] = field(default_factory=list)
    confusion: Tensor | None = None
    class_names: list[str] | None = None

    @property
    def complete(self) -> bool:
        """Every image of the split was scored."""
        return not self.metrics.get("num_failed") and not self.metrics.get("num_missing")


# ---------------------------------------------------------------------------------------- the run


def find_run_dir(model: str | os.PathLike) -> Path | None:
    """The training run folder that ``model`` belongs to (it holds ``config.yaml``), or None.

    ``model`` may be the run folder, its ``bundle/`` (or the bundle's ``config.json``), or a
    checkpoint in its ``checkpoints/``.
    """
    path = Path(model).resolve()
    if path.is_file():
        path = path.parent  # checkpoints/x.ckpt or bundle/config.json
    for candidate in (path, path.parent):
        if (candidate / RUN_CONFIG).is_file():
            return candidate
    return None


def _run_data(run_dir: Path | None, wanted: str) -> Any:
    """The ``data`` node of the run's saved config; a one-line error says what to pass instead."""
    if run_dir is None:
        raise ValueError(
            f"the model is not inside a training run (no {RUN_CONFIG} beside it), so there is no split to take; give {wanted}"
        )
    from omegaconf import OmegaConf

    try:
        data = OmegaConf.load(run_dir / RUN_CONFIG).get("data")
    except Exception as err:  # noqa: BLE001 - YAML and OmegaConf raise their own types
        raise ValueError(f"{run_dir / RUN_CONFIG} cannot be read: {' '.join(str(err).split())[:200]}") from None
    if data is None or "_target_" not in data:
        raise ValueError(f"{run_dir / RUN_CONFIG} has no data config with a _target_; give {wanted}")
    return data


def _kwargs(data: Any, *drop: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(data, resolve=True)
    return {k: v for k, v in plain.items() if k != "_target_" and k not in drop}


def _shapes_datamodule(data: Any, task: str, vocab_path: Path | None, batch_size: int, num_workers: int) -> Any:
    """The run's ShapesDataModule, set up; the training split is left empty: each split has its own
    random stream, so val and test come out the same without it."""
    from vitattn.data import ShapesDataModule

    kwargs = _kwargs(data, "task", "batch_size", "num_workers", "vocab_path", "num_train")
    try:
        dm = ShapesDataModule(
            task=task, num_train=0, batch_size=batch_size, num_workers=num_workers, vocab_path=vocab_path, **kwargs
        )
    except TypeError as err:  # a key this version's ShapesDataModule does not take
        raise ValueError(f"the run's shapes data config cannot be rebuilt: {err}") from None
    dm.setup("validate")
    return dm


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is unknown; choose one of {list(SPLITS)}")


def _check_img_size(bundle: Bundle, img_size: int, where: str) -> None:
    if int(bundle.preprocess["img_size"]) != int(img_size):
        raise ValueError(f"{where} renders {img_size} px images but the model takes {bundle.preprocess['img_size']} px")


# ---------------------------------------------------------------------------------------- captions


def _caption_metrics(items: Sequence[tuple[Any, str, list[str]]], synthetic: bool) -> dict[str, float]:
    captions = [caption for _, caption, _ in items]
    references = [refs for _, _, refs in items]
    metrics = compute_caption_metrics(captions, references)
    if synthetic:  # one right answer up to the reading direction: exact match is meaningful
        metrics["exact_match"] = exact_match(captions, references)
    metrics["distinct"] = distinct_share(captions)
    metrics["num_images"] = len(items)
    return metrics


def _image_key(value: Any) -> Any:
    """Image ids compare as ints when they are ints or digit strings (JSON keeps either)."""
    if isinstance(value, bool):
        raise ValueError(f"image_id={value!r} is not an id")
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return value


def read_predictions(path: str | os.PathLike) -> tuple[dict[Any, str], list[Any]]:
    """Captions of a predictions file, by image id.

    Args:
        path: JSON Lines with ``image_id`` and ``caption`` per line (``vitattn-caption`` output,
            whose failed images have ``error`` instead of ``caption``; ``vitattn-eval``'s
            ``captions.jsonl``), or a COCO results file ``[{"image_id", "caption"}, ...]``.

    Returns:
        ``({image_id: caption}, [image ids of error records])``; a repeated id keeps its first caption.

    Raises:
        ValueError: the file is not one of these formats.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"predictions file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"predictions={path} is not UTF-8 text (JSON Lines or a COCO results JSON)") from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"predictions={path} is not valid JSON: {err}") from None
        where = [f"{path}: [{i}]" for i in range(len(records))]
    else:
        records, where = [], []
        lines = text.split("\n")
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if n == len(lines):  # no newline after it: cut off by an interrupted run
                    log.warning("%s:%d is an incomplete last line; ignored", path, n)
                    continue
                raise ValueError(
                    f"{path}:{n} is not a JSON record; predictions must be JSON Lines or a COCO results JSON list"
                ) from None
            where.append(f"{path}:{n}")
    captions: dict[Any, str] = {}
    failed: list[Any] = []
    repeated = 0
    for record, at in zip(records, where):
        if not isinstance(record, dict) or "image_id" not in record or not ("caption" in record or "error" in record):
            raise ValueError(f"{at} needs 'image_id' and 'caption' (got {str(record)[:80]})")
        key = _image_key(record["image_id"])
        if "caption" not in record:
            failed.append(key)
        elif not isinstance(record["caption"], str):
            raise ValueError(f"{at} has caption={record['caption']!r}; it must be a string")
        elif key in captions:
            repeated += 1
        else:
            captions[key] = record["caption"]
    if repeated:
        log.warning("%s: %d repeated image ids; the first caption of each is scored", path, repeated)
    return captions, [k for k in dict.fromkeys(failed) if k not in captions]


@dataclass
class _CaptionSplit:
    """The references by image id, and the images: a DataLoader of dict batches or image files."""

    source: str
    references: dict[Any, list[str]]
    synthetic: bool
    loader: DataLoader | None = None
    inputs: list[Any] | None = None


def _caption_split(
    bundle: Bundle,
    split: str,
    run_dir: Path | None,
    references: str | os.PathLike | None,
    image_dir: str | os.PathLike | None,
    batch_size: int,
    num_workers: int,
) -> _CaptionSplit:
    """A COCO caption file, else the run's own data: its COCO annotations or the regenerated shapes split."""
    from vitattn.data import load_coco_captions
    from vitattn.inference.captioner import InputImage

    data = None
    if references is None:
        data = _run_data(run_dir, "references=COCO_JSON (and image_dir=DIR)")
        if data._target_ == _COCO:
            references = (
                data.test_annotations if split == "test" and data.get("test_annotations") else data.val_annotations
            )
            image_dir = image_dir if image_dir is not None else data.image_dir
        elif data._target_ != _SHAPES:
            raise ValueError(f"the run's data {data._target_} has no captions; give references=COCO_JSON")
        elif image_dir is not None:
            raise ValueError(
                f"image_dir={image_dir} goes with references=COCO_JSON; the run's shapes data has no image files"
            )
    if references is not None:
        images = load_coco_captions(references)
        if not images:
            raise ValueError(f"references={references} has no captioned images")
        root = Path(image_dir) if image_dir is not None else Path(references).parent
        inputs = [InputImage(str(root / im.file_name), im.image_id) for im in images]
        refs = {im.image_id: list(im.captions) for im in images}
        return _CaptionSplit(str(Path(references).resolve()), refs, synthetic=False, inputs=inputs)
    with tempfile.TemporaryDirectory() as tmp:
        vocab_path = Path(tmp) / "vocab.json"
        bundle.vocab.save(vocab_path)  # the model's vocabulary, whatever the run would build
        dm = _shapes_datamodule(data, "caption", vocab_path, batch_size, num_workers)
    _check_img_size(bundle, dm.img_size, f"the run's shapes data (data.img_size={dm.img_size})")
    loader = dm.val_dataloader() if split == "val" else dm.test_dataloader()
    shapes = loader.dataset.dataset  # TokenizedCaptions -> ShapesDataset
    refs = {i: shapes.references(i) for i in range(len(shapes))}
    return _CaptionSplit(
        f"shapes {split} split of {(run_dir / RUN_CONFIG).resolve()}", refs, synthetic=True, loader=loader
    )


def _generate(
    bundle: Bundle, data: _CaptionSplit, settings: Mapping[str, Any], batch_size: int, num_workers: int, progress: bool
) -> tuple[list[tuple[Any, str, list[str]]], list[Any]]:
    """``(image_id, caption, references)`` of every image captioned, and the ids of those that failed."""
    refs = data.references
    if data.inputs is not None:
        from vitattn.inference.captioner import caption_images

        records = caption_images(
            bundle, data.inputs, batch_size=batch_size, num_workers=num_workers, progress=progress, **settings
        )
        for r in records:
            if "error" in r:
                log.warning("%s: %s", r["image"], r["error"])
        items = [(r["image_id"], r["caption"], refs[r["image_id"]]) for r in records if "caption" in r]
        return items, [r["image_id"] for r in records if "caption" not in r]
    model, vocab = bundle.model, bundle.vocab
    device = next(model.parameters()).device
    items = []
    with torch.inference_mode(), tqdm(total=len(refs), unit="img", disable=not progress) as bar:
        for batch in data.loader:
            tokens = model.generate(batch["images"].to(device), **settings)  # (B, T')
            items += zip(batch["image_ids"].tolist(), vocab.decode_batch(tokens), batch["references"])
            bar.update(len(batch["image_ids"]))
    return items, []


def _decoding(bundle: Bundle, generate: Mapping[str, Any] | None) -> dict[str, Any]:
    """The settings ``generate`` will use, defaults written out (``max_new_tokens`` included)."""
    import inspect

    settings = dict(generate or {})
    defaults = inspect.signature(bundle.model.generate).parameters
    for key in ("num_beams", "max_new_tokens", "length_penalty"):
        settings.setdefault(key, defaults[key].default)
    if settings["max_new_tokens"] is None:
        settings["max_new_tokens"] = bundle.model.decoder.max_len - 1
    return settings


def _unique(items: Iterable[tuple[Any, str, list[str]]]) -> list[tuple[Any, str, list[str]]]:
    first: dict[Any, tuple[Any, str, list[str]]] = {}
    for item in items:
        first.setdefault(item[0], item)
    return [first[k] for k in sorted(first, key=lambda k: (str(type(k)), k))]


def evaluate_captions(
    bundle: Bundle,
    *,
    split: str = "val",
    run_dir: str | os.PathLike | None = None,
    references: str | os.PathLike | None = None,
    image_dir: str | os.PathLike | None = None,
    predictions: str | os.PathLike | None = None,
    generate: Mapping[str, Any] | None = None,
    batch_size: int = 32,
    num_workers: int = 0,
    progress: bool = False,
) -> EvalReport:
    """Caption a split (or read captions from ``predictions``) and score them against its references.

    Args:
        bundle: a caption bundle.
        split: ``val`` or ``test`` of the run's data (ignored with ``references``).
        run_dir: the training run (``find_run_dir``); its data config gives the split when
            ``references`` is None.
        references: a COCO caption file; ``image_dir`` is the folder its ``file_name``s are in
            (default: the file's folder).
        predictions: a predictions file (see ``read_predictions``) to score instead of generating.
        generate: ``ImageCaptioner.generate`` keyword arguments (the bundle's defaults merged in).
        batch_size, num_workers, progress: image loading and decoding.

    Returns:
        The report; ``num_failed`` counts images that could not be read (or have an error record),
        ``num_missing`` reference images without a prediction.

    Raises:
        ValueError: no references can be found, or the predictions name images the references lack.
    """
    _check_split(split)
    if bundle.task != "caption":
        raise ValueError(f"this is a {bundle.task} model; caption metrics need a caption model")
    run_dir = Path(run_dir) if run_dir is not None else None
    data = _caption_split(bundle, split, run_dir, references, image_dir, batch_size, num_workers)
    refs, decoding = data.references, {}
    if predictions is not None:
        captions, failed = read_predictions(predictions)
        unknown = [k for k in captions if k not in refs]
        if unknown:
            raise ValueError(
                f"predictions={predictions} has captions for {len(unknown)} image ids that {data.source} does not list "
                f"(e.g. {unknown[0]!r}); caption the references' own images so the ids match"
            )
        items = [(k, captions[k], refs[k]) for k in refs if k in captions]
    else:
        decoding = _decoding(bundle, generate)
        items, failed = _generate(bundle, data, decoding, batch_size, num_workers, progress)
    items = _unique(items)
    if not items:
        raise ValueError(f"no image of {data.source} has a caption to score")
    metrics = _caption_metrics(items, data.synthetic)
    num_failed = len({k for k in failed if k in refs})
    num_missing = len(refs) - len(items) - num_failed
    if num_failed:
        metrics["num_failed"] = num_failed
    if num_missing:
        metrics["num_missing"] = num_missing
        log.warning(
            "%d of the %d reference images have no prediction; the scores cover the other %d",
            num_missing,
            len(refs),
            len(items),
        )
    return EvalReport(
        "caption",
        split,
        data.source,
        metrics,
        decoding,
        str(Path(predictions).resolve()) if predictions is not None else None,
        captions=items,
    )


# ---------------------------------------------------------------------------------------- classification


def _folder_split(root: Path, split: str, class_names: Sequence[str]) -> tuple[Path, list[str], list[int]]:
    """The folder, image paths of ``root/<split>/<class>/`` and their labels in the model's class
    order; without ``root/test`` the test split is ``root/val``, as in ``ImageFolderDataModule``."""
    from torchvision.datasets import ImageFolder

    directory = root / split
    if split == "test" and not directory.exists() and (root / "val").is_dir():
        log.warning("%s does not exist; evaluating %s, as training tested on it", directory, root / "val")
        directory = root / "val"
    if not directory.is_dir():
        raise FileNotFoundError(f"image folder not found: {directory} (expected {directory}/<class>/<image>)")
    try:
        folder = ImageFolder(directory, loader=lambda p: p)  # lists files; nothing is read
    except FileNotFoundError as err:  # torchvision's word for "no class folders" or "no images"
        raise ValueError(f"image folder {directory} is empty: {err}") from None
    index = {name: i for i, name in enumerate(class_names)}
    unknown = [name for name in folder.classes if name not in index]
    if unknown:
        raise ValueError(
            f"{directory} has class folders {unknown} that are not among the model's classes {list(class_names)[:20]}"
        )
    paths = [path for path, _ in folder.samples]
    labels = [index[folder.classes[target]] for _, target in folder.samples]
    return directory, paths, labels


def _file_batches(
    bundle: Bundle, paths: Sequence[str], labels: Sequence[int], batch_size: int, num_workers: int, failed: list[str]
) -> Iterator[tuple[Tensor, Tensor]]:
    """``(images, labels)`` batches of image files; unreadable files are logged and left out."""
    from vitattn.inference.captioner import ImageFileDataset, collate_images

    loader = DataLoader(
        ImageFileDataset(paths, bundle.transform),
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=collate_images,
    )
    for ok, images, errors in loader:
        for i, reason in errors:
            log.warning("%s: %s", paths[i], reason)
            failed.append(paths[i])
        if images is not None:
            yield images, torch.tensor([labels[i] for i in ok])


def _labelled_split(
    bundle: Bundle,
    split: str,
    run_dir: Path | None,
    data_root: str | os.PathLike | None,
    batch_size: int,
    num_workers: int,
    failed: list[str],
) -> tuple[str, int, Iterable[tuple[Tensor, Tensor]]]:
    """``(source, number of images, (images, labels) batches)`` of an ImageFolder split or the run's data."""
    class_names = list(bundle.class_names)
    if data_root is None:
        data = _run_data(run_dir, "data_root=DIR (holding <split>/<class>/<image>)")
        if data._target_ == _IMAGE_FOLDER:
            data_root = data.root
        elif data._target_ != _SHAPES:
            raise ValueError(f"the run's data {data._target_} has no class labels; give data_root=DIR")
        else:
            dm = _shapes_datamodule(data, "classification", None, batch_size, num_workers)
            _check_img_size(bundle, dm.img_size, f"the run's shapes data (data.img_size={dm.img_size})")
            if list(dm.class_names) != class_names:
                raise ValueError(
                    f"the model's classes {class_names[:5]}... are not the shapes classes {dm.class_names[:5]}..."
                )
            loader = dm.val_dataloader() if split == "val" else dm.test_dataloader()
            return f"shapes {split} split of {(run_dir / RUN_CONFIG).resolve()}", len(loader.dataset), loader
    directory, paths, labels = _folder_split(Path(data_root), split, class_names)
    batches = _file_batches(bundle, paths, labels, batch_size, num_workers, failed)
    return str(directory.resolve()), len(paths), batches


def evaluate_classification(
    bundle: Bundle,
    *,
    split: str = "val",
    run_dir: str | os.PathLike | None = None,
    data_root: str | os.PathLike | None = None,
    batch_size: int = 32,
    num_workers: int = 0,
    progress: bool = False,
) -> EvalReport:
    """Top-1 / top-5 accuracy and the confusion matrix of a classifier on a split.

    Args:
        bundle: a classification bundle.
        split: ``val`` or ``test``.
        run_dir: the training run; its shapes or ImageFolder data gives the split when ``data_root``
            is None.
        data_root: a folder with ``<split>/<class>/<image>``; class folders are matched to the
            model's ``class_names`` by name (a folder may hold only some of the classes).
        batch_size, num_workers, progress: image loading.

    Returns:
        The report; unreadable image files are left out and counted in ``num_failed``.
    """
    from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

    _check_split(split)
    if bundle.task != "classification":
        raise ValueError(f"this is a {bundle.task} model; accuracy needs a classification model")
    failed: list[str] = []
    run_dir = Path(run_dir) if run_dir is not None else None
    source, total, batches = _labelled_split(bundle, split, run_dir, data_root, batch_size, num_workers, failed)
    k = len(bundle.class_names)
    top1 = MulticlassAccuracy(k, top_k=1, average="micro")
    top5 = MulticlassAccuracy(k, top_k=min(5, k), average="micro")
    confusion = MulticlassConfusionMatrix(k)
    device = next(bundle.model.parameters()).device
    num_images = 0
    with torch.inference_mode(), tqdm(total=total, unit="img", disable=not progress) as bar:
        for images, targets in batches:
            logits = bundle.model(images.to(device)).float().cpu()  # (B, K)
            for metric in (top1, top5, confusion):
                metric.update(logits, targets)
            num_images += len(targets)
            bar.update(len(targets))
    if num_images == 0:
        raise ValueError(f"no image of {source} could be read")
    metrics: dict[str, float] = {"top1": float(top1.compute()), "top5": float(top5.compute()), "num_images": num_images}
    if failed:
        metrics["num_failed"] = len(failed)
    return EvalReport(
        "classification", split, source, metrics, confusion=confusion.compute(), class_names=list(bundle.class_names)
    )


# ---------------------------------------------------------------------------------------- output


def save_confusion_matrix(
    confusion: Tensor, class_names: Sequence[str], path: str | os.PathLike, title: str | None = None
) -> Path:
    """Draw a (K, K) confusion matrix (rows true, columns predicted) with the class names on the
    axes (counts in the cells up to 30 classes); write the PNG atomically."""
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg chosen by savefig

    counts = confusion.cpu().numpy()
    k = len(class_names)
    side = min(4.0 + 0.4 * k, 40.0)
    fig = Figure(figsize=(side + 1.5, side))
    ax = fig.add_subplot()
    shown = ax.imshow(counts, cmap="Blues", interpolation="nearest")
    fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04)
    if k <= 100:
        ax.set_xticks(range(k), labels=list(class_names), rotation=90, fontsize=8)
        ax.set_yticks(range(k), labels=list(class_names), fontsize=8)
    if k <= 30:
        high = counts.max() / 2 if counts.size else 0
        for i in range(k):
            for j in range(k):
                if counts[i, j]:
                    ax.text(
                        j,
                        i,
                        str(counts[i, j]),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if counts[i, j] > high else "black",
                    )
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    path = Path(path)
    atomic_write(path, buffer.getvalue())
    return path


def _plain(metrics: Mapping[str, float]) -> dict[str, float | int]:
    return {k: int(v) if k.startswith("num_") else float(v) for k, v in metrics.items()}


def write_report(report: EvalReport, out_dir: str | os.PathLike, *, model: str) -> list[Path]:
    """Write ``metrics.json`` into ``out_dir`` (created), plus ``captions.jsonl`` for generated
    captions, or ``confusion_matrix.png`` and ``confusion_matrix.json`` for a classifier.

    ``metrics.json``: ``{"task", "model", "split", "data", "predictions", "decoding", "metrics"}``.

    Returns:
        The files written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if report.task == "caption" and report.predictions is None:
        lines = (
            json.dumps({"image_id": k, "caption": c, "references": r}, ensure_ascii=False) + "\n"
            for k, c, r in report.captions
        )
        atomic_write(out / "captions.jsonl", "".join(lines).encode("utf-8"))
        written.append(out / "captions.jsonl")
    if report.confusion is not None:
        table = {
            "class_names": report.class_names,
            "rows": "true class",
            "columns": "predicted class",
            "matrix": report.confusion.tolist(),
        }
        atomic_write(out / "confusion_matrix.json", (json.dumps(table) + "\n").encode("utf-8"))
        title = f"{report.split}: top-1 {report.metrics['top1']:.3f} over {report.metrics['num_images']} images"
        written += [
            out / "confusion_matrix.json",
            save_confusion_matrix(report.confusion, report.class_names, out / "confusion_matrix.png", title),
        ]
    summary = {
        "task": report.task,
        "model": model,
        "split": report.split,
        "data": report.data,
        "predictions": report.predictions,
        "decoding": report.decoding,
        "metrics": _plain(report.metrics),
    }
    atomic_write(out / "metrics.json", (json.dumps(summary, indent=2) + "\n").encode("utf-8"))
    return [out / "metrics.json", *written]


def format_report(report: EvalReport) -> str:
    """The report as a small table of the metrics, with what was scored above it."""
    lines = [f"{report.task} evaluation, split {report.split}: {report.data}"]
    if report.predictions:
        lines.append(f"predictions: {report.predictions}")
    if report.decoding:
        lines.append("decoding: " + " ".join(f"{k}={v}" for k, v in report.decoding.items()))
    for key, value in _plain(report.metrics).items():
        shown = str(value) if isinstance(value, int) else f"{value:.4f}"
        lines.append(f"  {_LABELS.get(key, key):<28} {shown:>8}")
    return "\n".join(lines)
