import json
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("HYDRA_FULL_ERROR", "1")
# precision=auto as on a CPU without bf16 matrix units, here and in the commands the tests start: exact comparisons
# then mean the same on every machine; tests/test_precision.py lifts it where bf16 is what is tested.
os.environ["VITATTN_NATIVE_BF16"] = "0"

from tests.helpers.onnx import OnnxFolders
from tests.helpers.runs import CAPTION_TEST_IMAGES, LABEL_TEST_IMAGES, SHAPES_RUN, TINY_SHAPES, ZERO_SHOT_CLASSES
from vitattn.run_dir import RunDir

pytest_plugins = ["tests.helpers.skip_policy", "pytester"]

# pytest-timeout: `timeout` in pyproject.toml bounds each test (a hang in an in-process train() fails that
# test instead of hanging CI); a `slow` test without its own timeout mark gets this many seconds instead.
SLOW_TIMEOUT = 1800
# What the shared shapes runs must have learned, asserted when built (their docstrings: measured on seed 0).
CAPTION_RUN_CIDER, CAPTION_RUN_DISTINCT, CLASSIFIER_RUN_TOP1 = 2.5, 60, 0.25

# Property-based tests (tests/data/test_fuzz.py): ~100 cases per target in make test-fast; HYPOTHESIS_PROFILE=ci-long
# for 2,000. No deadline: the machine is shared, and a slow case is not a failure (a hang is: pytest-timeout).
_FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=100, **_FUZZ)
settings.register_profile("ci-long", max_examples=2000, **_FUZZ)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

_set_num_threads = torch.set_num_threads  # tests may monkeypatch torch.set_num_threads


@contextmanager
def _one_torch_thread():
    """Exact float comparisons must not depend on the machine's core count: one thread, restored after."""
    threads = torch.get_num_threads()
    _set_num_threads(1)
    try:
        yield
    finally:
        _set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _one_thread_for_module_fixtures():
    """Set before any module-scoped fixture runs, so that trained runs shared by a module are pinned too."""
    with _one_torch_thread():
        yield


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Seed 0 and one torch thread for each test (a test that changes the thread count is undone)."""
    with _one_torch_thread():
        torch.manual_seed(0)
        yield


# ---- Trained models shared by the test run: each built once per run, whatever the pytest-xdist workers (a file
# lock, as pytest-xdist's "Making session-scoped fixtures execute only once"), on first use; what it has learned is
# asserted once, when built. Tests read them and never write into them: a test that changes or resumes one copies
# it to tmp_path first (each worker's teardown fails if a shared folder changed while it held it).


def _contents(folder: Path, leave_out=()) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder`` (but those under the ``leave_out`` subfolders)."""
    import hashlib

    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.relative_to(folder).parts[0] not in leave_out
    }


@contextmanager
def _left_as_made(*folders: Path, leave_out=()):
    """Fail the session's teardown if a test wrote into, or deleted from, one of the shared ``folders``."""
    before = [_contents(f, leave_out) for f in folders]
    yield
    for folder, files in zip(folders, before):
        assert _contents(folder, leave_out) == files, f"a test changed the shared {folder}: copy it to tmp_path first"


def _shared_root(tmp_path_factory, worker_id: str) -> Path:
    """The test run's folder of shared builds: the base temp folder of one process, its parent (the run's) under
    pytest-xdist, where each worker's is ``popen-gwN``."""
    base = tmp_path_factory.getbasetemp()
    return (base if worker_id == "master" else base.parent) / "shared"


def _built_once(tmp_path_factory, worker_id: str, name: str, build) -> Path:
    """``build(folder)`` run once per test run for ``shared/name``: the first process to ask builds it while it
    holds ``name``'s file lock, the others wait and take it as built (``name.done`` holds its seconds and the
    builder); a build that failed leaves no ``.done`` and is started afresh by the next to ask."""
    import shutil
    import time

    from filelock import FileLock

    root = _shared_root(tmp_path_factory, worker_id)
    root.mkdir(parents=True, exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            started = time.monotonic()
            with _one_torch_thread():
                torch.manual_seed(0)
                build(folder)
            done.write_text(f"{time.monotonic() - started:.1f} {worker_id}\n")
    return folder


def _train_run(folder, overrides):
    from tests.helpers.runs import TINY, compose_train
    from vitattn.training import train

    train(compose_train([*TINY, *overrides], folder))
    return folder


def _export_onnx_folders(run: Path, kept_file: Path, *, int8: bool = True) -> None:
    """``vitattn-export format=onnx`` (and ``quantize=int8``) into ``run/onnx`` (``run/onnx-int8``): inside the run,
    so that ``vitattn-eval split=test`` on a folder scores the run's split; the products each export kept in fp32
    (``record_kept_fp32``) written to ``kept_file`` (JSON), for the processes that did not export."""
    from tests.helpers.onnx import record_kept_fp32
    from vitattn.cli.export import main as export_main

    kept = {}
    for name, extra in [("onnx", []), *([("onnx-int8", ["quantize=int8"])] if int8 else [])]:
        with pytest.MonkeyPatch.context() as monkeypatch:
            kept[name] = record_kept_fp32(monkeypatch)
            assert export_main([f"model={run}", f"out={run / name}", "format=onnx", *extra]) == 0
    kept_file.write_text(json.dumps(kept.get("onnx-int8", {})))


def _onnx_folders(run: Path, kept_file: Path) -> OnnxFolders:
    int8 = run / "onnx-int8"
    return OnnxFolders(run / "onnx", int8 if int8.is_dir() else None, json.loads(kept_file.read_text()))


def _check_caption_run(run: Path) -> None:
    """What ``shapes_caption_run``'s docstring says it learned, on the first 200 test images (greedy)."""
    from tests.helpers.runs import shapes_split
    from vitattn import Captioner
    from vitattn.metrics import compute_caption_metrics

    images, references = shapes_split("caption", 200)
    with torch.inference_mode():
        captions, _ = Captioner.load(run).caption_pixels(images)
    cider, distinct = compute_caption_metrics(captions, references)["cider_d"], len(set(captions))
    assert cider >= CAPTION_RUN_CIDER and distinct >= CAPTION_RUN_DISTINCT, f"CIDEr-D {cider:.2f}, {distinct} distinct"


def _check_classifier_run(run: Path) -> None:
    """What ``shapes_classifier_run``'s docstring says it learned, on the first 1,000 test images."""
    from tests.helpers.runs import shapes_split
    from vitattn import Classifier

    images, labels = shapes_split("classification", 1000)
    with torch.inference_mode():
        predicted = Classifier.load(run).model(images).argmax(-1).tolist()
    top1, classes = sum(p == y for p, y in zip(predicted, labels)) / len(labels), len(set(predicted))
    assert top1 >= CLASSIFIER_RUN_TOP1 and classes >= 9, f"top-1 {top1:.3f}, {classes} classes predicted"


@pytest.fixture(scope="session")
def shapes_caption_run(tmp_path_factory, worker_id) -> Path:
    """A tiny captioner (``head=caption``, TINY) trained 300 steps on 256 shapes images (lr 3e-3, 10 warmup
    steps; test split 1,000 images, ``test=false``). What it has learned (measured): CIDEr-D 3.2 and 158 distinct
    greedy captions on its 1,000 test images, CIDEr-D 3.1 and 76 distinct on the 200 first (seed 0); asserted when
    built: CIDEr-D at least ``CAPTION_RUN_CIDER`` and ``CAPTION_RUN_DISTINCT`` distinct captions on the 200 first.
    About 6 s (20 s on a busy machine); its ONNX folders: ``shapes_caption_onnx``."""
    overrides = ["head=caption", *SHAPES_RUN, f"data.num_test={CAPTION_TEST_IMAGES}", "trainer.max_steps=300"]
    extra = ["trainer.check_val_every_n_epoch=50", "optim.lr=3e-3", "optim.warmup_steps=10"]

    def build(folder: Path) -> None:
        _check_caption_run(_train_run(folder, [*overrides, *extra]))

    run = _built_once(tmp_path_factory, worker_id, "shapes_caption_run", build)
    with _left_as_made(run, leave_out=("onnx", "onnx-int8")):
        yield run


@pytest.fixture(scope="session")
def shapes_caption_onnx(shapes_caption_run, tmp_path_factory, worker_id) -> OnnxFolders:
    """``shapes_caption_run``'s fp32 and int8 ONNX folders, written by vitattn-export inside the run (``onnx``,
    ``onnx-int8``), and the products the int8 export kept in fp32. About 2 s."""
    kept = _built_once(
        tmp_path_factory,
        worker_id,
        "shapes_caption_onnx",
        lambda f: _export_onnx_folders(shapes_caption_run, f / "kept.json"),
    )
    folders = _onnx_folders(shapes_caption_run, kept / "kept.json")
    with _left_as_made(folders.fp32, folders.int8):
        yield folders


@pytest.fixture(scope="session")
def shapes_classifier_run(tmp_path_factory, worker_id) -> Path:
    """A tiny classifier (TINY with 4 px patches) trained 600 steps on 2,048 shapes images (lr 1e-3, 10 warmup
    steps; test split 4,000 images, ``test=false``): top-1 0.34 on the 18 classes of the left-most shape (a
    model that has learned, its predictions spread over the classes: 14 of them on the 1,000 first); asserted
    when built: top-1 at least ``CLASSIFIER_RUN_TOP1`` on the 1,000 first, 9 classes predicted or more. About 9 s
    (40 s on a busy machine); its ONNX folders: ``shapes_classifier_onnx``."""
    overrides = ["head=classification", *SHAPES_RUN, "data.num_train=2048", f"data.num_test={LABEL_TEST_IMAGES}"]
    extra = ["model.patch_size=4", "trainer.max_steps=600", "trainer.check_val_every_n_epoch=50"]

    def build(folder: Path) -> None:
        _check_classifier_run(_train_run(folder, [*overrides, *extra, "optim.lr=1e-3", "optim.warmup_steps=10"]))

    run = _built_once(tmp_path_factory, worker_id, "shapes_classifier_run", build)
    with _left_as_made(run, leave_out=("onnx", "onnx-int8")):
        yield run


@pytest.fixture(scope="session")
def shapes_classifier_onnx(shapes_classifier_run, tmp_path_factory, worker_id) -> OnnxFolders:
    """``shapes_classifier_run``'s fp32 and int8 ONNX folders inside the run, and the products int8 kept in fp32."""
    kept = _built_once(
        tmp_path_factory,
        worker_id,
        "shapes_classifier_onnx",
        lambda f: _export_onnx_folders(shapes_classifier_run, f / "kept.json"),
    )
    folders = _onnx_folders(shapes_classifier_run, kept / "kept.json")
    with _left_as_made(folders.fp32, folders.int8):
        yield folders


# The small runs: TINY on the shapes' small splits (TINY_SHAPES: 16 validation and 16 test images), for tests that
# score a whole split by hand or start from a run; validated once, at the last step (the best weights are the last).
SMALL_CAPTION_RUN = [
    "head=caption", *TINY_SHAPES, "head.decoder.depth=1", "trainer.max_steps=40", "trainer.max_epochs=-1",
    "trainer.check_val_every_n_epoch=5", "optim.lr=3e-3", "optim.warmup_steps=5", "trainer.precision=32-true",
    "callbacks.step_checkpoint.every_n_train_steps=8",
]  # fmt: skip
SMALL_COCA_RUN = [
    "head=coca", *TINY_SHAPES, "trainer.precision=32-true", "trainer.max_steps=3", "trainer.max_epochs=-1",
    "trainer.val_check_interval=3", "trainer.check_val_every_n_epoch=null", "trainer.num_sanity_val_steps=0",
    "test=false",
]  # fmt: skip
SMALL_CLASSIFIER_RUN = ["head=classification", *TINY_SHAPES, "trainer.max_steps=8", "test=false"]
BPE_CAPTION_RUN = [
    "head=caption", *TINY_SHAPES, "tokenizer=bpe", "trainer.max_steps=40", "trainer.max_epochs=-1",
    "trainer.check_val_every_n_epoch=5", "optim.lr=3e-3", "optim.warmup_steps=5", "test=false",
]  # fmt: skip


@pytest.fixture(scope="session")
def small_caption_run(tmp_path_factory, worker_id) -> Path:
    """A tiny captioner (``head=caption``, TINY, a 1-layer decoder) trained 40 steps on 64 shapes images (lr 3e-3,
    5 warmup steps), validated at its last step and tested on 16 images each (``result.json``: its ``val/`` and
    ``test/`` metrics; ``head.zero_shot``: the six classes of ``ZERO_SHOT_CLASSES`` by caption likelihood), a step
    checkpoint every 8 steps, its bundle the last weights. About 3 s."""
    folder = _zero_shot_folder(tmp_path_factory, worker_id)
    overrides = [*SMALL_CAPTION_RUN, f"head.zero_shot.data_root={folder}"]
    yield from _small_run(tmp_path_factory, worker_id, "small_caption_run", overrides)


@pytest.fixture(scope="session")
def small_coca_run(tmp_path_factory, worker_id) -> Path:
    """A tiny ``head=coca`` run (TINY) trained 3 steps and validated at its last, with zero-shot classification of
    the six classes of ``ZERO_SHOT_CLASSES`` (its scorer contrastive); no test. About 2 s."""
    folder = _zero_shot_folder(tmp_path_factory, worker_id)
    overrides = [*SMALL_COCA_RUN, f"head.zero_shot.data_root={folder}"]
    yield from _small_run(tmp_path_factory, worker_id, "small_coca_run", overrides)


def _zero_shot_folder(tmp_path_factory, worker_id: str) -> Path:
    """Four 36 px images of each of ``ZERO_SHOT_CLASSES`` in ``val/`` (and ``train/``), made once per test run."""
    from tests.helpers.images import make_image_folder

    def build(folder: Path) -> None:
        make_image_folder(folder, classes=ZERO_SHOT_CLASSES, per_class=4, size=36)

    return _built_once(tmp_path_factory, worker_id, "zero_shot_folder", build)


@pytest.fixture(scope="session")
def small_classifier_run(tmp_path_factory, worker_id) -> Path:
    """A tiny classifier (TINY) trained 8 steps on 64 shapes images (one epoch, validated at its end; no test),
    its bundle the last weights. About 1 s."""
    yield from _small_run(tmp_path_factory, worker_id, "small_classifier_run", SMALL_CLASSIFIER_RUN)


@pytest.fixture(scope="session")
def bpe_caption_run(tmp_path_factory, worker_id) -> Path:
    """A tiny captioner with ``tokenizer=bpe`` (TINY) trained 40 steps on 64 shapes images (lr 3e-3, 5 warmup
    steps), validated at its last step (no test), its bundle the last weights: its ``tokenizer.json`` in the run
    and the bundle. About 4 s."""
    yield from _small_run(tmp_path_factory, worker_id, "bpe_caption_run", BPE_CAPTION_RUN)


def _small_run(tmp_path_factory, worker_id: str, name: str, overrides: list[str]):
    def build(folder: Path) -> None:
        _train_run(folder, overrides)
        assert RunDir(folder).load_result()["metrics"], f"{name} logged no metrics"

    run = _built_once(tmp_path_factory, worker_id, name, build)
    with _left_as_made(run):
        yield run


def _colour_model(tmp_path_factory, worker_id: str, name: str, **kwargs):
    """``train_colour_coca(**kwargs)``'s bundle, built once per test run, its learning checked (``check_colours``)."""
    from tests.helpers.coca import check_colours, train_colour_coca

    def build(folder: Path) -> None:
        check_colours(train_colour_coca(folder / "bundle", **kwargs), **kwargs)

    bundle = _built_once(tmp_path_factory, worker_id, name, build) / "bundle"
    with _left_as_made(bundle):
        yield bundle


@pytest.fixture(scope="session")
def colour_coca(tmp_path_factory, worker_id) -> Path:
    """The bundle of ``tests.helpers.coca.train_colour_coca``'s ``head=coca`` model: 300 steps of the CLIP loss
    alone on one noisy flat square per colour (red, green, blue, yellow) a step, captions from
    ``TRAIN_TEMPLATES``. Zero-shot names each colour's images (every one of them), retrieval ranks the
    colour's captions first (both asserted when built, ``check_colours``); its caption decoder is untrained.
    About 2 s."""
    yield from _colour_model(tmp_path_factory, worker_id, "colour_coca")


@pytest.fixture(scope="session")
def colour_coca_onnx(colour_coca, tmp_path_factory, worker_id) -> OnnxFolders:
    """``colour_coca``'s fp32 and int8 ONNX folders (``export_onnx``, with the embedding graphs and scale), and the
    products the int8 export kept in fp32."""

    def build(root: Path) -> None:
        from tests.helpers.onnx import record_kept_fp32
        from vitattn.bundle import load_bundle
        from vitattn.bundle.onnx_export import export_onnx

        with pytest.MonkeyPatch.context() as monkeypatch:
            kept = record_kept_fp32(monkeypatch)
            export_onnx(load_bundle(colour_coca), root / "onnx-int8", quantize="int8")
            export_onnx(load_bundle(colour_coca), root / "onnx")
        (root / "kept.json").write_text(json.dumps(kept))

    root = _built_once(tmp_path_factory, worker_id, "colour_coca_onnx", build)
    folders = OnnxFolders(root / "onnx", root / "onnx-int8", json.loads((root / "kept.json").read_text()))
    with _left_as_made(folders.fp32, folders.int8):
        yield folders


@pytest.fixture(scope="session")
def colour_captioner(tmp_path_factory, worker_id) -> Path:
    """``train_colour_coca(head="caption")``: an ``ImageCaptioner`` trained 300 steps on the caption cross-entropy
    alone (same images and captions as ``colour_coca``): it names the colour of a square by likelihood (asserted
    when built)."""
    yield from _colour_model(tmp_path_factory, worker_id, "colour_captioner", head="caption")


@pytest.fixture(scope="session")
def colour_coca_both(tmp_path_factory, worker_id) -> Path:
    """``train_colour_coca(caption_weight=1.0)``: a ``head=coca`` model trained 300 steps on the CLIP loss plus the
    caption cross-entropy: both its embeddings and its caption decoder have learned the colours (asserted when
    built)."""
    yield from _colour_model(tmp_path_factory, worker_id, "colour_coca_both", caption_weight=1.0)


def pytest_terminal_summary(terminalreporter):
    """The number of generated cases per fuzzed target, when tests/data/test_fuzz.py ran; the seconds each shared
    build took, and which process built it."""
    _shared_builds(terminalreporter)
    fuzz = sys.modules.get("tests.data.test_fuzz")
    if fuzz is None or not fuzz.CASES:
        return
    terminalreporter.section("fuzzed cases per target (refused / accepted)")
    for target in sorted({target for target, _ in fuzz.CASES}):
        refused, accepted = fuzz.CASES[target, "refused"], fuzz.CASES[target, "accepted"]
        terminalreporter.write_line(f"{target:<42} {refused + accepted:>6}  ({refused} refused, {accepted} accepted)")


def _shared_builds(terminalreporter) -> None:
    factory = getattr(terminalreporter.config, "_tmp_path_factory", None)
    root = factory.getbasetemp() / "shared" if factory is not None and factory._basetemp is not None else None
    done = sorted(root.glob("*.done")) if root is not None and root.is_dir() else []
    if done:
        terminalreporter.section("shared builds (seconds, built by)")
        for file in done:
            terminalreporter.write_line(f"{file.stem:<28} {file.read_text().strip()}")


@pytest.fixture
def no_network(monkeypatch):
    """Every connection is refused, as with the network down: returns the list of the attempts (empty while
    nothing tried to connect, as HF_HUB_OFFLINE promises)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise ConnectionRefusedError(f"network access refused by the test: {args[1:] or args}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face hub cache in ``tmp_path`` (``HF_HOME``/hub), for this process and the commands it
    starts; ``tests.helpers.put_in_hub_cache`` fills it as huggingface_hub does."""
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def hub_offline(monkeypatch):
    """``HF_HUB_OFFLINE=1``, for this process (huggingface_hub reads it once, at import) and the commands it starts."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


# The files that take longest (DDP ranks killed and resumed, servers, sweeps), longest first as measured by
# ``--durations=0`` on two workers: handed out first (``make test`` passes ``--no-loadscope-reorder``, so that xdist
# keeps this order rather than its own by number of tests), so that ``--dist loadfile`` does not leave one of them
# running alone at the end.
LONG_FILES = (
    "tests/training/test_preemption.py",
    "tests/training/test_data_resume_ddp.py",
    "tests/serve/test_serve.py",
    "tests/training/test_sweeps.py",
    "tests/training/test_shards_resume.py",
    "tests/training/test_data_resume.py",
    "tests/training/test_sharding.py",
    "tests/training/test_bootstrap.py",
    "tests/training/test_self_critical.py",
    "tests/metrics/test_coco_toolkit.py",
    "tests/inference/test_captioning_processes.py",
    "tests/training/test_coca.py",
    "tests/test_transfer_bench.py",
    "tests/bundle/test_onnx_folder.py",
    "tests/inference/test_captioning_shards.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))
    first = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::", 1)[0], len(first)))  # stable: the rest in order
