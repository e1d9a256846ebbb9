"""Captioning image files in several processes: each rank its own chunks, rank 0 merging them in input
order, a run of one process resuming those of several, and a 2-process (gloo) run killed with SIGKILL and
resumed, each image exactly once."""

import csv
import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

import vitattn.inference.captioning as captioning
from tests.helpers.images import write_bad_images
from tests.helpers.processes import process_tree, scan_processes, write_images
from tests.helpers.runs import console_script
from vitattn.bundle import load_bundle
from vitattn.inference import caption_files, list_inputs
from vitattn.inference.captioning import Processes


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _lines(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


class _ThreadFabric:
    """Fabric's collectives for ranks that are threads of one process: ``broadcast`` hands rank 0's value to
    every rank, ``barrier`` waits for all."""

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank, self.shared = rank, shared

    def broadcast(self, value, src=0):
        if self.rank == src:
            self.shared["value"] = value
        self.shared["barrier"].wait()
        value = self.shared["value"]
        self.shared["barrier"].wait()  # every rank has read it before rank 0 may broadcast again
        return value

    def barrier(self, name=None):
        self.shared["barrier"].wait()


def _in_threads(model, inputs, out, monkeypatch, stop_rank: int | None = None, **options) -> tuple[dict, dict, list]:
    """``caption_files`` on two ranks that are threads: the positions each rank captioned, each rank's summary,
    and the errors; rank ``stop_rank`` stops before captioning anything (as if killed)."""
    captioned: dict[int, list[int]] = {0: [], 1: []}
    real = captioning._caption_units

    others_done = threading.Event()

    def spy(model, units, finish, **kwargs):  # what each rank is given to caption
        rank = int(threading.current_thread().name)
        if rank == stop_rank:
            others_done.wait(60)  # then it stops, before writing anything
            raise RuntimeError("stopped")
        captioned[rank].extend(i for _, unit in units for i in unit.positions)
        real(model, units, finish, **kwargs)
        others_done.set()

    monkeypatch.setattr(captioning, "_caption_units", spy)
    shared = {"barrier": threading.Barrier(2)}
    summaries, errors = {}, []

    def rank(r: int) -> None:
        try:
            processes = Processes(r, 2, fabric=_ThreadFabric(r, shared))
            summaries[r] = caption_files(
                model, inputs, out, processes=processes, num_workers=0, progress=False, **options
            )
        except Exception as err:  # noqa: BLE001 - reported by the tests
            errors.append(err)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(r,), name=str(r)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    monkeypatch.setattr(captioning, "_caption_units", real)
    return captioned, summaries, errors


@pytest.mark.parametrize("fmt", ["jsonl", "coco", "csv"])
def test_ranks_caption_disjoint_shares_of_the_images_and_rank_0_merges_them(bundle_dir, tmp_path, monkeypatch, fmt):
    folder = write_images(tmp_path / "imgs", 9, img_size=48)
    (folder / "img_00004b.png").write_bytes(b"broken")  # an error record among them
    monkeypatch.setattr(captioning, "CHUNK_BATCHES", 1)
    inputs, out = list_inputs(folder), tmp_path / f"captions.{fmt}"
    model = load_bundle(bundle_dir)  # loaded once: both ranks only run it
    captioned, summaries, errors = _in_threads(model, inputs, out, monkeypatch, format=fmt, batch_size=2)
    assert not errors, errors
    assert captioned[0] and captioned[1] and not set(captioned[0]) & set(captioned[1])  # no image twice
    assert sorted(captioned[0] + captioned[1]) == list(range(len(inputs)))  # every image once
    assert (summaries[0].captioned, summaries[0].failed) == (summaries[1].captioned, summaries[1].failed) == (9, 1)
    broken = inputs.paths.index(str(folder / "img_00004b.png"))
    if fmt == "jsonl":  # merged by rank 0, in input order
        records = _jsonl(out)
        assert [r["image"] for r in records] == inputs.paths and "error" in records[broken]
    elif fmt == "coco":
        assert [r["image_id"] for r in json.loads(out.read_text())] == [i for i in range(10) if i != broken]
    else:
        with open(out, newline="") as f:
            rows = list(csv.DictReader(f))
        assert [r["image"] for r in rows] == inputs.paths and rows[broken]["error"] and not rows[broken]["caption"]
    assert not out.with_name(out.name + ".parts").exists()


def test_single_process_run_resumes_the_chunks_of_a_multi_process_run(bundle_dir, tmp_path, monkeypatch):
    folder = write_images(tmp_path / "imgs", 8, img_size=48)
    monkeypatch.setattr(captioning, "CHUNK_BATCHES", 1)  # chunks of 2 images at batch_size=2
    inputs, out, model = list_inputs(folder), tmp_path / "captions.csv", load_bundle(bundle_dir)
    captioned, _, errors = _in_threads(model, inputs, out, monkeypatch, stop_rank=1, format="csv", batch_size=2)
    assert errors and captioned[0] and not captioned[1] and not out.exists()  # rank 1 stopped, nothing merged
    summary = caption_files(model, inputs, out, format="csv", batch_size=2, num_workers=0, progress=False)
    assert (summary.captioned, summary.failed, summary.skipped) == (8, 0, len(captioned[0]))  # rank 0's kept
    with open(out, newline="") as f:
        assert [r["image"] for r in csv.DictReader(f)] == inputs.paths
    assert not (tmp_path / "captions.csv.parts").exists()


def test_an_existing_jsonl_output_keeps_its_records(bundle_dir, tmp_path):
    folder = write_images(tmp_path / "imgs", 4, img_size=48)
    inputs, out = list_inputs(folder), tmp_path / "captions.jsonl"
    kept = {"image": inputs[2].path, "image_id": 2, "caption": "from an earlier run"}
    again = {**kept, "caption": "recorded twice: the first wins"}
    other = {"image": "old.png", "image_id": 9, "caption": "not among the inputs"}
    out.write_text(_lines([kept, other, again]) + "not json\n")
    summary = caption_files(load_bundle(bundle_dir), inputs, out, num_workers=0, progress=False)
    assert (summary.captioned, summary.failed, summary.skipped) == (4, 0, 1)
    records = _jsonl(out)
    assert [r["image"] for r in records] == [*inputs.paths, "old.png"]  # input order; the others kept, last
    assert records[2] == kept and records[4] == other


def _ranks(root: int) -> dict[int, int]:
    """``LOCAL_RANK`` -> pid: ``root`` is rank 0, the ranks Lightning starts are its children."""
    found = {0: root}
    for pid, (ppid, _) in scan_processes().items():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if ppid == root else []
        except OSError:
            continue
        found.update((int(e.split(b"=", 1)[1]), pid) for e in env if e.startswith(b"LOCAL_RANK="))
    return found


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _chunks(parts: Path) -> set[str]:
    """The finished chunk outputs in the chunk folder (not a killed rank's temporaries)."""
    return {p.name for p in parts.glob("*.jsonl")} if parts.is_dir() else set()


def _wait_for_chunks(proc: subprocess.Popen, parts: Path, n: int, log: Path) -> None:
    """Until ``n`` more chunks are written; the run must still be going then."""
    start = len(_chunks(parts))
    deadline = time.monotonic() + 300
    while proc.poll() is None and len(_chunks(parts)) - start < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None and len(_chunks(parts)) - start >= n, log.read_text()[-3000:]


def _kill(proc: subprocess.Popen, pid: int) -> None:
    """SIGKILL ``pid`` (one rank, or rank 0 and its group); wait until the whole job is gone."""
    tree = process_tree(proc.pid)
    os.kill(pid, signal.SIGKILL)
    if pid == proc.pid:
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=60)  # after one rank, Lightning's observer in rank 0 kills the rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 30
    while [p for p in tree if p in scan_processes()] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in tree if p in scan_processes()], "processes of the killed run still alive"


@pytest.mark.slow
def test_two_process_run_killed_and_resumed_captions_each_image_once(bundle_dir, tmp_path):
    folder = write_images(tmp_path / "imgs", 60, img_size=48)
    bad = write_bad_images(folder)
    # A FIFO listed last: its reader blocks until killed, so no run can finish while it is there.
    stall = folder / "zzz_stall.jpg"
    os.mkfifo(stall)
    inputs = list_inputs(folder)
    out = tmp_path / "captions.jsonl"
    parts = tmp_path / "captions.jsonl.parts"
    cmd = [
        str(console_script("vitattn-caption")),
        f"model={bundle_dir}",
        f"images={folder}",
        f"out={out}",
        "batch_size=1",  # chunks of 8 images: 9, shared by the two ranks
        "num_workers=0",
        "devices=2",
        "accelerator=cpu",
        "num_threads=1",
        "progress=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

    # 1. kill -9 one rank mid-run
    first = _start(cmd, tmp_path / "first.log", env)
    _wait_for_chunks(first, parts, 2, tmp_path / "first.log")
    ranks = _ranks(first.pid)
    assert set(ranks) == {0, 1}, ranks
    _kill(first, ranks[1])
    after_first = _chunks(parts)

    # 2. the same command resumes; a second job on the same out meanwhile is refused in one line;
    # then the whole job is killed
    second = _start(cmd, tmp_path / "second.log", env)
    _wait_for_chunks(second, parts, 1, tmp_path / "second.log")
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-3000:]
    assert "being written by another run" in errors[0]
    _kill(second, second.pid)
    written = _chunks(parts)
    assert after_first < written and len(written) < 9, (after_first, written)  # kept, and more
    assert not out.exists()  # nothing merged yet
    print(f"killed with {len(after_first)}, then {len(written)} of 9 chunks written")

    # 3. with the stalling file now an image, the same command finishes
    stall.unlink()
    Image.new("RGB", (48, 48), (40, 90, 215)).save(stall)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 1, again.stderr[-3000:]  # the bad files failed
    assert f"{8 * len(written)} of {len(inputs)} images are already captioned" in again.stderr  # not redone
    summary = f"captioned {len(inputs) - len(bad)} images, {len(bad)} failed -> {out}"
    assert again.stdout.strip().splitlines() == [summary]  # one line, from rank 0, counting both ranks
    assert not parts.exists()
    records = _jsonl(out)
    assert [r["image"] for r in records] == inputs.paths  # each input once, in input order

    reference = caption_files(load_bundle(bundle_dir), inputs, tmp_path / "one.jsonl", num_workers=0, progress=False)
    assert (reference.captioned, reference.failed) == (len(inputs) - len(bad), len(bad))
    expected = {r["image"]: r for r in _jsonl(tmp_path / "one.jsonl")}
    assert Counter("caption" in r for r in records) == Counter({True: len(inputs) - len(bad), False: len(bad)})
    assert {r["image"]: r for r in records} == expected  # the same captions and errors, image for image


def test_close_ends_the_process_group_before_the_interpreter_does(tmp_path):
    """gloo's threads left to the interpreter's teardown can abort a finished run (exit -6); ``close`` ends them."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        Processes(fabric=object()).close()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
