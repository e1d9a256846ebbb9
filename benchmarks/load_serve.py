"""A bounded load test of ``vitattn-serve`` on localhost: latency, throughput, status codes and memory.

Usage::

    python -m benchmarks.load_serve model=PATH [requests=1000] [clients=16] [bad_every=10] [warmup=32]
        [max_batch_size=8] [batch_timeout=0.05] [workers_per_device=1] [num_threads=N]
        [precision=auto|fp32|bf16] [time_limit=900] [out=FILE.json]

Starts ``vitattn-serve`` on a free port in its own process group, sends ``warmup`` requests (not
counted), then ``requests`` requests from ``clients`` concurrent clients, every ``bad_every``-th a bad
image (empty, not an image, corrupt, truncated, a decompression bomb, over the byte limit), half as
multipart uploads and half as base64 JSON. It checks that no answer is a 5xx, that every bad image gets
a 400 whose reason is the one ``vitattn-caption`` gives for the same file, and that the server's
resident memory (all its processes) is flat between the first and the last quarter of the requests.
Prints the figures and writes them as JSON to ``out``; exit status 1 when a check fails.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import MISSING
from PIL import Image

from benchmarks.machine import loadavg, machine_info, status_kib
from vitattn.cli.args import UsageError, parse_key_values, run_main
from vitattn.data import read_image
from vitattn.data.images import BadImageError
from vitattn.fileio import atomic_write

__all__ = ["LoadConfig", "main"]

MAX_IMAGE_BYTES = 1_000_000  # the server's byte limit during the test: the "too large" image is just over it
RSS_GROWTH_LIMIT = 0.10  # last quarter's median RSS over the first quarter's


def tree_rss_kib(root: int) -> int:
    """The summed ``VmRSS`` of ``root`` and its live descendants, in KiB (pages shared by forks counted per process)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        children.setdefault(status_kib("PPid", entry), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return sum(status_kib("VmRSS", pid) for pid in tree)


@dataclass
class LoadConfig:
    model: str = MISSING
    requests: int = 1000
    clients: int = 16
    bad_every: int = 10
    warmup: int = 32
    max_batch_size: int = 8
    batch_timeout: float = 0.05
    workers_per_device: int = 1
    num_threads: int | None = None
    precision: str = "auto"  # the server's precision= (vitattn.precision)
    time_limit: float = 900.0
    out: str | None = None


@dataclass
class Sample:
    index: int
    kind: str
    status: int
    seconds: float
    detail: str
    finished: float  # time.monotonic() at the answer


def _good_images(count: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """Photos-like test images of several sizes and formats."""
    rng = np.random.default_rng(seed)
    images = []
    for i in range(count):
        w, h = (int(x) for x in rng.integers(48, 480, 2))
        base = rng.integers(0, 256, 3)
        pixels = np.clip(base + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        fmt = ("JPEG", "PNG")[i % 2]
        Image.fromarray(pixels).save(buffer, format=fmt, **({"quality": 85} if fmt == "JPEG" else {}))
        images.append((f"good{i}.{fmt.lower()}", buffer.getvalue()))
    return images


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width x height`` pixels and holds none: a decompression bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def _bad_images(folder: Path) -> list[tuple[str, bytes, str]]:
    """``(name, bytes, expected reason)``; the reason is what ``vitattn-caption`` says of the same file."""
    noise = io.BytesIO()
    Image.effect_noise((640, 640), 60).convert("RGB").save(noise, format="PNG")
    whole = noise.getvalue()
    bad = {
        "empty.png": b"",
        "notes.jpg": b"this is not an image\n",
        "corrupt.jpg": b"\xff\xd8\xff\xe0" + np.random.default_rng(0).bytes(300),
        "truncated.png": whole[: len(whole) // 3],
        "bomb.png": _png_header(30_000, 30_000),
    }
    cases = []
    for name, data in bad.items():
        path = folder / name
        path.write_bytes(data)
        refused = read_image(path, on_error="skip")  # the reason vitattn-caption gives is the expectation
        if not isinstance(refused, BadImageError):
            raise AssertionError(f"{name} was expected to be unreadable")
        cases.append((name, data, refused.reason))
    assert len(whole) > MAX_IMAGE_BYTES, "the noise image must be over the byte limit"
    cases.append(("too_large.png", whole, f"image of {len(whole)} bytes is over the limit of max_image_bytes="))
    return cases


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """``vitattn-serve`` in its own process group; ended (the whole group) on exit."""

    def __init__(self, cfg: Any) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "vitattn.cli.serve", f"model={cfg.model}", f"port={self.port}"]
        command += [f"{k}={cfg[k]}" for k in ("max_batch_size", "batch_timeout", "workers_per_device", "precision")]
        command += [f"max_image_bytes={MAX_IMAGE_BYTES}"]
        if cfg.num_threads is not None:
            command.append(f"num_threads={cfg.num_threads}")
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(command, start_new_session=True, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, client: Any, limit: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < limit:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited: {self.log.read().decode(errors='replace')[-2000:]}")
            try:
                if client.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - started
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not healthy after {limit:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _send(client: Any, url: str, name: str, data: bytes, as_json: bool) -> Any:
    if as_json:
        return client.post(f"{url}/predict", json={"image": base64.b64encode(data).decode()}, timeout=120)
    return client.post(f"{url}/predict", files={"image": (name, data)}, timeout=120)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run(cfg: Any) -> int:
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

    for key in ("requests", "clients", "bad_every"):
        if cfg[key] < 1:
            raise UsageError(f"{key}={cfg[key]} must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        good = _good_images(24)
        bad = _bad_images(Path(tmp))
    jobs = []
    for i in range(cfg.requests):
        if i % cfg.bad_every == cfg.bad_every - 1:
            name, data, reason = bad[(i // cfg.bad_every) % len(bad)]
            jobs.append((i, "bad", name, data, reason))
        else:
            name, data = good[i % len(good)]
            jobs.append((i, "good", name, data, None))

    machine = machine_info(cfg.num_threads or 0)
    server = _Server(cfg)
    rss: list[tuple[float, int]] = []
    stop = threading.Event()
    try:
        with httpx.Client() as probe:
            startup = server.wait_healthy(probe, min(cfg.time_limit, 300))
            for i in range(cfg.warmup):
                name, data = good[i % len(good)]
                _send(probe, server.url, name, data, i % 2 == 1).raise_for_status()

        def sample_rss() -> None:  # every 0.25 s, and once more when the last request is answered
            while True:
                rss.append((time.monotonic(), tree_rss_kib(server.proc.pid) * 1024))
                if stop.is_set():
                    return
                stop.wait(0.25)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        deadline = time.monotonic() + cfg.time_limit
        local = threading.local()

        def one(job: tuple) -> Sample | None:
            i, kind, name, data, _ = job
            if time.monotonic() > deadline:
                return None
            if not hasattr(local, "client"):
                local.client = httpx.Client()
            started = time.monotonic()
            try:
                response = _send(local.client, server.url, name, data, i % 2 == 1)
                status, detail = response.status_code, response.text
            except httpx.HTTPError as err:
                status, detail = 0, f"{type(err).__name__}: {err}"
            now = time.monotonic()
            return Sample(i, kind, status, now - started, detail, now)

        started = time.monotonic()
        with ThreadPoolExecutor(cfg.clients) as pool:
            samples = [s for s in pool.map(one, jobs) if s is not None]
        wall = time.monotonic() - started
        stop.set()
        sampler.join()
    finally:
        stop.set()
        server.stop()

    report = {"machine": machine | {"loadavg_end": loadavg()}, **_report(cfg, jobs, samples, rss, wall, startup)}
    text = json.dumps(report, indent=1)
    print(text)
    if cfg.out:
        atomic_write(cfg.out, text + "\n")
    return 0 if report["passed"] else 1


def _report(cfg: Any, jobs: list, samples: list[Sample], rss: list, wall: float, startup: float) -> dict:
    expected = {i: reason for i, kind, _, _, reason in jobs if kind == "bad"}
    good = [s for s in samples if s.kind == "good"]
    bad = [s for s in samples if s.kind == "bad"]
    wrong_bad = [
        asdict(s)
        for s in bad
        if s.status != 400 or not json.loads(s.detail or "{}").get("detail", "").startswith(expected[s.index])
    ]
    failed_good = [asdict(s) for s in good if s.status != 200]
    server_errors = [asdict(s) for s in samples if s.status >= 500 or s.status == 0]
    ordered = sorted(samples, key=lambda s: s.finished)
    quarter = max(1, len(ordered) // 4)
    first_end, last_start = ordered[quarter - 1].finished, ordered[-quarter].finished
    first = [b for t, b in rss if t <= first_end]
    last = [b for t, b in rss if t >= last_start]
    rss_first = statistics.median(first) if first else float("nan")
    rss_last = statistics.median(last) if last else float("nan")
    growth = rss_last / rss_first - 1 if first and last else float("nan")
    latencies = [s.seconds for s in samples]
    checks = {
        "all_requests_answered": len(samples) == cfg.requests,
        "no_5xx": not server_errors,
        "every_good_image_200": not failed_good,
        "every_bad_image_400_with_its_reason": not wrong_bad,
        "rss_flat": bool(growth <= RSS_GROWTH_LIMIT),
    }
    ms = 1000.0
    return {
        "config": {k: cfg[k] for k in ("model", "requests", "clients", "bad_every", "warmup", "max_batch_size")}
        | {"batch_timeout": cfg.batch_timeout, "num_threads": cfg.num_threads, "precision": cfg.precision},
        "startup_seconds": round(startup, 1),
        "answered": len(samples),
        "good": len(good),
        "bad": len(bad),
        "wall_seconds": round(wall, 2),
        "throughput_rps": round(len(samples) / wall, 2) if wall > 0 else None,
        "latency_ms": {
            "p50": round(_percentile(latencies, 50) * ms, 1),
            "p90": round(_percentile(latencies, 90) * ms, 1),
            "p99": round(_percentile(latencies, 99) * ms, 1),
            "max": round(max(latencies, default=float("nan")) * ms, 1),
            "good_p50": round(_percentile([s.seconds for s in good], 50) * ms, 1),
            "bad_p50": round(_percentile([s.seconds for s in bad], 50) * ms, 1),
        },
        "status_counts": {str(k): sum(s.status == k for s in samples) for k in sorted({s.status for s in samples})},
        "rss_mb": {
            "first_quarter_median": round(rss_first / 2**20, 1),
            "last_quarter_median": round(rss_last / 2**20, 1),
            "growth": round(growth, 4),
            "samples": len(rss),
        },
        "checks": checks,
        "passed": all(checks.values()),
        "failures": {"server_errors": server_errors[:5], "good": failed_good[:5], "bad": wrong_bad[:5]},
    }


def parse_args(argv: list[str]) -> Any:
    return parse_key_values(argv, LoadConfig, "python -m benchmarks.load_serve")


def main(argv: list[str] | None = None) -> int:
    """Console entry point; ``argv`` defaults to ``sys.argv[1:]``."""
    return run_main(__doc__, argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
