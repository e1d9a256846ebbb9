"""Caption datasets on disk in their real formats: COCO caption JSONs and Karpathy split files, with images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.helpers.images import noisy_image


def make_coco(root: Path, num_train: int = 12, num_val: int = 6, size: int = 40) -> dict[str, Path]:
    """Images and COCO caption JSONs (two captions per image) under ``root``."""
    rng = np.random.default_rng(1)
    words = ["a", "red", "blue", "dog", "cat", "on", "the", "grass", "sofa", "sleeping"]
    image_dir = root / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    paths = {"image_dir": image_dir}
    next_id = 1
    for split, n in (("train", num_train), ("val", num_val)):
        images, annotations = [], []
        for _ in range(n):
            name = f"{split}_{next_id:03d}.jpg"
            noisy_image(rng, size).save(image_dir / name)
            images.append({"id": next_id, "file_name": name})
            for _ in range(2):
                caption = " ".join(rng.choice(words, 5)).capitalize() + "."
                annotations.append({"id": len(annotations) + 1, "image_id": next_id, "caption": caption})
            next_id += 1
        path = root / f"captions_{split}.json"
        path.write_text(json.dumps({"images": images, "annotations": annotations}))
        paths[f"{split}_annotations"] = path
    return paths


# Images per split of make_karpathy's file; restval, val and test words appear nowhere in train.
KARPATHY_SIZES = {"train": 6, "restval": 2, "val": 3, "test": 3}


KARPATHY_WORDS = {"restval": "giraffe", "val": "zebra", "test": "penguin"}


def make_karpathy(root: Path, style: str = "coco", size: int = 40) -> dict[str, Path]:
    """Images and a Karpathy-split JSON under ``root``, in exactly that file's format.

    ``style="coco"``: ``dataset_coco.json``, entries with ``filepath`` (``train2014`` / ``val2014``) and
    ``cocoid``; ``"flickr"``: ``dataset_flickr8k.json``, ``filename`` only. Image ``k`` has ``3 + k % 3``
    sentences, each with ``raw`` (the first padded with spaces, as some in the real files are) and ``tokens``.
    """
    rng = np.random.default_rng(2)
    words = ["a", "red", "blue", "dog", "cat", "on", "the", "grass", "sofa", "sleeping"]
    image_dir = root / "images"
    entries: list[dict] = []
    next_sentid = 0
    for split, n in KARPATHY_SIZES.items():
        for _ in range(n):
            imgid = len(entries)
            entry: dict = {"sentids": [], "imgid": imgid, "sentences": [], "split": split}
            if style == "coco":
                cocoid = 1000 + 7 * imgid
                folder = "train2014" if split == "train" else "val2014"
                entry.update(filepath=folder, filename=f"COCO_{folder}_{cocoid:012d}.jpg", cocoid=cocoid)
                path = image_dir / folder / entry["filename"]
            else:
                entry["filename"] = f"{1000 + imgid}_{rng.integers(16**9):09x}.jpg"
                path = image_dir / entry["filename"]
            path.parent.mkdir(parents=True, exist_ok=True)
            noisy_image(rng, size).save(path)
            for k in range(3 + imgid % 3):
                tokens = [*rng.choice(words, 4), KARPATHY_WORDS.get(split, "dog")]
                raw = " ".join(tokens).capitalize() + "."
                sentence = {"tokens": tokens, "raw": f"  {raw} " if k == 0 else raw, "imgid": imgid}
                entry["sentences"].append({**sentence, "sentid": next_sentid})
                entry["sentids"].append(next_sentid)
                next_sentid += 1
            entries.append(entry)
    path = root / f"dataset_{'coco' if style == 'coco' else 'flickr8k'}.json"
    path.write_text(json.dumps({"images": entries, "dataset": "coco" if style == "coco" else "flickr8k"}))
    return {"dataset_json": path, "image_dir": image_dir}
