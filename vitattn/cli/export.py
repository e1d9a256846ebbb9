"""``vitattn-export``: write a model as a bundle (safetensors, config.json, tokenizer), an ONNX or a Hub folder.

    vitattn-export model=PATH out=DIR [which=best|last] [device=cpu] [format=bundle|onnx|hub] [quantize=int8]
        [merge_tokens=R|[R1,R2,...]] [hub_format=bundle|onnx] [license=ID] [datasets=NAME,NAME] [push_to_hub=ORG/NAME]

``model``: a run folder (``which``: its best or last checkpoint; else its bundle), a ``.ckpt`` (never unpickled), a
bundle or ``hf-hub:ORG/NAME``. ``format=onnx`` (the ``onnx`` extra) is what ONNX Runtime runs; ``quantize=int8``
quantizes it; ``merge_tokens`` sets the tokens each encoder layer merges (ToMe: R in every layer, or one count per
layer; 0: off; default: the model's), fixed in the graphs and recorded in onnx.json. ``format=hub`` adds a model card
README.md made from the run (``license``, ``datasets``: its metadata) to the bundle (``hub_format=onnx``: the ONNX
folder); ``push_to_hub=ORG/NAME`` uploads it. Written atomically. Exit status: 0 done; 2 a usage or model error, or
an upload that cannot be made (offline). More: docs/captioning.md."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from vitattn.cli.args import UsageError, parse_key_values, resolve_device, run_main
from vitattn.run_dir import RunDir

__all__ = ["ExportConfig", "main", "parse_args", "run"]


@dataclass
class ExportConfig:
    """``vitattn-export`` arguments."""

    model: str = MISSING
    out: str = MISSING
    which: str | None = None
    device: str = "cpu"
    format: str = "bundle"
    quantize: str | None = None
    merge_tokens: Any = None  # R, or [R1,R2,...] one per encoder layer: an int or a list once parsed
    hub_format: str = "bundle"
    license: str | None = None
    datasets: str | None = None  # comma-separated
    push_to_hub: str | None = None


def parse_args(argv: list[str]) -> Any:
    """``key=value`` arguments -> a validated ``ExportConfig``."""
    cfg = parse_key_values(argv, ExportConfig, "vitattn-export")
    if cfg.which not in (None, "best", "last"):
        raise UsageError(f"which={cfg.which!r} is unknown; choose which=best or which=last")
    if cfg.format not in ("bundle", "onnx", "hub"):
        raise UsageError(f"format={cfg.format!r} is unknown; choose format=bundle, format=onnx or format=hub")
    if cfg.hub_format not in ("bundle", "onnx"):
        raise UsageError(f"hub_format={cfg.hub_format!r} is unknown; choose hub_format=bundle or hub_format=onnx")
    hub_only = [k for k in ("license", "datasets", "push_to_hub") if cfg[k] is not None]
    if cfg.hub_format != "bundle":
        hub_only.append("hub_format")
    if hub_only and cfg.format != "hub":
        raise UsageError(f"{', '.join(hub_only)} need format=hub")
    if cfg.quantize not in (None, "int8"):
        raise UsageError(f"quantize={cfg.quantize!r} is unknown; choose quantize=int8 or leave it out")
    if cfg.quantize is not None and _onnx_format(cfg) is None:
        raise UsageError("quantize=int8 needs format=onnx (or format=hub hub_format=onnx)")
    if cfg.merge_tokens is not None:
        if _onnx_format(cfg) is None:
            raise UsageError(f"merge_tokens={cfg.merge_tokens} needs format=onnx (or format=hub hub_format=onnx)")
    if cfg.push_to_hub is not None:
        from vitattn.bundle.hub import HUB_PREFIX, parse_hub_name

        try:
            parse_hub_name(HUB_PREFIX + cfg.push_to_hub)
        except ValueError as err:
            raise UsageError(f"push_to_hub={cfg.push_to_hub}: {err}") from None
    return cfg


def _onnx_format(cfg: Any) -> str | None:
    """``onnx`` when the folder written is an ONNX folder (``format=onnx``, or ``format=hub hub_format=onnx``)."""
    return "onnx" if cfg.format == "onnx" or (cfg.format == "hub" and cfg.hub_format == "onnx") else None


def run(cfg: Any) -> int:
    """Load ``cfg.model`` and save it as a bundle, ONNX or Hub folder at ``cfg.out``."""
    from vitattn.bundle import load_bundle, runtime_of, save_bundle
    from vitattn.bundle.card import CARD_FILE
    from vitattn.bundle.hub import push_folder, resolve_model_path

    source = resolve_model_path(cfg.model)  # a hf-hub: name fetched once, for runtime_of and load_bundle
    if cfg.which is not None:
        run = RunDir(cfg.model)
        if not run.checkpoints.is_dir():
            raise UsageError(f"which={cfg.which} needs a training run folder; model={cfg.model} is not one")
        source = run.best_checkpoint if cfg.which == "best" else run.last_checkpoint
        if not source.is_file():
            raise FileNotFoundError(f"model={cfg.model} has no {source.relative_to(run.path)}")
    if runtime_of(source) == "onnx":
        raise UsageError(
            f"model={cfg.model} is an ONNX folder, which cannot be exported again; export the bundle or run folder "
            "it came from"
        )
    if _onnx_format(cfg):
        from vitattn.bundle.onnx_folder import require_onnxruntime

        require_onnxruntime(export=True)  # before the export's minutes, not after
    bundle = load_bundle(source, device=resolve_device(cfg.device))
    if _onnx_format(cfg):
        # heavy: the ONNX exporter (torch.onnx) is imported only for an ONNX folder
        from vitattn.bundle.onnx_export import export_onnx

        out = export_onnx(bundle, cfg.out, quantize=cfg.quantize, merge_tokens=cfg.merge_tokens)
        merging = "" if cfg.merge_tokens is None else f", merge_tokens={cfg.merge_tokens}"
        what = f"{bundle.task} ONNX folder ({cfg.quantize or 'fp32'}{merging})"
    else:
        out = save_bundle(
            cfg.out,
            bundle.model,
            task=bundle.task,
            preprocess=bundle.preprocess,
            vocab=bundle.vocab,
            class_names=bundle.class_names,
            generate=bundle.generate,
        )
        what = f"{bundle.task} bundle"
    if cfg.format == "hub":
        _write_card(cfg, bundle, source, Path(out))
        what = f"Hub folder ({what} + {CARD_FILE})"
    print(f"{what} of {source} -> {out}", flush=True)
    if cfg.push_to_hub is not None:
        print(f"uploaded to {push_folder(Path(out), cfg.push_to_hub)}", flush=True)
    return 0


def _write_card(cfg: Any, bundle: Any, source: str | Path, out: Path) -> None:
    """The model card of the Hub folder ``out``, from the run ``source`` came from (none for a Hub model)."""
    from vitattn.bundle.card import CARD_FILE, model_card
    from vitattn.bundle.hub import is_hub_name

    run = None if is_hub_name(cfg.model) else RunDir.find(source)
    card = model_card(
        bundle,
        cfg.push_to_hub or "ORG/NAME",
        run,
        license=cfg.license,
        datasets=[d.strip() for d in (cfg.datasets or "").split(",") if d.strip()],
        onnx=_onnx_format(cfg) is not None,
    )
    card.save(out / CARD_FILE)


def main(argv: list[str] | None = None) -> int:
    return run_main(__doc__, argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
