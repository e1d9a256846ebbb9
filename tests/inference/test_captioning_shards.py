"""Captioning shards: one output per shard, every key once, error rows, finished shards skipped on a re-run."""

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from vitattn.bundle import load_bundle
from vitattn.data.shards import expand_shards, read_shard
from vitattn.data.shards.stream import image_member
from vitattn.data.shards.writer import shapes_samples, write_shards
from vitattn.inference import caption_shards
from vitattn.inference.captioning import Processes, assign_units, read_pixels, shard_output

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _shards(folder: Path, count: int, per_shard: int) -> list[str]:
    write_shards(shapes_samples("val", count, img_size=32), folder, per_shard)
    return expand_shards(str(folder))


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(out.glob("*.jsonl")) for line in f.read_text().splitlines()]


OLD = 1_000_000_000  # 2001-09-09: an mtime no rewrite can have


def _state(path: Path) -> tuple[int, int, bytes]:
    return path.stat().st_ino, path.stat().st_mtime_ns, path.read_bytes()


def _finished(out: Path) -> dict[str, tuple[int, int, bytes]]:
    """Each output's (inode, mtime in ns, bytes), its mtime first set to ``OLD``: a rewrite in place then
    shows as plainly as a new file renamed over the old one."""
    outputs = sorted(p for p in out.iterdir() if not p.name.startswith("."))  # not a killed rank's temporary
    for path in outputs:
        os.utime(path, ns=(OLD * 10**9, OLD * 10**9))
    return {path.name: _state(path) for path in outputs}


def _rewritten(out: Path, finished: dict[str, tuple[int, int, bytes]]) -> list[str]:
    """The ``finished`` outputs that are not the same file with the same mtime and bytes any more."""
    return [name for name, state in finished.items() if not (out / name).exists() or _state(out / name) != state]


def test_plan_shards_keeps_every_rank_busy_when_shards_differ_in_size():
    plans = assign_units([100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10], 2)
    loads = [sum([100, *[10] * 10][i] for i in plan) for plan in plans]
    assert sorted(loads) == [100, 100] and sorted(i for p in plans for i in p) == list(range(11))


def test_caption_shards_writes_one_output_per_shard_and_a_rerun_redoes_only_the_missing(bundle_dir, tmp_path):
    urls = _shards(tmp_path / "in", 20, 6)
    with tarfile.open(urls[0], "a") as tar:  # a sample whose image is not an image: an error row
        info = tarfile.TarInfo("zzz.jpg")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"oops"))
    bundle, out = load_bundle(bundle_dir), tmp_path / "out"
    summary = caption_shards(bundle, urls, out, num_workers=2, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["00000.jsonl", "00001.jsonl", "00002.jsonl", "00003.jsonl"]
    rows = _rows(out)
    keys = [s["__key__"] for url in urls for s in read_shard(url)]
    assert sorted(r["key"] for r in rows) == sorted(keys) and len(keys) == 21  # every key once
    (bad,) = [r for r in rows if "error" in r]
    assert bad["key"] == "zzz" and bad["error"] == "not an image (unrecognised file format)"
    assert all(r["caption"] and r["original_caption"] for r in rows if r["key"] != "zzz")
    assert (summary.units, summary.captioned, summary.failed) == (4, 20, 1)

    (out / "00002.jsonl").unlink()
    finished = _finished(out)
    again = caption_shards(bundle, urls, out, num_workers=0, progress=False)
    assert _rewritten(out, finished) == []  # same inode, mtime and bytes: left alone
    assert sorted(p.name for p in out.iterdir()) == ["00000.jsonl", "00001.jsonl", "00002.jsonl", "00003.jsonl"]
    assert (again.units, again.units_before) == (1, 3)
    assert Counter(r["key"] for r in _rows(out)) == Counter(keys)


def test_vitattn_caption_shards_writes_parquet(bundle_dir, tmp_path):
    import pyarrow.parquet as pq

    urls = _shards(tmp_path / "in", 7, 4)
    command = [sys.executable, "-m", "vitattn.cli.caption", f"model={bundle_dir}", f"shards={tmp_path / 'in'}"]
    command += [f"out={tmp_path / 'out'}", "format=parquet", "num_workers=0", "progress=false"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "captioned 7 samples of 2 shards (0 finished before), 0 failed" in proc.stdout
    tables = [pq.read_table(tmp_path / "out" / f"{i:05d}.parquet").to_pylist() for i in range(2)]
    assert [len(t) for t in tables] == [4, 3]
    assert [r["key"] for r in tables[1]] == [s["__key__"] for s in read_shard(urls[1])]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_shard_candidates_go_in_side_files_by_sample_key_with_a_manifest_of_every_shard(bundle_dir, tmp_path, fmt):
    from vitattn.inference.candidates import CandidateFilter, CandidateOptions, read_records

    urls = _shards(tmp_path / "in", 9, 4)
    bundle, out = load_bundle(bundle_dir), tmp_path / "out"
    options = CandidateOptions(3, include_greedy=True, seed=2, filter=CandidateFilter(bundle, "self"))
    sample = dict(do_sample=True, top_p=0.9)
    summary = caption_shards(bundle, urls, out, format=fmt, num_workers=0, progress=False, candidates=options, **sample)
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([*(f"{i:05d}.{fmt}" for i in range(3)), "manifest.json"])  # beside, nothing copied
    rows = list(read_records(sorted(out.glob(f"*.{fmt}"))))
    assert [r["key"] for r in rows] == [s["__key__"] for url in urls for s in read_shard(url)]
    samples = [s for url in urls for s in read_shard(url)]
    pixels = torch.stack([read_pixels(io.BytesIO(s[image_member(s)]), bundle.transform) for s in samples])
    expected = bundle.model.candidates(pixels, 3, [r["key"] for r in rows], 2, True, **sample)
    for b, row in enumerate(rows):  # each sample's candidates fixed by its key, whichever shard and batch
        assert row["candidates"][0]["text"] == row["caption"] == bundle.vocab.decode(expected.tokens[b, 0])
        assert {c["text"] for c in row["candidates"]} == set(bundle.vocab.decode_batch(expected.tokens[b]))
        assert all(isinstance(c["score"], float) for c in row["candidates"])
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert (counts["images"], counts["drawn"], counts["null_scores"]) == (9, 9 * 4, 0)
    assert summary.manifest["counts"] == counts
    (out / "00001.jsonl").unlink(missing_ok=True)  # a rerun captions what is missing; the manifest counts all
    (out / "00001.parquet").unlink(missing_ok=True)
    again = caption_shards(bundle, urls, out, format=fmt, num_workers=0, progress=False, candidates=options, **sample)
    assert (again.units, again.manifest["counts"]) == (1, counts)
    assert list(read_records(sorted(out.glob(f"*.{fmt}")))) == rows


@pytest.mark.slow
def test_two_processes_killed_mid_run_then_rerun_caption_every_key_once(bundle_dir, tmp_path):
    urls = _shards(tmp_path / "in", 240, 6)  # 40 shards
    command = [sys.executable, "-m", "vitattn.cli.caption", f"model={bundle_dir}", f"shards={tmp_path / 'in'}"]
    command += [f"out={tmp_path / 'out'}", "devices=2", "accelerator=cpu", "num_workers=1", "batch_size=2"]
    command += ["progress=false"]
    out = tmp_path / "out"
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and len(list(out.glob("*.jsonl"))) < 4:
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)  # both ranks and their readers, at whatever they were doing
        proc.wait(timeout=60)
    done = len(list(out.glob("*.jsonl")))
    assert 4 <= done < 40
    finished = _finished(out)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _rewritten(out, finished) == []  # same inode, mtime and bytes: left alone
    assert f"({done} finished before)" in proc.stdout
    keys = [s["__key__"] for url in urls for s in read_shard(url)]
    assert Counter(r["key"] for r in _rows(out)) == Counter(keys)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left by the re-run


@pytest.mark.parametrize(
    "argv, message",
    [
        (["model=m", "out=o"], "error: missing images=... (image files) or shards=... (WebDataset tars)"),
        (["model=", "out=o", "images=i"], "error: missing model=...; see vitattn-caption --help"),  # not "." read
        (["model=m", "out=o", "images=i", "shards=s"], "error: images=... and shards=... are both given"),
    ],
)
def test_vitattn_caption_takes_images_or_shards(argv, message, capsys):
    from vitattn.cli.caption import main

    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(message)


def test_vitattn_caption_refuses_a_file_format_for_shards_and_writes_nothing(bundle_dir, tmp_path, capsys):
    """``caption_shards`` owns ``format``: the command line reaches it and says its line."""
    from vitattn.cli.caption import main

    _shards(tmp_path / "in", 3, 2)
    argv = [f"model={bundle_dir}", f"shards={tmp_path / 'in'}", f"out={tmp_path / 'out'}", "format=coco"]
    assert main(argv) == 2
    assert capsys.readouterr().err == "error: format='coco' is unknown for shards; choose one of ['jsonl', 'parquet']\n"
    assert not (tmp_path / "out").exists()


class _RanksOneAfterAnother:
    """Fabric's collectives for ranks run one after another: each gets rank 0's listing of finished outputs
    (taken before any rank wrote), and sums are this rank's own."""

    device = torch.device("cpu")

    def __init__(self, shared: dict) -> None:
        self.shared = shared

    def broadcast(self, value, src=0):
        return self.shared.setdefault("listing", value)

    def all_reduce(self, tensor, reduce_op="sum"):
        return tensor


def test_two_ranks_caption_disjoint_shares_of_the_shards(bundle_dir, tmp_path):
    urls = _shards(tmp_path / "in", 30, 4)  # 8 shards, the last one smaller
    bundle, out, shared = load_bundle(bundle_dir), tmp_path / "out", {}
    written = []
    for rank in (0, 1):
        before = set(out.iterdir()) if out.exists() else set()
        processes = Processes(rank, 2, fabric=_RanksOneAfterAnother(shared))
        summary = caption_shards(bundle, urls, out, processes=processes, num_workers=0, progress=False)
        written.append({p.name for p in set(out.iterdir()) - before})
        assert summary.units == len(written[-1]) > 0
    assert not written[0] & written[1]  # no shard captioned by both ranks
    assert written[0] | written[1] == {shard_output(out, url, "jsonl").name for url in urls}
    keys = [s["__key__"] for url in urls for s in read_shard(url)]
    assert Counter(r["key"] for r in _rows(out)) == Counter(keys)  # every sample once
