"""Section ``processes``: ``vitattn-caption`` on one process vs several (DDP), the same image files.

On the CPU: 2 processes x 1 thread vs 1 process x 1 thread; on CUDA: every GPU of the machine vs one.
Each run is the console command in a subprocess; its rate is timed from the complete lines of its
output files between 10 % and 90 % of the images, so start-up (imports, model load, process
launch) and the final merge are left out (they are reported apart). The CPU time each run got,
over its wall time, is reported beside it: on a shared machine that gives this job a fixed share of
the cores, 2 processes get no more CPU than 1, and the ratio says so rather than how the code scales.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.env import Env
from benchmarks.report import row
from vitattn.bundle import save_bundle
from vitattn.data import Vocabulary, default_preprocess
from vitattn.data.shapes import generate_scene, render_scene, scene_caption
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer

__all__ = ["bench_processes", "caption_command", "time_caption_run", "tiny_bundle", "write_images"]


def write_images(folder: Path, n: int, img_size: int = 64, seed: int = 0) -> Path:
    """``n`` JPEGs of shape scenes, ``img_000000.jpg`` ...; a folder that already holds them is reused."""
    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("img_*.jpg"))) == n:
        return folder
    for i in range(n):
        render_scene(generate_scene(seed, "test", i), img_size).save(folder / f"img_{i:06d}.jpg", quality=90)
    return folder


def tiny_bundle(directory: Path, img_size: int = 32, embed_dim: int = 32, depth: int = 2) -> Path:
    """A random captioner (``img_size`` px, 8 px patches, ``embed_dim`` wide, ``depth`` encoder layers, a
    2-layer decoder, captions up to 16 tokens) saved as a bundle; default: the smallest that runs."""
    torch.manual_seed(0)
    vocab = Vocabulary.build(scene_caption(generate_scene(0, "train", i)) for i in range(500))
    heads = max(2, embed_dim // 32)
    encoder = VisionTransformer(
        img_size=img_size, patch_size=8, embed_dim=embed_dim, depth=depth, num_heads=heads, mlp_ratio=2.0
    )
    decoder = CaptionDecoder(len(vocab), embed_dim=embed_dim, depth=2, num_heads=heads, mlp_ratio=2.0, max_len=16)
    model = ImageCaptioner(encoder, decoder).eval()
    return save_bundle(directory, model, task="caption", preprocess=default_preprocess(img_size), vocab=vocab)


class RecordCounter:
    """Records a ``vitattn-caption`` run has written into ``out`` so far: the lines of its finished chunks
    (``OUT.parts/``, each counted once, as the folder goes at the merge), or of ``out`` once merged."""

    def __init__(self, out: Path) -> None:
        self.out, self.seen = Path(out), {}

    def __call__(self) -> int:
        try:
            for path in self.out.with_name(self.out.name + ".parts").glob("*.jsonl"):
                if path.name not in self.seen:
                    self.seen[path.name] = path.read_bytes().count(b"\n")
        except OSError:  # the folder, or a chunk, removed by the merge meanwhile
            pass
        merged = self.out.read_bytes().count(b"\n") if self.out.is_file() else 0
        return max(sum(self.seen.values()), merged)

    def close(self) -> None:
        pass


def caption_command() -> list[str]:
    """The installed ``vitattn-caption``, else the module run by this interpreter."""
    script = Path(sys.executable).with_name("vitattn-caption")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "vitattn.cli.caption"]


def time_caption_run(
    args: Sequence[str], out: Path, n: int, devices: int, timeout: float = 1800, interval: float = 0.05
) -> dict[str, Any]:
    """Run ``vitattn-caption ARGS out=OUT devices=DEVICES`` and time it from its output's growth.

    Returns:
        ``images_per_s`` (10 % -> 90 % of the ``n`` records), ``startup_s`` (to the first record),
        ``total_s`` (the whole command, merge included), ``cores`` (CPU seconds of the command and
        all its processes over ``total_s``: what the machine gave it) and the command.
    """
    counters = [RecordCounter(out)]
    cmd = [*caption_command(), *args, f"out={out}", f"devices={devices}", "progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    marks: dict[float, float] = {}
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                done = proc.poll() is not None  # one more look after the exit: the parts stay readable
                t, lines = time.perf_counter() - start, sum(c() for c in counters)
                for f in (0.0, 0.1, 0.9):
                    if f not in marks and lines > f * n:
                        marks[f] = t
                if done:
                    break
                if t > timeout:
                    raise TimeoutError(f"{' '.join(cmd)} ran past {timeout:.0f} s")
                time.sleep(interval)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for c in counters:
                c.close()
        total = time.perf_counter() - start
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process of the run has been waited for
        if proc.returncode != 0:
            log.seek(0)
            raise RuntimeError(
                f"{' '.join(cmd)} exited {proc.returncode}: {log.read()[-2000:].decode(errors='replace')}"
            )
    if 0.1 not in marks or 0.9 not in marks or marks[0.9] <= marks[0.1]:
        raise RuntimeError(f"the run was too fast to time at {interval} s intervals; use more images")
    return dict(
        command=cmd,
        images_per_s=round(0.8 * n / (marks[0.9] - marks[0.1]), 2),
        startup_s=round(marks[0.0], 2),
        total_s=round(total, 2),
        cores=round((cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / total, 2),
    )


def bench_processes(env: Env, n_images: int = 2000, workdir: Path | None = None) -> tuple[list[dict], dict[str, Any]]:
    """Row: images/s of ``vitattn-caption devices=K`` over ``devices=1`` on the same ``n_images`` files.

    K is 2 on the CPU (each process ``num_threads=1``) and every GPU on CUDA. The model is a random
    captioner of the default CPU model's size (64 px, width 128, 4 encoder layers, 2 decoder layers).
    """
    devices = torch.cuda.device_count() if env.cuda else 2
    with tempfile.TemporaryDirectory(prefix="bench_processes-", dir=workdir) as tmp:
        root = Path(tmp)
        folder = write_images(root / "images", n_images, img_size=64)
        bundle = tiny_bundle(root / "bundle", img_size=64, embed_dim=128, depth=4)
        args = [f"model={bundle}", f"images={folder}", "batch_size=32", "num_workers=0"]
        args += ["accelerator=gpu", "device=cuda"] if env.cuda else ["accelerator=cpu", "device=cpu", "num_threads=1"]
        runs = {k: time_caption_run(args, root / f"out{k}.jsonl", n_images, k) for k in (1, devices)}
    one, many = runs[1]["images_per_s"], runs[devices]["images_per_s"]
    unit = "GPUs" if env.cuda else "processes x 1 thread"
    name = f"caption files: {devices} {unit} vs 1 ({n_images} images)"
    note = (
        f"start-up {runs[1]['startup_s']:.0f} s / {runs[devices]['startup_s']:.0f} s, excluded;"
        f" cores used {runs[1]['cores']:.2f} / {runs[devices]['cores']:.2f}"
    )
    return [row(name, many, one, "img/s", many / one, "processes", ref_name="1 process", note=note)], dict(
        devices=devices, n_images=n_images, runs=runs
    )
