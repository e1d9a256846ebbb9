"""The model card (``README.md``) of a Hub folder: the Hub's metadata header (huggingface_hub's ``ModelCardData``)
and a body written from the bundle and, when it came from one, its training run (``result.json``, and what its
``config.yaml`` records: ``RunDir.saved``): sizes, data and steps, the test metrics with the decoding settings that
produced them, the preprocessing, and the commands that use it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vitattn.bundle.folder import Bundle, merge_setting, recorded_merge_tokens
from vitattn.bundle.hub import HUB_PREFIX, is_hub_name
from vitattn.data.preprocess import describe
from vitattn.models.timm_weights import timm_pretrained_cfg
from vitattn.run_dir import RunConfig, RunDir

__all__ = ["CARD_FILE", "METRICS_HEADING", "PIPELINE_TAGS", "model_card"]

CARD_FILE = "README.md"
METRICS_HEADING = "## Test metrics"
PIPELINE_TAGS = {"caption": "image-to-text", "classification": "image-classification"}
_ENCODER_KEYS = ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio")
_DECODER_KEYS = ("vocab_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "max_len")


def _run_datasets(run: RunConfig | None) -> list[str]:
    """The data a run was trained on, as its data module's name (``ShapesDataModule`` -> ``shapes``); none without
    a run."""
    if run is None:
        return []
    name = run.data_target.rsplit(".", 1)[-1].removesuffix("DataModule").lower()
    return [name] if name else []


def _run_license(run: RunConfig | None) -> str | None:
    """The license timm gives the pretrained weights a run started from (``finetune.init=NAME``), or None."""
    init = run.init if run is not None else None
    if not init or is_hub_name(init) or Path(str(init)).expanduser().exists():
        return None
    try:
        return timm_pretrained_cfg(str(init).partition("@")[0], downloadable=False).license
    except (ValueError, AttributeError):  # not a timm name, or timm knows no license
        return None


def _sizes(config: Mapping[str, Any], keys: Sequence[str]) -> str:
    return ", ".join(f"{k} {config[k]}" for k in keys if k in config)


def _settings(settings: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={json.dumps(v)}" for k, v in settings.items())


def _training(run: RunConfig | None, result: Mapping[str, Any] | None, datasets: Sequence[str]) -> list[str]:
    if run is None:
        return ["Not exported from a training run: no training record."]
    counts = ", ".join(f"{k.removeprefix('num_')} {v}" for k, v in run.images.items())
    lines = [f"- data: {', '.join(datasets) or 'see config'}" + (f" ({counts} images)" if counts else "")]
    if result is not None:
        lines.append(f"- steps: {result['global_step']}; weights: {result['weights']}")
    lines.append(f"- optimiser: lr {run.lr}, weight decay {run.weight_decay}")
    boot = run.bootstrap
    if boot is not None:
        source = f"teacher {boot.teacher}" if boot.teacher else f"the side files {boot.candidates}"
        keep = ", ".join(f"{k} {v}" for k, v in boot.keep.items()) or "all"
        lines.append(
            f"- also trained on images without captions, labelled by {source} (filter {boot.filter}, "
            f"{boot.samples} candidates per image, keep {keep}; lineage: the run's bootstrap/lineage.json)"
        )
    semi = run.semi
    if semi is not None:
        teacher = f"an EMA copy of the model (decay {semi.ema_decay})" if semi.ema_decay else "the model itself"
        threshold = "FreeMatch's adaptive threshold" if semi.method == "freematch" else f"threshold {semi.threshold}"
        lines.append(
            f"- also learned from the images without labels of {semi.images}, pseudo-labelled online by {teacher} "
            f"(semi={semi.method}: {semi.ratio} per labelled image a step, {threshold}, weight {semi.weight}, "
            f"strong view {semi.strong}; pseudo-labels: the run's semi/ folder)"
        )
    return lines


def _metrics(result: Mapping[str, Any] | None, decoding: Mapping[str, Any] | None) -> list[str]:
    if result is None or not result["metrics"]:
        return ["No test metrics: the run was not tested (test=false) or is not complete."]
    lines = [f"Decoding: {_settings(decoding)}", ""] if decoding else []
    lines += ["| metric | value |", "|---|---|"]
    lines += [f"| {name} | {value!r} |" for name, value in result["metrics"].items()]
    return lines


def _usage(model: Bundle, name: str) -> list[str]:
    hub = f"{HUB_PREFIX}{name}"
    if model.task == "caption":
        shell = f"vitattn-caption model={hub} images=photos/ out=captions.jsonl"
        python = [
            "from vitattn import Captioner",
            "",
            f'captioner = Captioner.load("{hub}")',
            'print(captioner.caption("cat.jpg"))',
        ]
    else:
        shell = f"vitattn-eval model={hub} data_root=images/"
        python = [
            "from vitattn import Classifier",
            "",
            f'classifier = Classifier.load("{hub}")',
            'print(classifier.predict("cat.jpg", top_k=5))',
        ]
    return ["```bash", "pip install vitattn", shell, "```", "", "```python", *python, "```"]


def model_card(
    model: Bundle,
    name: str,
    run: RunDir | None,
    *,
    license: str | None = None,
    datasets: Sequence[str] = (),
    onnx: bool = False,
) -> Any:
    """The ``huggingface_hub.ModelCard`` of ``model`` published as ``name`` (``ORG/NAME``), from the ``run`` it was
    trained in when there is one (its ``result.json`` metrics and its config's decoding, data and optimiser);
    ``license`` and ``datasets`` default to the run's (timm's license of its start weights; its data module)."""
    from huggingface_hub import ModelCard, ModelCardData

    saved = run.saved() if run is not None else None
    result = run.load_result() if run is not None else None
    datasets = list(datasets) or _run_datasets(saved)
    decoding = None
    if model.task == "caption":  # what the run's test was decoded with, else the bundle's defaults
        decoding = saved.generate if saved is not None else dict(model.generate)
    tags = ["vitattn", "vision-transformer", "image-captioning" if model.task == "caption" else "image-classification"]
    data = ModelCardData(
        library_name="vitattn",
        pipeline_tag=PIPELINE_TAGS[model.task],
        license=license or _run_license(saved),
        datasets=datasets or None,
        tags=tags + (["onnx"] if onnx else []),
    )
    config = model.config.get("model", {})
    encoder = config.get("encoder", config)
    parameters = sum(p.numel() for p in model.model.parameters())
    sizes = [f"- parameters: {parameters:,}", f"- encoder: ViT, {_sizes(encoder, _ENCODER_KEYS)}"]
    trained = recorded_merge_tokens(model.config)
    if trained:
        sizes.append(f"- token merging (ToMe): trained with merge_tokens={merge_setting(trained)}")
    if "decoder" in config:
        sizes.append(f"- decoder: {_sizes(config['decoder'], _DECODER_KEYS)}")
    if model.class_names is not None:
        sizes.append(f"- classes: {len(model.class_names)} ({', '.join(model.class_names[:10])})")
    runtime = "ONNX Runtime (an ONNX folder)" if onnx else "PyTorch (a vitattn bundle)"
    body = [
        f"# {name}",
        "",
        f"A vitattn {model.task} model for {runtime}.",
        "",
        "## Model",
        "",
        *sizes,
        "",
        "## Training",
        "",
        *_training(saved, result, datasets),
        "",
        METRICS_HEADING,
        "",
        *_metrics(result, decoding),
        "",
        "## Preprocessing",
        "",
        describe(model.preprocess),
        "",
        "## Use",
        "",
        *_usage(model, name),
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")
