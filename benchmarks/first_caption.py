"""A first caption in a second: the wall time of ``vitattn-caption`` on 5 images over that of
``python -c "import torch, torchvision"``, and the same for the Python API, each a fresh process.

    python -m benchmarks.first_caption [--repeats 9] [--images 5] [--threads 1] [--out FILE.json]

A random captioner of ``model=cpu``'s size saved as a bundle, JPEGs of the built-in shapes, the installed
console script with its defaults, ``OMP_NUM_THREADS=--threads`` (docs/benchmarks.md, "Why one thread"). The
commands alternate within each repeat (the order reversed every other one); a row is the median wall time,
the ratio, its range over repeats, and the CPU-seconds ratio. Target: ratio <= 1.3.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.processes import caption_command, tiny_bundle, write_images

__all__ = ["TARGET", "first_caption", "format_rows", "main"]

TARGET = 1.3  # vitattn-caption wall time / the torch + torchvision import's, at most
IMPORT_TORCH = [sys.executable, "-c", "import torch, torchvision"]
LABELS = {
    "caption": "vitattn-caption, this install",
    "api": "Captioner API, this install",
}
# The API as a program uses it, in a fresh process: argv[1] the bundle, then the image files.
API_SCRIPT = (
    "import sys\n"
    "from vitattn import Captioner\n"
    "captions = Captioner.load(sys.argv[1]).caption(sys.argv[2:])\n"
    "assert len(captions) == len(sys.argv) - 2 and all(captions), captions\n"
)


def _run(cmd: Sequence[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and its children) of ``cmd``, which must succeed."""
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return wall, cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime


def first_caption(repeats: int = 9, n_images: int = 5, threads: int = 1) -> dict:
    """Time the commands ``repeats`` times, interleaved; returns every sample, the medians and the ratios."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory(prefix="first_caption-") as tmp:
        root = Path(tmp)
        images = write_images(root / "images", n_images, img_size=64)
        bundle = tiny_bundle(root / "bundle", img_size=64, embed_dim=128, depth=4)
        out = root / "captions.jsonl"
        caption = [*caption_command(), f"model={bundle}", f"images={images}", f"out={out}"]
        api = [sys.executable, "-c", API_SCRIPT, str(bundle), *map(str, sorted(images.glob("*.jpg")))]
        commands = {"import": (IMPORT_TORCH, env), "caption": (caption, env), "api": (api, env)}
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        _run(IMPORT_TORCH, env)  # warm the file cache: the first run of a session reads torch from disk
        for r in range(repeats):
            for name in list(commands) if r % 2 == 0 else list(reversed(commands)):
                out.unlink(missing_ok=True)
                samples[name].append(_run(*commands[name]))
    wall = {name: [w for w, _ in s] for name, s in samples.items()}
    cpu = {name: [c for _, c in s] for name, s in samples.items()}
    rows = {}
    for name in commands:
        if name == "import":
            continue
        per_repeat = [c / i for c, i in zip(wall[name], wall["import"])]
        rows[name] = dict(
            median_wall_s=statistics.median(wall[name]),
            ratio=statistics.median(wall[name]) / statistics.median(wall["import"]),
            ratio_range=[min(per_repeat), max(per_repeat)],
            cpu_ratio=statistics.median(cpu[name]) / statistics.median(cpu["import"]),
        )
    return dict(
        commands={name: " ".join(cmd) for name, (cmd, _) in commands.items()},
        n_images=n_images,
        threads=threads,
        repeats=repeats,
        wall_s=wall,
        cpu_s=cpu,
        import_median_wall_s=statistics.median(wall["import"]),
        rows=rows,
        target=TARGET,
    )


def format_rows(result: dict) -> list[str]:
    """The Markdown rows of docs/benchmarks.md."""
    lines = []
    for name, r in result["rows"].items():
        lo, hi = r["ratio_range"]
        status = "PASS" if r["ratio"] <= result["target"] else "MISS"
        lines.append(
            f"| first caption: {LABELS[name]}, {result['n_images']} images, model=cpu size | "
            f"{r['median_wall_s']:.2f} s | {result['import_median_wall_s']:.2f} s (import torch, torchvision) | "
            f"{r['ratio']:.2f}x | <= {result['target']}x | {status} | per repeat {lo:.2f}-{hi:.2f}x over "
            f"{result['repeats']} repeats; CPU seconds {r['cpu_ratio']:.2f}x; OMP_NUM_THREADS={result['threads']} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_caption", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=9, help="interleaved runs of each command (default 9)")
    p.add_argument("--images", type=int, default=5, help="images to caption (default 5)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every command (default 1)")
    p.add_argument("--out", type=Path, default=None, help="write every sample as JSON here")
    args = p.parse_args(argv)
    if min(args.repeats, args.images, args.threads) < 1:
        p.error(f"--repeats={args.repeats}, --images={args.images} and --threads={args.threads} must be at least 1")
    result = first_caption(args.repeats, args.images, args.threads)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    print("\n".join(format_rows(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
