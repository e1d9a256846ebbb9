"""What the ``key=value`` entry points share: parsing into a dataclass schema, the device, and ``main``'s
one-line errors (exit status 2)."""

from __future__ import annotations

import difflib
import logging
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from vitattn.cli.errors import USER_ERRORS, quiet_upstream, report_user_error
from vitattn.errors import brief, first_line

__all__ = ["DecodingArgs", "UsageError", "parse_key_values", "resolve_device", "run_main"]


# Counts that the entry points share, and their least values.
_AT_LEAST_ONE = ("batch_size", "num_threads", "devices", "num_nodes", "workers_per_device", "max_batch_size")
_COUNTS = {"num_workers": 0, "max_image_bytes": 1, **dict.fromkeys(_AT_LEAST_ONE, 1)}


class UsageError(ValueError):
    """A bad command line."""


@dataclass
class DecodingArgs:
    """The decoding arguments (``SEARCH_KEYS``) of the entry points that caption; None: the bundle's default."""

    num_beams: int | None = None
    max_new_tokens: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None  # Hugging Face's: true, false or never
    min_new_tokens: int | None = None  # Hugging Face's decoding controls
    no_repeat_ngram_size: int | None = None
    repetition_penalty: float | None = None
    rerank: int | None = None  # N > 1: of N captions, the one nearest the image (head=coca)


def parse_key_values(argv: Sequence[str], schema: type, prog: str) -> Any:
    """``key=value`` arguments -> a structured config of the dataclass ``schema``, values taken literally (a glob
    is not YAML; ``null`` clears an option); a ``UsageError`` names a bad or missing argument, with the closest key."""
    known = [f.name for f in fields(schema)]
    given: dict[str, Any] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+")
        if not sep or not key:
            raise UsageError(f"argument {arg!r} is not key=value; see {prog} --help")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
            raise UsageError(f"unknown key {key!r}{hint}")
        given[key] = None if value.lower() in ("null", "none", "~") else value
    cfg = OmegaConf.structured(schema)
    try:
        for key, value in given.items():
            cfg[key] = _literal(value)
            cfg[key]  # read back: a typed field checks a value holding ``${`` only when it is read
    except OmegaConfBaseException as err:
        raise UsageError(f"{key}={brief(given[key])}: {first_line(err, limit=1000)}") from None
    required = {f.name for f in fields(schema) if f.default == MISSING}
    missing = sorted(OmegaConf.missing_keys(cfg) | {k for k in required if given.get(k) == ""})  # model= too
    if missing:
        raise UsageError(f"missing {', '.join(f'{k}=...' for k in missing)}; see {prog} --help")
    if "device" in cfg and cfg.device not in ("auto", "cpu", "cuda") and not str(cfg.device).startswith("cuda:"):
        raise UsageError(f"device={cfg.device!r} is unknown; choose auto, cpu, cuda or cuda:N")
    if cfg.get("merge_tokens") is not None:
        cfg.merge_tokens = _merge_tokens(str(cfg.merge_tokens))
    for key, least in _COUNTS.items():
        if isinstance(cfg.get(key), int) and cfg[key] < least:  # serve's devices may be auto
            raise UsageError(f"{key}={cfg[key]} must be at least {least}")
    return cfg


def _merge_tokens(value: str) -> int | list[int]:
    """``merge_tokens=8`` or ``merge_tokens=[8,8,4,4]`` (one count per encoder layer); how many a model can merge
    is the model's to check, as it loads."""
    text = value.replace(" ", "")
    if re.fullmatch(r"\d+", text):
        return int(text)
    if re.fullmatch(r"\[\d+(,\d+)*\]", text):
        return [int(r) for r in text[1:-1].split(",")]
    raise UsageError(
        f"merge_tokens={brief(value)} must be the tokens each encoder layer merges (ToMe), a whole number (0: off) "
        "or one per layer as [8,8,4,4]"
    )


def _literal(value: str | None) -> str | None:
    """``value`` escaped so that OmegaConf keeps it as written: ``${...}`` is not an interpolation."""
    if value is None:
        return None
    return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``; a CUDA device without CUDA is refused."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"device={name} but CUDA is not available; use device=cpu or device=auto")
    return name


def run_main(doc: str, argv: Sequence[str] | None, parse: Callable[[list[str]], Any], run: Callable[[Any], int]) -> int:
    """A console entry point over ``argv`` (default ``sys.argv[1:]``): ``--help`` prints ``doc``; a user error
    prints ``error: <one line>`` on stderr, exit status 2; else ``run(parse(argv))``'s status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        print(doc.strip())
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    quiet_upstream()
    try:
        return run(parse(argv))
    except USER_ERRORS as err:
        return report_user_error(err)
