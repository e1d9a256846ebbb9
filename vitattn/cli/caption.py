"""``vitattn-caption``: caption image files with a trained model.

Usage::

    vitattn-caption model=PATH images=INPUT out=FILE [image_dir=DIR] [format=jsonl|coco|csv]
        [batch_size=32] [num_workers=2] [num_beams=N] [max_new_tokens=N] [length_penalty=X]
        [do_sample=true temperature=X top_k=N top_p=X] [seed=N] [device=auto|cpu|cuda]
        [attention_maps=DIR] [progress=true]

``model`` is a bundle folder, a training run folder or a ``.ckpt``; ``images`` a folder, a glob, a
text file of paths or a COCO JSON file. Decoding settings left out come from the bundle. Running
the same command again captions only the images not yet in ``out``. Exit status: 0 when every image
was captioned, 1 when some could not be read, 2 on a usage or model error.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import sys
from dataclasses import dataclass, fields
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

log = logging.getLogger("vitattn")

_GENERATE_KEYS = ("num_beams", "max_new_tokens", "length_penalty", "do_sample", "temperature", "top_k", "top_p")


@dataclass
class CaptionConfig:
    """``vitattn-caption`` arguments; decoding ones left None take the bundle's defaults."""

    model: str = MISSING
    images: str = MISSING
    out: str = MISSING
    image_dir: Optional[str] = None
    format: str = "jsonl"
    batch_size: int = 32
    num_workers: int = 2
    num_beams: Optional[int] = None
    max_new_tokens: Optional[int] = None
    length_penalty: Optional[float] = None
    do_sample: Optional[bool] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    device: str = "auto"
    attention_maps: Optional[str] = None
    progress: bool = True


class UsageError(ValueError):
    """A bad command line."""


def parse_args(argv: list[str]) -> Any:
    """``key=value`` arguments -> a validated ``CaptionConfig`` (an OmegaConf structured config).

    Values are taken literally (a glob such as ``images=*.jpg`` is not YAML); ``null`` clears an option.
    """
    known = [f.name for f in fields(CaptionConfig)]
    given: dict[str, Any] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+")
        if not sep or not key:
            raise UsageError(f"argument {arg!r} is not key=value; see vitattn-caption --help")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
            raise UsageError(f"unknown key {key!r}{hint}")
        given[key] = None if value.lower() in ("null", "none", "~") else value
    cfg = OmegaConf.structured(CaptionConfig)
    try:
        for key, value in given.items():
            cfg[key] = value  # converted and checked against the field's type
    except OmegaConfBaseException as err:
        raise UsageError(f"{key}={given[key]!r}: {str(err).splitlines()[0]}") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UsageError(f"missing {', '.join(f'{k}=...' for k in missing)}; see vitattn-caption --help")
    if cfg.format not in ("jsonl", "coco", "csv"):
        raise UsageError(f"format={cfg.format!r} is unknown; choose jsonl, coco or csv")
    if cfg.device not in ("auto", "cpu", "cuda") and not cfg.device.startswith("cuda:"):
        raise UsageError(f"device={cfg.device!r} is unknown; choose auto, cpu, cuda or cuda:N")
    return cfg


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"device={name} but CUDA is not available; use device=cpu or device=auto")
    return name


def run(cfg: Any) -> int:
    """Caption as ``cfg`` says; returns the exit status (0 all captioned, 1 some failed)."""
    import torch

    from vitattn.bundle import load_bundle
    from vitattn.inference.captioner import caption_to_file, list_inputs

    device = _device(cfg.device)
    bundle = load_bundle(cfg.model, device=device)
    if bundle.task != "caption":
        raise UsageError(f"model={cfg.model} is a {bundle.task} model; vitattn-caption needs a caption model")
    accepted = inspect.signature(bundle.model.generate).parameters
    generate = {k: v for k, v in bundle.generate.items() if k in accepted}
    if len(generate) < len(bundle.generate):
        log.warning("ignoring the bundle's unknown decoding settings %s", sorted(set(bundle.generate) - set(generate)))
    generate.update({k: cfg[k] for k in _GENERATE_KEYS if cfg[k] is not None})
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
        generate["generator"] = torch.Generator(device=device).manual_seed(cfg.seed)
    inputs = list_inputs(cfg.images, cfg.image_dir)
    log.info("captioning %d images with %s on %s", len(inputs), cfg.model, device)
    summary = caption_to_file(
        bundle,
        inputs,
        cfg.out,
        format=cfg.format,
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        progress=cfg.progress,
        attention_maps=cfg.attention_maps,
        **generate,
    )
    print(f"captioned {summary.captioned} images, {summary.failed} failed -> {summary.out}", flush=True)
    return 1 if summary.failed else 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point; ``argv`` defaults to ``sys.argv[1:]``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        print(__doc__.strip())
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return run(parse_args(argv))
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, FileExistsError) as err:
        text = str(err).strip()
        print(f"error: {text.splitlines()[0] if text else type(err).__name__}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
