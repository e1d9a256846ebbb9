"""Captioning many files: a killed ``vitattn-caption`` resumes with each image once, memory does not
grow with the number of images, and the helpers of benchmarks/processes.py measure what they say."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
import weakref
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from tests.helpers.processes import RecordCounter, process_tree, rss_kib, scan_processes, write_images
from tests.helpers.runs import console_script
from vitattn.bundle import load_bundle
from vitattn.inference import caption_files, list_inputs


def _live(pids) -> list[int]:
    """The ``pids`` still running (a killed child that nobody has reaped yet is a zombie: not running)."""
    running = scan_processes()
    return [p for p in pids if p in running]


@pytest.mark.slow
def test_killed_caption_run_resumes_with_each_image_once(bundle_dir, tmp_path):
    script = console_script("vitattn-caption")
    folder = write_images(tmp_path / "imgs", 300, img_size=48)
    # A FIFO listed last: its reader blocks until killed, so however fast this machine captions,
    # the first run cannot finish before the kill.
    stall = folder / "zzz_stall.jpg"
    os.mkfifo(stall)
    out = tmp_path / "captions.jsonl"
    cmd = [
        str(script),
        f"model={bundle_dir}",
        f"images={folder}",
        f"out={out}",
        "batch_size=8",
        "num_workers=2",
        "device=cpu",
        "progress=false",
    ]
    count = RecordCounter(out)  # the records of the finished chunks (64 images each)
    with open(tmp_path / "first.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while proc.poll() is None and count() < 8 and time.monotonic() < deadline:
                time.sleep(0.005)
            tree = process_tree(proc.pid)  # the CLI and its DataLoader workers
            os.killpg(proc.pid, signal.SIGKILL)  # its own process group: the workers die with it
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    assert len(tree) == 3, f"expected the CLI and 2 workers, found {tree}"
    deadline = time.monotonic() + 10
    while _live(tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _live(tree), f"processes of the killed run still alive: {_live(tree)}"

    parts = tmp_path / "captions.jsonl.parts"
    chunks = {p.name: p.read_bytes() for p in parts.glob("*.jsonl")}  # whole files: a killed one left a temporary
    first = [json.loads(line) for data in chunks.values() for line in data.decode().splitlines()]
    assert 64 <= len(first) < 301 and len(first) % 64 == 0 and not out.exists(), len(first)
    assert all(r["caption"] and r["image"].startswith(str(folder)) for r in first)
    print(f"killed with {len(first)} of 301 records written in {len(chunks)} chunks")

    stall.unlink()
    Image.new("RGB", (48, 48), (40, 90, 215)).save(stall)  # the same name, now a real image
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{len(first)} of 301 images are already captioned" in again.stderr  # kept, not redone
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["image"]: r for r in records if r["image"] in {f["image"] for f in first}} == {
        f["image"]: f for f in first
    }
    counts = Counter(r["image"] for r in records)
    assert set(counts) == {x.path for x in list_inputs(folder)} and set(counts.values()) == {1}
    assert all(r.get("caption") and "error" not in r for r in records)
    assert again.stdout.strip().splitlines()[-1] == f"captioned 301 images, 0 failed -> {out}"


@pytest.mark.slow
def test_caption_files_memory_does_not_grow_with_the_number_of_images(bundle_dir, tmp_path, monkeypatch):
    bundle = load_bundle(bundle_dir)
    rng = np.random.default_rng(0)
    for i in range(800):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(tmp_path / f"img_{i:04d}.png")
    inputs = list_inputs(tmp_path)
    refs: list[weakref.ref] = []  # each batch's images and tokens
    generate = bundle.model.generate

    def watched(images, **kwargs):
        # the caller may still hold the batch before this one; any older one must be gone by now
        held = [i // 2 for i, r in enumerate(refs[:-2]) if r() is not None]
        assert not held, f"batches {sorted(set(held))} are still in memory when batch {len(refs) // 2} starts"
        tokens = generate(images, **kwargs)
        refs.extend([weakref.ref(images), weakref.ref(tokens)])
        return tokens

    monkeypatch.setattr(bundle.model, "generate", watched)
    peaks = {}
    for n in (200, 800):
        refs.clear()
        tracemalloc.start()
        try:
            summary = caption_files(
                bundle, inputs[:n], tmp_path / f"out{n}.jsonl", batch_size=16, num_workers=0, progress=False
            )
            peaks[n] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert summary.captioned == n and len(refs) == 2 * -(-n // 16)
        assert not [r for r in refs if r() is not None]  # no tensor outlives the run
    # Python memory (numpy arrays included) that grows with the run: the records, a few hundred
    # bytes per image (~300 measured). One 16x16 RGB image kept per image would add 768 bytes.
    per_image = (peaks[800] - peaks[200]) / 600
    assert per_image < 700, f"peak Python memory grows by {per_image:.0f} bytes per image"


def test_record_counter_counts_the_records_of_finished_chunks(tmp_path):
    out = tmp_path / "out.jsonl"
    count = RecordCounter(out)
    assert count() == 0  # nothing written yet
    (tmp_path / "out.jsonl.parts").mkdir()
    (tmp_path / "out.jsonl.parts" / "000000-a.jsonl").write_bytes(b'{"a": 1}\n{"b": 2}\n')
    (tmp_path / "out.jsonl.parts" / ".000001-b.jsonl.x.tmp").write_bytes(b'{"c": 3}\n')  # not finished
    assert count() == 2
    (tmp_path / "out.jsonl.parts" / "000001-b.jsonl").write_bytes(b'{"c": 3}\n')
    assert count() == 3
    shutil.rmtree(tmp_path / "out.jsonl.parts")  # merged: the chunks are gone, out holds them
    out.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": 3}\n')
    assert count() == 3


def test_process_tree_finds_a_child_and_its_child():
    grandchild = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])"
    child = subprocess.Popen([sys.executable, "-c", grandchild], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(process_tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = process_tree(child.pid)
        assert tree[0] == child.pid and len(tree) == 2
        assert all(rss_kib(p) > 0 for p in tree)
        assert os.getpid() in process_tree(os.getppid())
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
