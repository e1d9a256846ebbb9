"""Evaluation on a caption split: generate captions (or read a predictions file) and score them; and for a
``head=coca`` model, image->text and text->image recall@1/5/10 and median rank, CLIP_benchmark's convention (an
image's query hits when any of its captions is in the top k).

Dimension letters: B batch (images), T' generated tokens, N texts (every caption of every image), E embedding width.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from vitattn.bundle import LoadedModel
from vitattn.data.images import EvalSplit, check_split
from vitattn.data.tokenizer import describe_tokenizer, unknown_share
from vitattn.errors import brief
from vitattn.evaluation.report import EvalReport
from vitattn.evaluation.splits import caption_split
from vitattn.fileio import parse_json, read_text
from vitattn.inference import InputImage, caption_images, generate_tokens
from vitattn.inference.captioning import file_batches
from vitattn.inference.embeddings import embed_pixels, embed_texts, embedding_model
from vitattn.metrics import SCORERS, first_per_image, score_captions
from vitattn.metrics.retrieval import retrieval_metrics
from vitattn.metrics.toolkit import check_toolkit, toolkit_scores

__all__ = ["evaluate_captions", "evaluate_retrieval", "read_predictions"]

log = logging.getLogger(__name__)


def _image_key(value: Any, where: str) -> int | str:
    """Image ids compare as ints when they are ints or digit strings (JSON keeps either)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{where} has image_id={brief(value)}; an id is an integer or a string")
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,100}\s*", value):
        return int(value)
    return value


def read_predictions(path: str | os.PathLike) -> tuple[dict[Any, str], list[Any]]:
    """``({image_id: caption}, [ids of error records])`` of a predictions file: JSON Lines with ``image_id`` and
    ``caption`` (or ``error``) a line, as ``vitattn-caption`` and ``vitattn-eval`` write them, or a COCO results
    list ``[{"image_id", "caption"}]``; a repeated id keeps its first caption. Anything else: a ``ValueError``.
    """
    path = Path(path)
    not_text = f"predictions={path} is not UTF-8 text (JSON Lines or a COCO results JSON)"
    text = read_text(path, f"predictions file not found: {path}", not_text)
    if text.lstrip().startswith("["):
        try:
            records = parse_json(text)
        except ValueError as err:
            raise ValueError(f"predictions={path} is not valid JSON: {err}") from None
        where = [f"{path}: [{i}]" for i in range(len(records))]
    else:
        records, where = [], []
        lines = text.split("\n")
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(parse_json(line))
            except ValueError:
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
            raise ValueError(f"{at} needs 'image_id' and 'caption' (got {brief(record)})")
        key = _image_key(record["image_id"], at)
        if "caption" not in record:
            failed.append(key)
        elif not isinstance(record["caption"], str):
            raise ValueError(f"{at} has caption={brief(record['caption'])}; it must be a string")
        elif key in captions:
            repeated += 1
        else:
            captions[key] = record["caption"]
    if repeated:
        log.warning("%s: %d repeated image ids; the first caption of each is scored", path, repeated)
    return captions, [k for k in dict.fromkeys(failed) if k not in captions]


def _generate(
    bundle: LoadedModel, data: EvalSplit, settings: Mapping[str, Any], batch_size: int, num_workers: int, progress: bool
) -> tuple[list[tuple[Any, str, list[str]]], list[Any]]:
    """``(image_id, caption, references)`` of every image captioned, and the ids of those that failed."""
    refs = data.references
    if data.loader is None:
        inputs = [InputImage(path, image_id) for path, image_id in zip(data.files, data.ids)]
        records = caption_images(
            bundle, inputs, batch_size=batch_size, num_workers=num_workers, progress=progress, **settings
        )
        for r in records:
            if "error" in r:
                log.warning("%s: %s", r["image"], r["error"])
        items = [(r["image_id"], r["caption"], refs[r["image_id"]]) for r in records if "caption" in r]
        return items, [r["image_id"] for r in records if "caption" not in r]
    items = []
    with tqdm(total=len(refs), unit="img", disable=not progress) as bar:
        for batch in data.loader:
            tokens = generate_tokens(bundle.model, batch["images"].to(bundle.device), bundle.precision, **settings)
            items += zip(batch["image_ids"].tolist(), bundle.vocab.decode_batch(tokens), batch["references"])  # (B, T')
            bar.update(len(batch["image_ids"]))
    return items, []


def evaluate_captions(
    bundle: LoadedModel,
    *,
    split: str = "val",
    run_split: EvalSplit | None = None,
    references: str | os.PathLike | None = None,
    image_dir: str | os.PathLike | None = None,
    predictions: str | os.PathLike | None = None,
    generate: Mapping[str, Any] | None = None,
    batch_size: int = 32,
    num_workers: int = 0,
    progress: bool = False,
    scorer: str = "builtin",
) -> EvalReport:
    """Caption a split (or read ``predictions``, ``read_predictions``' files) and score the captions against its
    references: ``references`` (a COCO caption file, its images in ``image_dir``, default its folder), else
    ``run_split``, the training run's own ``split`` (``vitattn.cli.run_split.run_split``). ``generate``: the
    decoding settings; ``scorer``: ``builtin`` (BLEU-1..4, ROUGE-L, CIDEr-D) or ``coco``, the COCO toolkit's too
    (``report.coco``). In the report, ``num_failed`` counts images
    unread or with an error record, ``num_missing`` those without a prediction.
    """
    check_split(split)
    if scorer not in SCORERS:
        raise ValueError(f"scorer={scorer!r} is unknown; choose {' or '.join(SCORERS)}")
    if scorer == "coco":
        check_toolkit()  # before any caption is made
    if bundle.task != "caption":
        raise ValueError(f"this is a {bundle.task} model; caption metrics need a caption model")
    data = caption_split(run_split, references, image_dir)
    refs, decoding = data.references, {}
    if predictions is not None:
        captions, failed = read_predictions(predictions)
        unknown = [k for k in captions if k not in refs]
        if unknown:
            raise ValueError(
                f"predictions={predictions} has captions for {len(unknown)} image ids that {data.source} does not list "
                f"(e.g. {brief(unknown[0])}); caption the references' own images so the ids match"
            )
        items = [(k, captions[k], refs[k]) for k in refs if k in captions]
    else:
        decoding = bundle.generate_settings(generate, written_out=True)
        items, failed = _generate(bundle, data, decoding, batch_size, num_workers, progress)
    items = first_per_image(items)
    if not items:
        given = f"predictions={predictions} has" if predictions is not None else "there is"
        raise ValueError(f"{given} no caption for any image of {data.source} to score")
    metrics = score_captions(items, data.synthetic)
    if bundle.vocab is not None:  # what the model could not have said: reference words its tokenizer lacks
        metrics["unknown_words"] = unknown_share(bundle.vocab, (r for refs_ in refs.values() for r in refs_))
        log.info(
            "%s split: %.1f %% of the reference words are outside %s",
            split,
            100 * metrics["unknown_words"],
            describe_tokenizer(bundle.vocab),
        )
    coco = toolkit_scores([c for _, c, _ in items], [r for _, _, r in items]) if scorer == "coco" else {}
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
    read = str(Path(predictions).resolve()) if predictions is not None else None
    merged = bundle.merge_tokens if predictions is None else None
    return EvalReport(
        "caption", split, data.source, metrics, decoding, read, captions=items, coco=coco, merge_tokens=merged
    )


def evaluate_retrieval(
    bundle: LoadedModel,
    *,
    split: str = "val",
    run_split: EvalSplit | None = None,
    references: str | os.PathLike | None = None,
    image_dir: str | os.PathLike | None = None,
    batch_size: int = 32,
    num_workers: int = 0,
    progress: bool = False,
) -> EvalReport:
    """Image->text and text->image retrieval on a caption split (``references``, a COCO caption file with its
    images in ``image_dir``, else ``run_split``, the run's own), every caption of every image in the gallery.
    Unreadable images, and their captions, are left out and counted in ``num_failed``; captions cut to the
    decoder's length are counted in ``num_texts_cut``."""
    check_split(split)
    model = embedding_model(bundle, "retrieval")
    data = caption_split(run_split, references, image_dir)
    failed: list[str] = []
    if data.loader is not None:
        batches = ((b["images"], b["references"]) for b in data.loader)
    else:
        refs = data.references
        positions = file_batches(data.files, range(len(data.files)), bundle.transform, batch_size, num_workers, failed)
        batches = ((images, [refs[data.ids[i]] for i in at.tolist()]) for images, at in positions)
    image_rows: list[Tensor] = []
    captions: list[Sequence[str]] = []
    with tqdm(total=len(data.references), unit="img", disable=not progress) as bar:
        for images, texts in batches:
            image_rows.append(embed_pixels(bundle, images))  # (b, E)
            captions += texts
            bar.update(len(images))
    if not image_rows:
        raise ValueError(f"no image of {data.source} could be read")
    texts = [text for per_image in captions for text in per_image]
    text_image = torch.tensor([i for i, per_image in enumerate(captions) for _ in per_image])  # (N,)
    similarity = torch.cat(image_rows) @ embed_texts(bundle, texts).T  # (B, N)
    metrics = retrieval_metrics(similarity, text_image)
    metrics.update(num_images=len(captions), num_texts=len(texts))
    cut = sum(len(bundle.vocab.encode(text)) > model.max_len for text in texts)
    if cut:
        metrics["num_texts_cut"] = cut
    if failed:
        metrics["num_failed"] = len(failed)
    return EvalReport("retrieval", split, data.source, metrics, merge_tokens=bundle.merge_tokens)
