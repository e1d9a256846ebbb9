"""Fuzzed inputs: every file and argument vitattn parses, mutated by hypothesis.

Each target starts from a valid document, applies a few random edits (keys dropped, values of the
wrong type, list entries repeated so that ids repeat, huge strings, NaN, nesting thousands of levels
deep) and then maybe corrupts the bytes (invalid UTF-8, a cut-off end, a byte order mark). The real
parser, or the real entry point in-process, must then either accept the input with a consistent
result or refuse it with the parsers' user error (what ``vitattn.cli.errors.USER_ERRORS`` reports as
one line): a message of one line that names the file (or the argument). Any other exception, a hang
(pytest-timeout) or an output file left behind by a refused input fails the test.

``CASES`` counts the generated cases per target (``refused`` / ``accepted``); the terminal summary
prints them. ``HYPOTHESIS_PROFILE=ci-long`` runs many more (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vitattn.bundle import load_bundle, save_bundle
from vitattn.cli import caption as caption_cli
from vitattn.cli import evaluate as evaluate_cli
from vitattn.cli import export as export_cli
from vitattn.data.coco import KARPATHY_SPLITS, load_coco_captions, load_karpathy
from vitattn.data.tokenizer import Vocabulary
from vitattn.errors import printable
from vitattn.inference import list_inputs
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer

CASES: Counter[tuple[str, str]] = Counter()  # (target, "accepted" | "refused") -> generated cases

# A hang is a failure: each example gets a few seconds on a loaded machine, with room to spare.
pytestmark = pytest.mark.timeout(120 + 10 * settings().max_examples)

HUGE = "x" * 1_000_000
WORDY = "word " * 20_000
LONG = list(range(100_000))
_DEEP = "\x00deep{}\x00"  # a string that ``_encode`` replaces by arrays nested that deep


def _deep(levels: int) -> str:
    return _DEEP.format(levels)


LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 2**31, 2**63, -(2**63), 10**30]),
    st.floats(),  # NaN and infinities too (json writes NaN / Infinity, which Python's json reads back)
    st.text(max_size=12),
    st.sampled_from(["", " ", "\x00", "\ud800", "${oc.env:HOME}", "../../etc/passwd", "a\nb", HUGE, WORDY]),
    st.sampled_from([_deep(50), _deep(5_000), _deep(200_000)]),
)
JUNK = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
MUTATIONS = ("drop", "junk", "repeat", "huge", "stringify", "listify", "add_key", "empty")


def _places(doc: Any, path: tuple = ()) -> list[tuple]:
    """Every place in a JSON document, as the path of keys and indices that leads to it."""
    places = [path]
    if isinstance(doc, dict):
        for key, value in doc.items():
            places += _places(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            places += _places(value, (*path, i))
    return places


def _at(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _mutate_once(data: st.DataObject, doc: Any) -> Any:
    path = data.draw(st.sampled_from(_places(doc)), label="place")
    op = data.draw(st.sampled_from(MUTATIONS), label="mutation")
    value = _at(doc, path)
    if op == "junk":
        new = data.draw(JUNK, label="junk")
    elif op == "huge":
        new = copy.deepcopy(data.draw(st.sampled_from([HUGE, WORDY, LONG]), label="huge"))
    elif op == "stringify":
        new = json.dumps(value) if not isinstance(value, str) else data.draw(st.integers(), label="int")
    elif op == "listify":
        new = [value]
    elif op == "empty":
        new = type(value)() if isinstance(value, (dict, list, str)) else None
    elif op == "add_key" and isinstance(value, dict):
        new = {**value, data.draw(st.text(max_size=8), label="key"): data.draw(JUNK, label="junk")}
    elif op in ("drop", "repeat") and path:
        parent, key = _at(doc, path[:-1]), path[-1]
        if op == "drop":
            del parent[key]
        elif isinstance(parent, list):
            parent.insert(key, copy.deepcopy(value))  # the same entry twice: repeated ids
        return doc
    else:
        return doc
    if not path:
        return new
    _at(doc, path[:-1])[path[-1]] = new
    return doc


def mutated(data: st.DataObject, doc: Any, max_edits: int = 3) -> Any:
    """A copy of ``doc`` with up to ``max_edits`` random edits."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(0, max_edits), label="edits")):
        doc = _mutate_once(data, doc)
    return doc


def _encode(data: st.DataObject, doc: Any) -> bytes:
    """``doc`` as the bytes of a JSON file, maybe corrupted."""
    text = json.dumps(doc, ensure_ascii=data.draw(st.booleans(), label="ascii"))
    for levels in (50, 5_000, 200_000):
        text = text.replace(json.dumps(_deep(levels)), "[" * levels + "]" * levels)
    raw = text.encode("utf-8", errors="surrogatepass")  # a lone surrogate is invalid UTF-8 too
    how = data.draw(
        st.sampled_from(["plain"] * 6 + ["invalid-utf8", "cut", "bom", "nested", "latin-1", "empty", "nul"]),
        label="bytes",
    )
    at = data.draw(st.integers(0, len(raw)), label="at")
    if how == "invalid-utf8":
        return raw[:at] + data.draw(st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x80abc"])) + raw[at:]
    if how == "cut":
        return raw[:at]
    if how == "bom":
        return b"\xef\xbb\xbf" + raw
    if how == "nested":
        levels = data.draw(st.sampled_from([2, 100, 100_000]), label="levels")
        return b"[" * levels + raw + b"]" * levels
    if how == "latin-1":
        return text.encode("latin-1", errors="replace")
    if how == "empty":
        return b""
    if how == "nul":
        return raw[:at] + b"\x00" + raw[at:]
    return raw


@contextlib.contextmanager
def _inside(folder: Path):
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


@contextlib.contextmanager
def _case_dir(root: Path):
    folder = Path(tempfile.mkdtemp(dir=root))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _refused(target: str, err: BaseException, *names: Any) -> None:
    """A refusal: one line that names one of ``names`` (a file or an argument)."""
    message = str(err)
    assert "\n" not in message and "\r" not in message, f"{target}: a message of several lines: {message[:500]!r}"
    assert len(message) < 2_000, f"{target}: a message of {len(message)} characters: {message[:300]!r}..."
    assert any(str(name) in message for name in names), f"{target}: {message!r} names none of {names}"
    CASES[target, "refused"] += 1


def _accepted(target: str) -> None:
    CASES[target, "accepted"] += 1


def test_the_terminal_summary_prints_the_cases_of_each_target(monkeypatch):
    from tests.conftest import pytest_terminal_summary

    monkeypatch.setattr(sys.modules[__name__], "CASES", Counter({("coco", "refused"): 2, ("coco", "accepted"): 3}))
    lines = []
    pytest_terminal_summary(SimpleNamespace(section=lines.append, write_line=lines.append, config=SimpleNamespace()))
    assert lines == ["fuzzed cases per target (refused / accepted)", f"{'coco':<42}      5  (2 refused, 3 accepted)"]


# --- COCO and Karpathy caption files ----------------------------------------------------------------

COCO = {
    "info": {"description": "fuzz"},
    "images": [
        {"id": 1, "file_name": "a.jpg", "width": 40, "height": 30},
        {"id": 2, "file_name": "sub/b.png"},
        {"id": 7, "file_name": "c.jpg"},
    ],
    "annotations": [
        {"id": 1, "image_id": 1, "caption": "A dog on the grass."},
        {"id": 2, "image_id": 1, "caption": "  a red dog "},
        {"id": 3, "image_id": 2, "caption": "a cat"},
        {"id": 4, "image_id": 7, "caption": "x"},
    ],
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _parsed(root: Path, data: st.DataObject, target: str, doc: Any, name: str, parse: Any) -> Any:
    """``parse`` of a file ``name`` holding a mutation of ``doc``; None (counted) when it is refused."""
    with _case_dir(root) as folder:
        path = folder / name
        path.write_bytes(_encode(data, mutated(data, doc)))
        try:
            return parse(path)
        except (ValueError, FileNotFoundError) as err:
            _refused(target, err, path)
            return None


@given(data=st.data())
def test_fuzz_coco_caption_file(root, data):
    images = _parsed(root, data, "COCO caption file", COCO, "captions.json", load_coco_captions)
    if images is not None:
        ids = [image.image_id for image in images]
        assert len(ids) == len(set(ids)) and all(type(i) is int for i in ids)
        assert all(isinstance(im.file_name, str) and im.file_name.strip() for im in images)
        assert all(im.captions and all(isinstance(c, str) for c in im.captions) for im in images)
        _accepted("COCO caption file")


KARPATHY = {
    "dataset": "coco",
    "images": [
        {
            "filepath": "val2014",
            "filename": "COCO_val2014_000000000042.jpg",
            "cocoid": 42,
            "imgid": 0,
            "split": "val",
            "sentences": [{"raw": " A dog. ", "tokens": ["a", "dog"], "sentid": 0}, {"raw": "a cat"}],
        },
        {
            "filepath": "train2014",
            "filename": "COCO_train2014_000000000043.jpg",
            "cocoid": 43,
            "imgid": 1,
            "split": "restval",
            "sentences": [{"raw": "two dogs"}],
        },
        {"filename": "1000_abc.jpg", "imgid": 2, "split": "train", "sentences": [{"raw": "a red ball"}]},
        {"filename": "1001_abd.jpg", "imgid": 3, "split": "test", "sentences": [{"raw": "a blue ball"}]},
    ],
}


@given(data=st.data())
def test_fuzz_karpathy_split_file(root, data):
    splits = _parsed(root, data, "Karpathy split file", KARPATHY, "dataset_coco.json", load_karpathy)
    if splits is not None:
        assert list(splits) == list(KARPATHY_SPLITS)
        ids = [image.image_id for images in splits.values() for image in images]
        assert len(ids) == len(set(ids)) and all(type(i) is int for i in ids)
        assert all(isinstance(im.file_name, str) for images in splits.values() for im in images)
        _accepted("Karpathy split file")


# --- image lists for vitattn-caption ------------------------------------------------------------------


def _check_inputs(inputs: list) -> None:
    assert inputs, "an accepted image list names at least one image"
    paths, ids = [x.path for x in inputs], [x.image_id for x in inputs]
    assert len(paths) == len(set(paths)) and len(ids) == len(set(ids))
    assert all(isinstance(p, str) for p in paths) and all(type(i) is int for i in ids)


@given(data=st.data())
def test_fuzz_image_list_coco_json(root, data):
    inputs = _parsed(root, data, "image list: COCO JSON", {"images": COCO["images"]}, "images.json", list_inputs)
    if inputs is not None:
        _check_inputs(inputs)
        _accepted("image list: COCO JSON")


LINES = st.one_of(
    st.sampled_from(["a.jpg", "sub/b.png", "/abs/c.jpg", "# a comment", "", "   ", "a.jpg", "\t#x", HUGE]),
    st.text(max_size=30),
)


@given(data=st.data())
def test_fuzz_image_list_text_file(root, data):
    with _case_dir(root) as folder:
        path = folder / "images.txt"
        lines = data.draw(st.lists(LINES, max_size=8), label="lines")
        raw = "\n".join(lines).encode("utf-8", errors="surrogatepass")
        if data.draw(st.booleans(), label="corrupt"):
            at = data.draw(st.integers(0, len(raw)), label="at")
            raw = raw[:at] + data.draw(st.sampled_from([b"\xff", b"\r\n", b"\x00", b"\xc3"])) + raw[at:]
        path.write_bytes(raw)
        image_dir = data.draw(st.sampled_from([None, str(folder)]), label="image_dir")
        try:
            inputs = list_inputs(path, image_dir)
        except (ValueError, FileNotFoundError) as err:
            _refused("image list: text file", err, path)
            return
        _check_inputs(inputs)
        _accepted("image list: text file")


# Inside the case folder: "/" or "../../.." would walk the whole machine.
RELATIVE = st.text(max_size=20).filter(lambda s: not os.path.isabs(s) and ".." not in Path(s).parts)


@given(spec=st.one_of(RELATIVE, st.sampled_from(["*", "**/*.jpg", "imgs", "imgs/*.png", "[", "a\nb"])))
def test_fuzz_image_list_argument(root, spec):
    with _case_dir(root) as folder, _inside(folder):
        (folder / "imgs" / "deeper").mkdir(parents=True)
        for name in ("a.jpg", "b.png", ".hidden.jpg", "deeper/c.jpeg", "notes.txt"):
            (folder / "imgs" / name).write_bytes(b"not really an image")
        try:
            inputs = list_inputs(spec)
        except (ValueError, FileNotFoundError) as err:
            _refused("image list: images= argument", err, f"images={printable(spec)}")
            return
        _check_inputs(inputs)
        _accepted("image list: images= argument")


# --- bundles, prediction files and the key=value arguments of the entry points ------------------------------

WORDS = "a red blue dog cat on the grass".split()
PREPROCESS = dict(img_size=32, crop_pct=1.0, crop_mode="squash", mean=[0.5] * 3, std=[0.5] * 3, interpolation="bicubic")


@pytest.fixture(scope="module")
def bundle_dir(root):
    vocab = Vocabulary(WORDS)
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, mlp_ratio=2.0)
    decoder = CaptionDecoder(len(vocab), embed_dim=16, depth=1, num_heads=2, mlp_ratio=2.0, max_len=6)
    model = ImageCaptioner(encoder, decoder).eval()
    return save_bundle(
        root / "bundle", model, task="caption", preprocess=PREPROCESS, vocab=vocab, generate={"num_beams": 2}
    )


def _main(main: Any, argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` in-process: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def _one_error_line(target: str, status: int, stderr: str, *names: Any) -> None:
    assert status == 2, f"{target}: exit status {status}, stderr {stderr[-500:]!r}"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{target}: stderr {stderr[-1000:]!r}"
    _refused(target, ValueError(lines[0]), *names)


def _files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _check_export(target: str, folder: Path, source: Path, broken: Path) -> None:
    out = folder / "exported"
    before = _files_under(folder)
    status, _, stderr = _main(export_cli.main, [f"model={source}", f"out={out}", "device=cpu"])
    if status != 0:
        _one_error_line(target, status, stderr, broken, source)
        assert _files_under(folder) == before, f"{target}: a refused bundle left files behind"
        return
    bundle = load_bundle(out)
    image = bundle.transform(Image.new("RGB", (40, 30), "red"))[None]  # (1, 3, H, W)
    decoding = bundle.generate_settings()  # the bundle's decoding defaults, as vitattn-caption takes them
    with torch.inference_mode():
        tokens = bundle.model.generate(image, **decoding)
    assert isinstance(bundle.vocab.decode(tokens[0]), str)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "vocab.json"]
    _accepted(target)


@pytest.mark.parametrize("name", ["config.json", "vocab.json"])
@given(data=st.data())
def test_fuzz_bundle_file(root, bundle_dir, name, data):
    doc = json.loads((bundle_dir / name).read_text())
    with _case_dir(root) as folder:
        bundle = Path(shutil.copytree(bundle_dir, folder / "bundle"))
        (bundle / name).write_bytes(_encode(data, mutated(data, doc)))
        _check_export(f"bundle {name}", folder, bundle, bundle / name)


REFERENCES = {
    "images": [{"id": 1, "file_name": "a.jpg"}, {"id": 2, "file_name": "b.jpg"}, {"id": 7, "file_name": "c.jpg"}],
    "annotations": [
        {"image_id": 1, "caption": "a red dog"},
        {"image_id": 2, "caption": "a blue cat"},
        {"image_id": 7, "caption": "a dog on the grass"},
    ],
}
PREDICTIONS = [
    {"image": "a.jpg", "image_id": 1, "caption": "a red dog"},
    {"image": "b.jpg", "image_id": "2", "caption": "a cat"},
    {"image": "c.jpg", "image_id": 7, "error": "unreadable image: cannot identify image file"},
]


def _predictions_file(data: st.DataObject, records: list) -> bytes:
    if data.draw(st.booleans(), label="coco-results"):
        return _encode(data, records)
    if not isinstance(records, list):
        records = [records]
    lines = [_encode(data, record) for record in records]
    if data.draw(st.booleans(), label="junk-line"):
        lines.insert(data.draw(st.integers(0, len(lines))), data.draw(st.binary(max_size=20), label="junk"))
    return b"\n".join(lines) + data.draw(st.sampled_from([b"\n", b"", b"\n\n", b"\r\n"]), label="end")


@given(data=st.data())
def test_fuzz_eval_predictions_file(root, bundle_dir, data):
    with _case_dir(root) as folder:
        references = folder / "references.json"
        references.write_text(json.dumps(REFERENCES))
        predictions, out = folder / "predictions.jsonl", folder / "eval"
        predictions.write_bytes(_predictions_file(data, mutated(data, PREDICTIONS)))
        argv = [f"model={bundle_dir}", f"references={references}", f"predictions={predictions}", f"out={out}"]
        status, stdout, stderr = _main(evaluate_cli.main, [*argv, "device=cpu", "num_workers=0", "progress=false"])
        if status == 2:
            _one_error_line("vitattn-eval predictions file", status, stderr, predictions)
            assert not out.exists(), "a refused predictions file left an output folder"
            return
        assert status in (0, 1), f"exit status {status}: {stderr[-500:]!r}"
        summary = json.loads((out / "metrics.json").read_text())
        metrics = summary["metrics"]
        assert 1 <= metrics["num_images"] <= 3 and summary["predictions"] == str(predictions.resolve())
        assert metrics["num_images"] + metrics.get("num_failed", 0) + metrics.get("num_missing", 0) == 3
        assert (status == 0) == (metrics["num_images"] == 3)
        assert sorted(os.listdir(out)) == ["metrics.json"]
        _accepted("vitattn-eval predictions file")


# The key=value entry points, each with a valid command line to mutate; ``run`` is replaced so that
# only parsing runs. Keys whose value must come back exactly as written (``values are taken literally``).
ENTRY_POINTS = {
    "vitattn-caption": (
        caption_cli,
        ["model=run", "images=photos/*.jpg", "out=captions.jsonl", "num_beams=3", "batch_size=8", "num_threads=1"],
    ),
    "vitattn-eval": (evaluate_cli, ["model=run/bundle", "split=test", "references=refs.json", "batch_size=4"]),
    "vitattn-export": (export_cli, ["model=run", "out=bundle", "which=best"]),
}
TEXT_KEYS = ("model", "images", "out", "references", "predictions", "image_dir", "data_root", "attention_maps")
VALUES = st.one_of(
    st.text(max_size=16),
    st.integers().map(str),
    st.sampled_from(
        [
            "null",
            "None",
            "~",
            "",
            "true",
            "0",
            "-1",
            "1e999",
            "nan",
            "2" * 5000,
            "${oc.env:HOME}",
            "\\${x}",
            "a=b",
            HUGE,
        ]
    ),
)
KEYS = st.one_of(
    st.text(max_size=10),
    st.sampled_from(
        ["model", "out", "modle", "+model", "", "num_workers", "batch_size", "num_threads", "images", "seed"]
    ),
)


def _mutated_argv(data: st.DataObject, argv: list[str]) -> list[str]:
    argv = list(argv)
    for _ in range(data.draw(st.integers(0, 3), label="edits")):
        op = data.draw(st.sampled_from(["value", "drop", "add", "raw", "repeat"]), label="edit")
        i = data.draw(st.integers(0, max(len(argv) - 1, 0)), label="at")
        if op == "value" and argv:
            argv[i] = f"{argv[i].partition('=')[0]}={data.draw(VALUES)}"
        elif op == "drop" and argv:
            del argv[i]
        elif op == "add":
            argv.insert(i, f"{data.draw(KEYS)}={data.draw(VALUES)}")
        elif op == "raw":
            argv.insert(i, data.draw(st.text(max_size=12)))
        elif op == "repeat" and argv:
            argv.insert(i, argv[i])
    return argv


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
@given(data=st.data())
def test_fuzz_key_value_arguments(name, data):
    module, argv = ENTRY_POINTS[name]
    argv = _mutated_argv(data, argv)
    target = f"{name} key=value arguments"
    parsed = []
    with mock.patch.object(module, "run", lambda cfg: parsed.append(cfg) or 0):
        status, stdout, stderr = _main(module.main, argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        assert status == 0 and not parsed and stdout.startswith(f"``{name}``")
        _accepted(target)
        return
    if status != 0:
        keys = [a.partition("=")[0].lstrip("+") for a in argv]
        _one_error_line(target, status, stderr, name, "key=value", "missing", *keys, *argv)
        return
    (cfg,) = parsed
    given_values = dict(a.lstrip("+").partition("=")[::2] for a in argv)
    for key, value in given_values.items():
        if key in TEXT_KEYS and value.lower() not in ("null", "none", "~"):
            assert cfg[key] == value, f"{key}={value!r} came back as {cfg[key]!r}"
    for key in ("batch_size", "num_workers", "num_threads"):
        if cfg.get(key) is not None:
            assert cfg[key] >= (0 if key == "num_workers" else 1), f"{key}={cfg[key]} was accepted"
    _accepted(target)
