"""``vitattn-serve``: caption images over HTTP (LitServe), requests batched across clients.

    vitattn-serve model=PATH [port=8000] [host=127.0.0.1|0.0.0.0|::] [accelerator=auto|cpu|cuda]
        [devices=auto|N] [workers_per_device=1] [max_batch_size=8] [batch_timeout=0.05] [timeout=60]
        [max_image_bytes=20000000] [num_beams=N] [max_new_tokens=N] [length_penalty=X]
        [early_stopping=true|false|never] [min_new_tokens=N] [no_repeat_ngram_size=N] [repetition_penalty=X] [rerank=N]
        [num_threads=N] [precision=auto|fp32|bf16] [merge_tokens=R|[R,...]] (ToMe: tokens merged in each encoder layer)

``POST /predict`` an image -> {"caption", "tokens"}; a head=coca model also ``POST /embed`` an image or {"text"} /
{"texts"} -> embeddings and ``POST /classify`` an image and labels -> probabilities (404 on other models); ``GET
/health``; ``GET /``, a page. SIGTERM or SIGINT drains the requests in flight, then it exits. docs/serving.md."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from vitattn.cli.args import DecodingArgs, UsageError, parse_key_values, run_main

__all__ = ["ServeConfig", "main", "parse_args", "run"]

log = logging.getLogger("vitattn")

HOSTS = ("127.0.0.1", "0.0.0.0", "::")


@dataclass
class ServeConfig(DecodingArgs):
    """``vitattn-serve`` arguments; decoding ones (``DecodingArgs``) left None take the bundle's defaults."""

    model: str = MISSING
    port: int = 8000
    host: str = "127.0.0.1"
    accelerator: str = "auto"
    devices: str = "auto"
    workers_per_device: int = 1
    max_batch_size: int = 8
    batch_timeout: float = 0.05
    max_image_bytes: int = 20_000_000
    timeout: float = 60.0
    num_threads: int | None = None
    precision: str = "auto"  # auto, fp32 or bf16 (vitattn.precision)
    merge_tokens: Any = None  # ToMe: an int, or a list of one per encoder layer; None: the model's own


def parse_args(argv: list[str]) -> Any:
    """``key=value`` arguments -> a validated ``ServeConfig``."""
    cfg = parse_key_values(argv, ServeConfig, "vitattn-serve")
    if not 1024 <= cfg.port <= 65535:
        raise UsageError(f"port={cfg.port} must be from 1024 to 65535")
    if cfg.host not in HOSTS:
        raise UsageError(f"host={cfg.host!r} is not one LitServe binds; choose {', '.join(HOSTS)}")
    if cfg.accelerator not in ("auto", "cpu", "cuda"):
        raise UsageError(f"accelerator={cfg.accelerator!r} is unknown; choose auto, cpu or cuda")
    if cfg.devices != "auto" and not (cfg.devices.isdigit() and int(cfg.devices) >= 1):
        raise UsageError(f"devices={cfg.devices!r} must be auto or a number of GPUs (1 or more)")
    if cfg.batch_timeout < 0 or cfg.batch_timeout >= cfg.timeout:
        raise UsageError(f"batch_timeout={cfg.batch_timeout} must be from 0 to less than timeout={cfg.timeout}")
    return cfg


def run(cfg: Any) -> int:
    """Load the model once here (a bad model fails now, in one line), then serve until SIGTERM or SIGINT."""
    from vitattn.bundle import load_model
    from vitattn.serve import CaptionAPI, GracefulStop, build_server, serving_apis

    bundle = load_model(cfg.model, device="cpu", precision=cfg.precision, merge_tokens=cfg.merge_tokens)
    if bundle.task != "caption":
        raise UsageError(f"model={cfg.model} is a {bundle.task} model; vitattn-serve needs a caption model")
    generate = bundle.generate_settings(cfg)
    api = CaptionAPI(
        cfg.model,
        generate=generate,
        max_image_bytes=cfg.max_image_bytes,
        num_threads=cfg.num_threads,
        precision=cfg.precision,
        merge_tokens=cfg.merge_tokens,
        max_batch_size=cfg.max_batch_size,
        batch_timeout=cfg.batch_timeout,
    )
    apis, refused = serving_apis(api, bundle)
    del bundle  # each inference worker loads its own copy on its device
    stop = GracefulStop(timeout=cfg.timeout)
    server = build_server(
        apis,
        refused=refused,
        accelerator=cfg.accelerator,
        devices=int(cfg.devices) if cfg.devices.isdigit() else "auto",
        workers_per_device=cfg.workers_per_device,
        timeout=cfg.timeout,
        stop=stop,
    )
    routes = ", ".join(f"POST {a.api_path}" for a in apis)
    log.info("serving %s on http://%s:%d (%s, GET /health, GET /)", cfg.model, cfg.host, cfg.port, routes)
    stop.serve(server, host=cfg.host, port=cfg.port, generate_client_file=False, log_level="warning")
    log.info("stopped: every server process has exited")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(__doc__, argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
