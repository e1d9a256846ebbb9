"""Small on-disk datasets and config composition shared by the tests."""

from __future__ import annotations

import json
import random
import struct
import sys
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import vitattn.conf
from omegaconf import DictConfig
from PIL import Image

from vitattn.training.config import compose_train as compose

CONF_DIR = Path(vitattn.conf.__file__).parent

# A small model and data for fast runs: 32 px images, 8 px patches, width 32, 2 layers.
TINY = [
    "model.embed_dim=32",
    "model.depth=2",
    "model.num_heads=2",
    "model.patch_size=8",
    "data.img_size=32",
    "data.batch_size=8",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "logger=csv",
    "num_threads=null",  # keep the one thread tests/conftest.py pins (auto would take every core)
]
TINY_SHAPES = ["data.num_train=64", "data.num_val=16", "data.num_test=16"]
# The shared shapes runs (tests/conftest.py: shapes_caption_run, shapes_classifier_run): 256 training images, no
# test stage; their test splits (what vitattn-eval split=test scores) are this many images.
SHAPES_RUN = ["data.num_train=256", "data.num_val=16", "test=false", "trainer.max_epochs=-1"]
CAPTION_TEST_IMAGES, LABEL_TEST_IMAGES = 1000, 4000


class OnnxFolders(NamedTuple):
    """A model's ONNX folders (``fp32``; ``int8`` or None) and, graph name -> products, what the int8 export kept
    in fp32 (``record_kept_fp32``; for ``check_int8_graphs``)."""

    fp32: Path
    int8: Path | None
    kept_fp32: dict


def metrics_with_weights(system, weights: dict, datamodule, stage: str) -> dict[str, float]:
    """``system``'s own val or test metrics with the model ``weights`` loaded, by a Trainer without callbacks:
    what a run's logged metrics must equal when it validated or tested those weights."""
    import lightning.pytorch as pl

    missing, unexpected = system.model.load_state_dict(weights, strict=False)
    assert not unexpected and all(name not in weights for name in missing)
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, **quiet)
    return (trainer.validate if stage == "val" else trainer.test)(system, datamodule=datamodule, verbose=False)[0]


# A tiny untrained captioner for inference tests: 32 px images, 8 px patches, width 32, 2 layers.
CAPTION_WORDS = "a red blue green circle square on the left right".split()
CAPTION_PREPROCESS = dict(
    img_size=32, crop_pct=1.0, crop_mode="squash", mean=[0.5] * 3, std=[0.5] * 3, interpolation="bicubic"
)
# Gains that make a random tiny model's answers depend on the image (see _follow_the_image).
PATCH_GAIN, ATTENTION_GAIN = 4.0, 3.0


def _follow_the_image(model) -> None:
    """Make a random model's outputs depend on the image, deterministically: fresh, its patch tokens
    differ little between images and its attention outputs are small next to the residual stream, so
    every photo got the same caption ("a a a a a a a") and the same top-2 labels. The patch embedding
    x PATCH_GAIN and every attention layer's values and output x ATTENTION_GAIN let the image steer
    the answer (captions and labels that differ between images; tests assert how many before any
    ordering or routing assertion, see ``distinct``)."""
    import torch

    from vitattn.layers import MultiHeadAttention

    encoder = model.encoder if hasattr(model, "encoder") else model
    with torch.no_grad():
        encoder.patch_embed.proj.weight.mul_(PATCH_GAIN)
        for layer in model.modules():
            if isinstance(layer, MultiHeadAttention):
                layer.wv.weight.mul_(ATTENTION_GAIN)
                layer.dense.weight.mul_(ATTENTION_GAIN)


def distinct(answers, at_least: int = 3) -> int:
    """The number of distinct ``answers`` (captions, label lists), asserted to be at least ``at_least``:
    an ordering or routing assertion on answers that are all alike cannot see images swapped."""
    count = len({tuple(a) if isinstance(a, list) else a for a in answers})
    assert count >= at_least, f"only {count} distinct answers among {len(answers)}: {answers}"
    return count


def teacher_forced_log_prob(model, images, generated, banned: bool = True):
    """(B,) total log-probability of an ``ImageCaptioner``'s generated captions (B, T') in one teacher-forced pass
    (``<bos>`` and the padding after ``<eos>`` excluded), the banned tokens masked before ``log_softmax`` as the
    search masks them (``banned``; False: the model's plain probabilities): an oracle for step-by-step scores."""
    import torch

    bos = generated.new_full((generated.shape[0], 1), model.decoder.bos_id)
    logits = model(images, torch.cat([bos, generated[:, :-1]], dim=1)).float()  # (B, T', V)
    if banned:
        logits[..., model.special_ids.banned] = float("-inf")
    logp = logits.log_softmax(-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)  # (B, T')
    return logp.masked_fill(generated == model.decoder.pad_id, 0.0).sum(dim=1)


def make_caption_bundle(folder: Path, preprocess: dict | None = None) -> Path:
    """Write a bundle of a tiny random captioner (seed 0) whose captions are a few words, not empty, and
    depend on the image (``_follow_the_image``)."""
    import torch

    from vitattn.bundle import save_bundle
    from vitattn.data.tokenizer import Vocabulary
    from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer

    torch.manual_seed(0)
    vocab = Vocabulary(CAPTION_WORDS)
    decoder = CaptionDecoder(len(vocab), embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, max_len=8)
    with torch.no_grad():
        decoder.token_embed.weight[vocab.eos_id].zero_()  # captions of a few words, not empty ones
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
    model = ImageCaptioner(encoder, decoder).eval()
    _follow_the_image(model)
    return save_bundle(folder, model, task="caption", preprocess=preprocess or CAPTION_PREPROCESS, vocab=vocab)


def make_classifier_bundle(folder: Path, class_names=("cat", "dog", "bird"), preprocess: dict | None = None) -> Path:
    """Write a bundle of a tiny random classifier (seed 0): 32 px images, 8 px patches, width 32, 2 layers,
    whose labels depend on the image (``_follow_the_image``)."""
    import torch

    from vitattn.bundle import save_bundle
    from vitattn.models import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=len(class_names)
    ).eval()
    _follow_the_image(model)
    return save_bundle(
        folder, model, task="classification", preprocess=preprocess or CAPTION_PREPROCESS, class_names=list(class_names)
    )


def put_in_hub_cache(cache: Path, repo_id: str, files, revision: str = "main") -> Path:
    """Lay ``files`` (paths, or a folder's files) out in the Hugging Face ``cache`` as huggingface_hub's
    download does, for the model repository ``repo_id`` at ``revision`` (a branch or tag, else a commit hash):
    ``models--ORG--NAME/blobs/<sha256>``, ``snapshots/<commit>/<name>`` linking to its blob, and
    ``refs/<revision>`` holding the commit. Returns the snapshot folder."""
    import hashlib
    import os
    import shutil

    files = sorted(Path(files).iterdir()) if isinstance(files, (str, Path)) else [Path(f) for f in files]
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    is_commit = len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)
    commit = revision if is_commit else hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in files:
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).unlink(missing_ok=True)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    if not is_commit:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
    return snapshot


def console_script(name: str) -> Path:
    """The venv's ``name`` console script. A missing one fails the test: the install is broken, nothing to skip."""
    path = Path(sys.executable).with_name(name)
    assert path.is_file(), f"console script {name} is missing from {path.parent}: run pip install -e . --no-deps"
    return path


def compose_train(overrides: list[str], output_dir: Path | None = None) -> DictConfig:
    """``conf/train.yaml`` composed with ``overrides``, writing into ``output_dir``."""
    extra = [f"paths.output_dir={output_dir}"] if output_dir is not None else []
    return compose([*overrides, *extra])


def _image(rng: np.random.Generator, size: int) -> Image.Image:
    colour = rng.integers(0, 256, 3, dtype=np.uint8)
    pixels = np.clip(colour + rng.integers(-20, 20, (size, size, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def make_image_folder(root: Path, classes=("cat", "dog"), per_class: int = 6, size: int = 40) -> Path:
    """``root/{train,val}/<class>/<n>.png`` with random images."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in classes:
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                _image(rng, size).save(root / split / name / f"{i}.png")
    return root


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
            _image(rng, size).save(image_dir / name)
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
            _image(rng, size).save(path)
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


def record_kept_fp32(monkeypatch) -> dict[str, list[str]]:
    """Graph name -> the products the next int8 exports keep in fp32, as the export lists them
    (``vitattn.bundle.onnx_export.kept_fp32``, recorded while it quantizes)."""
    import vitattn.bundle.onnx_export as onnx_export

    kept: dict[str, list[str]] = {}
    listed = onnx_export.kept_fp32

    def record(graph, name: str) -> list[str]:
        kept[name] = listed(graph, name)
        return kept[name]

    monkeypatch.setattr(onnx_export, "kept_fp32", record)
    return kept


def check_int8_graphs(folder: Path, kept: dict[str, list[str]]) -> dict[str, dict[str, int]]:
    """Assert that the graphs of int8 ONNX folder ``folder`` are quantized, whatever its ``onnx.json`` says:
    activations quantized at run time (``DynamicQuantizeLinear``), the products with weights integer
    (``MatMulInteger``; the image encoder's attention ``QAttention`` unless it merges tokens, no fp32 ``Attention``
    left), and the float ``MatMul``s exactly the products the export keeps in fp32 (``kept``, ``record_kept_fp32``),
    each with float inputs. Returns each graph's operator counts."""
    from collections import Counter

    import onnx

    from vitattn.bundle.onnx_folder import ONNX_CONFIG_FILE

    config = json.loads((folder / ONNX_CONFIG_FILE).read_text())
    graphs, model = config["graphs"], config["model"]
    merge_tokens = model.get("encoder", model).get("merge_tokens", 0)  # a captioner's encoder, or the classifier
    merging = any(merge_tokens) if isinstance(merge_tokens, list) else merge_tokens > 0
    counts = {}
    for name, entry in graphs.items():
        graph = onnx.shape_inference.infer_shapes(onnx.load(folder / entry["file"])).graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
        types |= {w.name: w.data_type for w in graph.initializer}
        ops = Counter(node.op_type for node in graph.node)
        counts[name] = dict(ops)
        assert ops["DynamicQuantizeLinear"] and ops["MatMulInteger"], f"{name}: not quantized, operators {dict(ops)}"
        # attention on the explicit path: masked, cached, or over merged tokens (``for_export``)
        explicit = name in ("decoder_step", "text_embed") or merging
        assert not ops["Attention"] and (ops["QAttention"] or explicit), f"{name}: {dict(ops)}"
        assert name in kept, f"the export listed no products to keep in fp32 for {name}"
        float_products = {node.name: node for node in graph.node if node.op_type == "MatMul"}
        assert sorted(float_products) == sorted(kept[name]), f"{name}: fp32 products other than those kept"
        for node in float_products.values():
            inputs = {x: onnx.TensorProto.DataType.Name(types.get(x, 0)) for x in node.input}
            assert set(inputs.values()) == {"FLOAT"}, f"{name}: {node.name} kept in fp32 multiplies {inputs}"
    assert kept.get("decoder_step", True), "the decoder step keeps its attention and vocabulary products in fp32"
    return counts


def stop_mid_run(command: list[str], log: Path, ready, stop: str, env: dict, wait: float = 400) -> None:
    """Start ``command`` (a training, in its own process group, output to ``log``), wait until ``ready()``, then
    stop it: ``sigterm`` to its first process (a preemption: exit status 75 expected) or ``kill-9`` to the whole
    group at once (ranks and loader workers)."""
    import os
    import signal
    import subprocess
    import time

    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + wait
        while proc.poll() is None and time.monotonic() < deadline and not ready():
            time.sleep(0.02)
        assert proc.poll() is None and ready(), log.read_text()[-3000:]
        if stop == "sigterm":
            proc.send_signal(signal.SIGTERM)  # rank 0: every rank stops after the same step, with a checkpoint
            assert proc.wait(timeout=300) == 75, log.read_text()[-3000:]
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def sample_keys(folder: Path, suffix: str = "txt") -> list[tuple[int, int, list[str]]]:
    """Every rank's ``(rank, step, keys)`` lines (``SampleKeys``) in the files ``keys.rank*.<suffix>``."""
    return [
        (int(f.name.split(".")[1][4:]), int(step), keys)
        for f in sorted(folder.glob(f"keys.rank*.{suffix}"))
        for step, *keys in (line.split() for line in f.read_text().splitlines())
    ]


def stop_twice_then_finish(
    command: list[str], logs: Path, keys: Path, *, first: int, every: int, steps: int, batch: int, env: dict
) -> list[list[str]]:
    """One DDP epoch (two ranks, ``steps`` steps of ``batch`` samples a rank, a step checkpoint every ``every``
    steps, ``resume=auto``, ``SampleKeys`` writing to ``keys``) stopped twice and resumed each time: SIGTERM to
    rank 0 after ``first`` steps (a preemption: status 75); the resumed run killed by ``kill -9`` (every process of
    the run at once) once it has trained past a step checkpoint of its own; resumed again to the end.

    Each stop leaves a checkpoint between the last one and the end; the samples it holds are the keys of its
    steps, ``2 * batch`` a step from the previous checkpoint on (so the resumed run continued from there, not from
    the start). Returns the samples each of the three runs trained that count: those held by the first and the
    second checkpoint (past the first), then all that the last run trained."""
    import subprocess

    import torch

    last = Path(command[-1].split("=", 1)[1]) / "checkpoints" / "last.ckpt"  # hydra.run.dir=..., last
    assert command[-1].startswith("hydra.run.dir=") and "resume=auto" in command
    trained, saved = [], 0
    for stop, lines in (("sigterm", 2 * first), ("kill-9", 2 * (every + 1))):  # kill-9: a checkpoint, then a step
        stop_mid_run(command, logs / f"{stop}.log", lambda n=lines: len(sample_keys(keys)) >= n, stop, env)
        step = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
        assert saved < step < steps, f"{stop}: checkpoint at step {step}, the previous at {saved}, {steps} steps"
        held = [k for _, s, ks in sample_keys(keys) if s <= step for k in ks]  # what the checkpoint holds
        assert len(held) == 2 * batch * (step - saved), f"{stop}: {len(held)} samples to step {step} from {saved}"
        trained.append(held)
        saved = step
        for f in keys.glob("keys.rank*.txt"):
            f.rename(f.with_suffix(f".{stop}"))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained.append([k for _, _, ks in sample_keys(keys) for k in ks])
    return trained


def png_header(path: Path, width: int, height: int) -> None:
    """A PNG that declares ``width x height`` 1-bit pixels and holds none: a decompression bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))


def write_good_images(folder: Path) -> dict[str, tuple]:
    """One image of every mode the reader must convert; name -> (expected size, expected pixel (x, y) -> RGB)."""
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30), (200, 30, 30)).save(folder / "rgb.jpg", quality=95)
    Image.new("L", (30, 30), 128).save(folder / "gray.png")
    rgba = Image.new("RGBA", (30, 30), (0, 0, 255, 255))
    rgba.paste((0, 0, 0, 0), (0, 0, 15, 30))  # left half fully transparent
    rgba.save(folder / "rgba.png")
    Image.new("RGB", (30, 30), (0, 200, 0)).convert("P", palette=Image.Palette.ADAPTIVE).save(folder / "palette.png")
    Image.new("CMYK", (30, 30), (0, 255, 255, 0)).save(folder / "cmyk.jpg", quality=95)
    Image.fromarray(np.array([[0, 32896, 65535] * 10] * 30, dtype=np.uint16)).save(folder / "gray16.png")
    rotated = Image.new("RGB", (40, 20), (10, 10, 200))
    exif = rotated.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display
    rotated.save(folder / "exif_rotated.jpg", exif=exif, quality=95)
    frames = [Image.new("RGB", (30, 30), c) for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(folder / "animated.gif", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return {
        "rgb.jpg": ((40, 30), {(5, 5): (200, 30, 30)}),
        "gray.png": ((30, 30), {(5, 5): (128, 128, 128)}),
        "rgba.png": ((30, 30), {(2, 2): (255, 255, 255), (25, 2): (0, 0, 255)}),
        "palette.png": ((30, 30), {(5, 5): (0, 200, 0)}),
        "cmyk.jpg": ((30, 30), {(5, 5): (255, 0, 0)}),
        "gray16.png": ((30, 30), {(0, 0): (0, 0, 0), (1, 0): (128, 128, 128), (2, 0): (255, 255, 255)}),
        "exif_rotated.jpg": ((20, 40), {(5, 5): (10, 10, 200)}),
        "animated.gif": ((30, 30), {(5, 5): (255, 0, 0)}),
    }


def write_bad_images(folder: Path) -> dict[str, str]:
    """One file of every kind that cannot be captioned; name -> a word the error must contain."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0" + random.Random(0).randbytes(300))
    Image.effect_noise((64, 64), 50).convert("RGB").save(folder / "truncated.png")
    whole = (folder / "truncated.png").read_bytes()
    (folder / "truncated.png").write_bytes(whole[: len(whole) // 2])
    (folder / "empty.png").write_bytes(b"")
    (folder / "notes.jpg").write_text("this is not an image\n")
    png_header(folder / "bomb.png", 30_000, 30_000)  # over twice the limit: DecompressionBombError
    png_header(folder / "bomb_warning.png", 10_000, 10_000)  # over the limit: a warning PIL would let pass
    (folder / "folder.png").mkdir()
    return {
        "corrupt.jpg": "",
        "truncated.png": "truncated",
        "empty.png": "empty",
        "notes.jpg": "not an image",
        "bomb.png": "decompression",
        "bomb_warning.png": "decompression",
        "folder.png": "directory",
    }
