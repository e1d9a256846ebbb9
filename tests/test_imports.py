"""The package's imports: the layering itself is the import-linter contract in pyproject.toml (``make lint``);
here, that the inference path (the API, ``vitattn-caption``, ``vitattn-eval``, ``vitattn-serve``) imports no
training package, that captioning imports no timm (a first caption in about the time of importing torch), and
that importing vitattn changes nothing global."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.bundles import make_caption_bundle, make_classifier_bundle
from tests.helpers.datasets import make_coco

# What the inference path must not import: the training stack (Lightning, Hydra) and what only training,
# figures or classification metrics use. Each case runs in a fresh interpreter, so that nothing imported by
# the test session (conftest imports torch, helpers import Hydra) hides an import.
TRAINING_ONLY = ("lightning", "pytorch_lightning", "hydra", "matplotlib", "torchmetrics")
# What captioning must not import either: timm imports wandb where it is installed (timm.utils.summary), a large
# part of a first caption's time (docs/benchmarks.md#a-first-caption: 1.13x the torch import without, ~1.4x with).
NOT_CAPTIONING = (*TRAINING_ONLY, "timm", "wandb")
CAPTIONING = ("Captioner.caption", "vitattn-caption")

_REPORT = """
import json, sys
print(json.dumps(sorted(m for m in {modules!r} if m in sys.modules)))
"""

_INFERENCE_CASES = {
    "Captioner.caption": """
from vitattn import Captioner
caption = Captioner.load(r"{caption}").caption(r"{image}")
assert isinstance(caption, str) and caption, caption
""",
    "Classifier.predict": """
from vitattn import Classifier
prediction = Classifier.load(r"{classifier}").predict(r"{image}", top_k=2)
assert prediction.labels and set(prediction.labels) <= {{"cat", "dog", "bird"}}, prediction
""",
    "vitattn-caption": """
from pathlib import Path
from vitattn.cli.caption import main
status = main(["model={caption}", "images={image}", "out={out}/captions.jsonl", "num_workers=0", "progress=false"])
assert status == 0 and len(Path(r"{out}/captions.jsonl").read_text().splitlines()) == 1
""",
    "vitattn-eval": """
from vitattn.cli.evaluate import main
status = main(["model={caption}", "references={references}", "image_dir={image_dir}", "out={out}/eval",
               "num_workers=0", "progress=false"])
assert status == 0, status
""",
    "vitattn-serve": """
import base64
from vitattn.cli.serve import parse_args
from vitattn.serve import CaptionAPI, GracefulStop, build_server
api = CaptionAPI(parse_args(["model={caption}"]).model)
build_server(api, accelerator="cpu", stop=GracefulStop(timeout=5))
api.setup("cpu")  # what each inference worker does, then one request
request = api.decode_request({{"image": base64.b64encode(open(r"{image}", "rb").read()).decode()}})
assert "caption" in api.predict([request])[0]
""",
}


def _modules_after(code: str, modules: tuple[str, ...] = TRAINING_ONLY, **paths: Path) -> list[str]:
    """The ``modules`` that ``code`` (formatted with ``paths``) leaves imported, in a fresh process."""
    script = code.format(**paths) + _REPORT.format(modules=modules)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def inference_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inference")
    coco = make_coco(root / "coco", num_train=1, num_val=2)
    image = sorted(coco["image_dir"].glob("val_*.jpg"))[0]
    return dict(
        caption=make_caption_bundle(root / "caption"),
        classifier=make_classifier_bundle(root / "classifier"),
        image=image,
        references=coco["val_annotations"],
        image_dir=coco["image_dir"],
        out=root,
    )


# each a process of its own: test-fast runs the API's and the server's, the slow tests all
@pytest.mark.parametrize(
    "case",
    [
        c if c in ("Captioner.caption", "vitattn-serve") else pytest.param(c, marks=pytest.mark.slow)
        for c in _INFERENCE_CASES
    ],
)
def test_inference_path_imports_no_training_package(case, inference_files):
    forbidden = NOT_CAPTIONING if case in CAPTIONING else TRAINING_ONLY
    assert _modules_after(_INFERENCE_CASES[case], forbidden, **inference_files) == []


def test_vitattn_eval_imports_nothing_of_training():
    """Its own modules, the run's split included; what the run's data config names is Hydra's to import."""
    import vitattn.training

    training = (
        "vitattn.training",
        *(m.name for m in pkgutil.walk_packages(vitattn.training.__path__, "vitattn.training.")),
    )
    assert _modules_after("import vitattn.cli.evaluate, vitattn.cli.run_split\n", training) == []


def test_attention_maps_import_matplotlib_when_asked(inference_files):
    code = """
from vitattn.cli.caption import main
assert main(["model={caption}", "images={image}", "out={out}/maps.jsonl", "attention_maps={out}/maps",
             "num_workers=0", "progress=false"]) == 0
"""
    assert "matplotlib" in _modules_after(code, **inference_files)  # the check sees an import


# What a library import must leave as it found it (issue 29): import hooks, warning filters, the loggers' handlers
# and levels, the environment, torch's threads and global switches, signal handlers.
_GLOBAL_STATE = """
import json, logging, os, signal, sys, warnings
import torch  # a dependency: its own import's changes are not vitattn's


def state():
    loggers = {
        name or "root": dict(level=log.level, handlers=[repr(h) for h in log.handlers],
                             filters=[repr(f) for f in log.filters], propagate=log.propagate, disabled=log.disabled)
        for name, log in ((n, logging.getLogger(n)) for n in ("", "vitattn", "lightning"))
    }
    return dict(
        meta_path=[repr(f) for f in sys.meta_path],
        path_hooks=[repr(h) for h in sys.path_hooks],
        path=list(sys.path),
        warning_filters=[repr(f) for f in warnings.filters],
        loggers=loggers,
        logging_disable=logging.root.manager.disable,
        environ=dict(os.environ),
        torch_threads=[torch.get_num_threads(), torch.get_num_interop_threads()],
        torch_switches=[str(torch.get_default_dtype()), torch.get_float32_matmul_precision(),
                        torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark],
        signals=[repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)],
        excepthook=repr(sys.excepthook),
    )


states = {"before": state()}
import vitattn
states["import vitattn"] = state()
# The dependencies the API imports change some of this themselves (torchvision sets TORCHINDUCTOR_CACHE_DIR, timm's
# sympy adds a warning filter): imported first, so that what follows is vitattn's doing alone.
import numpy, PIL.Image, omegaconf, safetensors.torch, huggingface_hub, torchvision, timm
states["dependencies"] = state()
from vitattn import Captioner, Classifier
import vitattn.inference.api
states["public API"] = state()
print(json.dumps(states))
"""


def _changed(before: dict, after: dict) -> dict:
    """What differs between two states: the keys of a mapping, the items of a list, else (before, after)."""
    changes = {}
    for key in before:
        old, new = before[key], after[key]
        if old == new:
            continue
        if isinstance(old, dict):
            changes[key] = {k: (old.get(k), new.get(k)) for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
        elif isinstance(old, list) and all(isinstance(x, str) for x in old + new):
            changes[key] = dict(added=[x for x in new if x not in old], removed=[x for x in old if x not in new])
        else:
            changes[key] = (old, new)
    return changes


def test_importing_vitattn_changes_nothing_global():
    done = subprocess.run([sys.executable, "-c", _GLOBAL_STATE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    states = json.loads(done.stdout.splitlines()[-1])
    assert _changed(states["before"], states["import vitattn"]) == {}
    assert _changed(states["dependencies"], states["public API"]) == {}
