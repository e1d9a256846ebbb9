"""``vitattn-export``: write a model as a bundle folder (safetensors + config.json + its tokenizer), or as an
ONNX folder for ONNX Runtime.

    vitattn-export model=PATH out=DIR [which=best|last] [device=cpu] [format=bundle|onnx] [quantize=int8]

``model`` is a training run folder (``which``: its best or last checkpoint; else its own bundle), a ``.ckpt``
(never unpickled) or a bundle. ``format=onnx`` (the ``onnx`` extra) writes what ``vitattn-caption``,
``vitattn-serve`` and ``Captioner.load`` run on ONNX Runtime; ``quantize=int8`` quantizes it. The folder is
written atomically. Exit status: 0 on success, 2 on a usage or model error. More: docs/serving.md.
"""

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


def parse_args(argv: list[str]) -> Any:
    """``key=value`` arguments -> a validated ``ExportConfig``."""
    cfg = parse_key_values(argv, ExportConfig, "vitattn-export")
    if cfg.which not in (None, "best", "last"):
        raise UsageError(f"which={cfg.which!r} is unknown; choose which=best or which=last")
    if cfg.format not in ("bundle", "onnx"):
        raise UsageError(f"format={cfg.format!r} is unknown; choose format=bundle or format=onnx")
    if cfg.quantize not in (None, "int8"):
        raise UsageError(f"quantize={cfg.quantize!r} is unknown; choose quantize=int8 or leave it out")
    if cfg.quantize is not None and cfg.format != "onnx":
        raise UsageError("quantize=int8 needs format=onnx")
    return cfg


def run(cfg: Any) -> int:
    """Load ``cfg.model`` and save it as a bundle at ``cfg.out``."""
    from vitattn.bundle import load_bundle, save_bundle
    from vitattn.bundle.onnx_folder import is_onnx_folder

    source = cfg.model
    if cfg.which is not None:
        run = RunDir(cfg.model)
        if not run.checkpoints.is_dir():
            raise UsageError(f"which={cfg.which} needs a training run folder; model={cfg.model} is not one")
        source = run.best_checkpoint if cfg.which == "best" else run.last_checkpoint
        if not source.is_file():
            raise FileNotFoundError(f"model={cfg.model} has no {source.relative_to(run.path)}")
    if is_onnx_folder(Path(source)):
        raise UsageError(
            f"model={cfg.model} is an ONNX folder, which cannot be exported again; export the bundle or run folder "
            "it came from"
        )
    bundle = load_bundle(source, device=resolve_device(cfg.device))
    if cfg.format == "onnx":
        # heavy: the ONNX exporter (torch.onnx) is imported only for format=onnx
        from vitattn.bundle.onnx_export import export_onnx
        from vitattn.bundle.onnx_folder import require_onnxruntime

        require_onnxruntime(export=True)  # before the export's minutes, not after
        out = export_onnx(bundle, cfg.out, quantize=cfg.quantize)
        print(f"{bundle.task} ONNX folder ({cfg.quantize or 'fp32'}) of {source} -> {out}", flush=True)
        return 0
    out = save_bundle(
        cfg.out,
        bundle.model,
        task=bundle.task,
        preprocess=bundle.preprocess,
        vocab=bundle.vocab,
        class_names=bundle.class_names,
        generate=bundle.generate,
    )
    print(f"{bundle.task} bundle of {source} -> {out}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(__doc__, argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
