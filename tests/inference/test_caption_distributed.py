"""Captioning in several processes: part files, the record index, the merge in input order, and a
2-process (gloo) run killed with SIGKILL and resumed, each image exactly once."""

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import console_script
from tests.inference.test_caption_load import load_caption
from tests.inference.test_captioner import bundle_dir, write_bad_images  # noqa: F401 - the tiny caption bundle fixture
from vitattn.bundle import load_bundle
from vitattn.inference import InputList, RecordIndex, caption_to_file, list_inputs
from vitattn.inference.records import path_digests
from vitattn.inference.writers import OutputFiles, write_output


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _lines(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_record_index_first_record_wins_and_repairs_a_partial_line(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(_lines([{"image": "x", "image_id": 0, "caption": "one"}]) + "not json\n" + '{"image": "y", "cap')
    second.write_text(_lines([{"image": "x", "image_id": 0, "caption": "two"}, {"image": "z", "error": "bad"}]))
    index = RecordIndex.read([first, second, tmp_path / "missing.jsonl"])
    assert len(index) == 2 and first.read_text().endswith('"cap')  # without repair the file is left alone
    inputs = InputList(["z", "y", "x"])
    assert index.missing(inputs).tolist() == [1]
    rows = index.find(path_digests(["x", "z"]))
    assert [json.loads(line)["caption" if i == 0 else "error"] for i, line in enumerate(index.lines(rows))] == [
        "one",
        "bad",
    ]
    assert index.failed[rows].tolist() == [False, True]
    RecordIndex.read([first], repair=True)
    assert first.read_text().endswith("not json\n")


@pytest.mark.parametrize("fmt", ["jsonl", "coco", "csv"])
def test_write_output_merges_parts_in_input_order(tmp_path, fmt):
    files = OutputFiles(tmp_path / f"out.{fmt}", fmt)
    inputs = InputList(["c.png", "a.png", "b.png"], [30, 10, 20])
    files.part(1).write_text(_lines([{"image": "a.png", "image_id": 10, "caption": "an a"}]))
    files.part(0).write_text(_lines([{"image": "b.png", "image_id": 20, "error": "broken"}]))
    files.progress.write_text(_lines([{"image": "c.png", "image_id": 30, "caption": "a c"}, {"image": "old.png"}]))
    assert files.sources() == [files.progress, files.part(0), files.part(1)]
    assert write_output(files, inputs, RecordIndex.read(files.sources())) == (2, 1)
    if fmt == "jsonl":
        assert [r["image"] for r in _jsonl(files.out)] == ["c.png", "a.png", "b.png", "old.png"]  # others kept, last
    elif fmt == "coco":
        assert json.loads(files.out.read_text()) == [
            {"image_id": 30, "caption": "a c"},
            {"image_id": 10, "caption": "an a"},
        ]
    else:
        assert files.out.read_text().splitlines()[1:] == ["c.png,30,a c,", "a.png,10,an a,", "b.png,20,,broken"]
    with pytest.raises(RuntimeError, match="1 images have no record"):
        write_output(files, InputList(["a.png", "new.png"]), RecordIndex.read([files.part(1)]))


def test_single_process_run_resumes_the_parts_of_a_multi_process_run(bundle_dir, tmp_path):  # noqa: F811
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(5):
        Image.new("RGB", (20, 20), (40 * i, 0, 0)).save(folder / f"{i}.png")
    inputs = list_inputs(folder)
    files = OutputFiles(tmp_path / "out.csv", "csv")
    kept = {"image": inputs[3].path, "image_id": 3, "caption": "from rank one"}
    files.part(1).write_text(_lines([kept]) + '{"image": "half')
    summary = caption_to_file(load_bundle(bundle_dir), inputs, files.out, format="csv", num_workers=0, progress=False)
    assert (summary.captioned, summary.failed, summary.skipped) == (5, 0, 1)
    rows = files.out.read_text().splitlines()[1:]
    assert [r.split(",")[0] for r in rows] == inputs.paths and rows[3] == f"{inputs[3].path},3,from rank one,"
    assert files.sources() == []  # the parts and the progress file are gone


def test_list_inputs_walks_folders_without_following_links(tmp_path):
    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / ".hidden").mkdir()
    for p in ("a/1.png", "a/deep/2.JPG", "b.gif", ".hidden/3.png", ".4.png", "notes.txt"):
        (tmp_path / p).write_bytes(b"")
    (tmp_path / "a" / "loop").symlink_to(tmp_path)
    listed = list_inputs(tmp_path)
    assert isinstance(listed, InputList) and listed.ids is None
    assert listed.paths == sorted(str(tmp_path / p) for p in ("a/1.png", "a/deep/2.JPG", "b.gif"))
    assert [x.image_id for x in listed] == [0, 1, 2] and listed[1].path == listed.paths[1]


def test_list_inputs_names_a_folder_it_cannot_read(tmp_path, monkeypatch):
    (tmp_path / "a" / "locked").mkdir(parents=True)
    (tmp_path / "a" / "1.png").write_bytes(b"")
    scandir = os.scandir

    def refuse(path):
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied")
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refuse)
    with pytest.raises(ValueError) as err:
        list_inputs(tmp_path)  # not a list without the locked folder's images
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"images={tmp_path}: cannot read the folder ")
    assert str(tmp_path / "a" / "locked") in message and "Permission denied" in message


# --- two processes, killed and resumed ----------------------------------------------------------------------


def _ranks(root: int) -> dict[int, int]:
    """``LOCAL_RANK`` -> pid: ``root`` is rank 0, the ranks Lightning starts are its children."""
    found = {0: root}
    for pid, (ppid, _) in load_caption.scan_processes().items():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if ppid == root else []
        except OSError:
            continue
        found.update((int(e.split(b"=", 1)[1]), pid) for e in env if e.startswith(b"LOCAL_RANK="))
    return found


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _wait_for_records(proc: subprocess.Popen, counters: list, n: int, log: Path) -> None:
    """Until every rank's part has ``n`` more complete lines; the run must still be going then."""
    start = [c() for c in counters]
    deadline = time.monotonic() + 300
    while proc.poll() is None and min(c() - s for c, s in zip(counters, start)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None and min(c() - s for c, s in zip(counters, start)) >= n, log.read_text()[-3000:]


def _kill(proc: subprocess.Popen, pid: int) -> None:
    """SIGKILL ``pid`` (one rank, or rank 0 and its group); wait until the whole job is gone."""
    tree = load_caption.process_tree(proc.pid)
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
    while [p for p in tree if p in load_caption.scan_processes()] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in tree if p in load_caption.scan_processes()], "processes of the killed run still alive"


@pytest.mark.slow
def test_two_process_run_killed_and_resumed_captions_each_image_once(bundle_dir, tmp_path):  # noqa: F811
    folder = load_caption.write_images(tmp_path / "imgs", 60, img_size=48)
    bad = write_bad_images(folder)
    # A FIFO listed last: its reader blocks until killed, so no run can finish while it is there.
    stall = folder / "zzz_stall.jpg"
    os.mkfifo(stall)
    inputs = list_inputs(folder)
    out = tmp_path / "captions.jsonl"
    files = OutputFiles(out, "jsonl")
    cmd = [
        str(console_script("vitattn-caption")),
        f"model={bundle_dir}",
        f"images={folder}",
        f"out={out}",
        "batch_size=2",
        "num_workers=0",
        "devices=2",
        "accelerator=cpu",
        "num_threads=1",
        "progress=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    counters = [load_caption.LineCounter(files.part(r)) for r in (0, 1)]

    # 1. kill -9 one rank mid-run
    first = _start(cmd, tmp_path / "first.log", env)
    _wait_for_records(first, counters, 4, tmp_path / "first.log")
    ranks = _ranks(first.pid)
    assert set(ranks) == {0, 1}, ranks
    _kill(first, ranks[1])
    after_first = sum(c() for c in counters)

    # 2. the same command resumes; a second job on the same out meanwhile is refused in one line;
    # then the whole job is killed
    second = _start(cmd, tmp_path / "second.log", env)
    _wait_for_records(second, counters, 2, tmp_path / "second.log")
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-3000:]
    assert "being written by another run" in errors[0]
    _kill(second, second.pid)
    written = sum(c() for c in counters)
    assert after_first + 4 <= written < len(inputs), (after_first, written)
    assert not out.exists() or out.stat().st_size == 0  # nothing merged yet
    print(f"killed with {after_first}, then {written} of {len(inputs)} records in the parts")

    # 3. with the stalling file now an image, the same command finishes
    stall.unlink()
    Image.new("RGB", (48, 48), (40, 90, 215)).save(stall)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 1, again.stderr[-3000:]  # the bad files failed
    summary = f"captioned {len(inputs) - len(bad)} images, {len(bad)} failed -> {out}"
    assert again.stdout.strip().splitlines() == [summary]  # one line, from rank 0, counting both ranks
    assert files.parts() == []
    records = _jsonl(out)
    assert [r["image"] for r in records] == inputs.paths  # each input once, in input order

    reference = caption_to_file(load_bundle(bundle_dir), inputs, tmp_path / "one.jsonl", num_workers=0, progress=False)
    assert (reference.captioned, reference.failed) == (len(inputs) - len(bad), len(bad))
    expected = {r["image"]: r for r in _jsonl(tmp_path / "one.jsonl")}
    assert Counter("caption" in r for r in records) == Counter({True: len(inputs) - len(bad), False: len(bad)})
    assert {r["image"]: r for r in records} == expected  # the same captions and errors, image for image


def test_record_index_finds_digests_that_share_their_first_eight_bytes():
    a, b, c = bytes(range(16)), bytes(range(8)) + bytes(range(100, 108)), bytes(range(8)) + bytes(range(50, 58))
    keys = np.unique(np.frombuffer(a + b + c, dtype="V16"))  # all three share the first 8 bytes
    index = RecordIndex([], keys, np.zeros(3, np.int16), np.zeros(3, np.int64), np.zeros(3, bool))
    queries = np.frombuffer(b + c + a + bytes(range(8)) + bytes(8), dtype="V16")
    rows = index.find(queries)
    assert rows[3] == -1 and (keys[rows[:3]] == queries[:3]).all()


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


def test_ranks_caption_disjoint_shares_of_the_images_and_rank_0_merges_them(bundle_dir, tmp_path, monkeypatch):  # noqa: F811
    import threading

    from vitattn.inference import distributed
    from vitattn.inference.processes import Processes

    folder = load_caption.write_images(tmp_path / "imgs", 9, img_size=48)
    inputs, out = list_inputs(folder), tmp_path / "captions.jsonl"
    captioned: dict[int, list[int]] = {0: [], 1: []}
    real = distributed.iter_caption_batches

    def spy(model, inputs, *, positions, **kwargs):  # what each rank is given to caption
        captioned[int(threading.current_thread().name)].extend(positions)
        return real(model, inputs, positions=positions, **kwargs)

    monkeypatch.setattr(distributed, "iter_caption_batches", spy)
    shared = {"barrier": threading.Barrier(2)}
    summaries, errors = {}, []
    model = load_bundle(bundle_dir)  # loaded once: both ranks only run it

    def rank(r: int) -> None:
        try:
            processes = Processes(r, 2, fabric=_ThreadFabric(r, shared))
            summaries[r] = distributed.caption_files_in_processes(
                model, inputs, out, processes, num_workers=0, progress=False
            )
        except Exception as err:  # noqa: BLE001 - reported by the test below
            errors.append(err)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(r,), name=str(r)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert captioned[0] and captioned[1] and not set(captioned[0]) & set(captioned[1])  # no image twice
    assert sorted(captioned[0] + captioned[1]) == list(range(len(inputs)))  # every image once
    assert summaries[0].captioned == summaries[1].captioned == len(inputs)
    assert [r["image"] for r in _jsonl(out)] == inputs.paths  # merged by rank 0, in input order
