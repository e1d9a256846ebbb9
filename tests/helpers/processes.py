"""Processes as /proc shows them, image folders for captioning runs, and trainings stopped mid-run (SIGTERM,
kill -9) and resumed: what the tests whose subject is a process inspect."""

from __future__ import annotations

import os
from pathlib import Path

from vitattn.data.shapes import generate_scene, render_scene

__all__ = [
    "RecordCounter", "process_tree", "rss_kib", "sample_keys", "scan_processes", "stop_mid_run",
    "stop_twice_then_finish", "write_images",
]  # fmt: skip


def scan_processes() -> dict[int, tuple[int, int]]:
    """Every live process: pid -> (parent pid, CPU ticks used so far); zombies left out."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = text[text.rfind(")") + 2 :].split()  # the name in (...) may hold spaces
            if fields[0] != "Z":
                found[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
    return found


def process_tree(root: int, processes: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """``root`` and its live descendants."""
    processes = scan_processes() if processes is None else processes
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root] if root in processes else []
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def rss_kib(pid: int) -> int:
    """``VmRSS`` of ``pid`` in KiB; 0 when it is gone (or a zombie, which has none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def write_images(folder: Path, n: int, img_size: int = 64, seed: int = 0) -> Path:
    """``n`` JPEGs of shape scenes, ``img_000000.jpg`` ..."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        render_scene(generate_scene(seed, "test", i), img_size).save(folder / f"img_{i:06d}.jpg", quality=90)
    return folder


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


def stop_mid_run(command: list[str], log: Path, ready, stop: str, env: dict, wait: float = 400) -> None:
    """Start ``command`` (a training, in its own process group, output to ``log``), wait until ``ready()``, then
    stop it: ``sigterm`` to its first process (a preemption: exit status 75 expected) or ``kill-9`` to the whole
    group at once (ranks and loader workers)."""
    import os
    import signal
    import subprocess
    import time

    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + wait
        while proc.poll() is None and time.monotonic() < deadline and not ready():
            time.sleep(0.02)
        assert proc.poll() is None and ready(), log.read_text()[-3000:]
        if stop == "sigterm":
            proc.send_signal(signal.SIGTERM)  # rank 0: every rank stops after the same step, with a checkpoint
            assert proc.wait(timeout=300) == 75, log.read_text()[-3000:]
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def sample_keys(folder: Path, suffix: str = "txt") -> list[tuple[int, int, list[str]]]:
    """Every rank's ``(rank, step, keys)`` lines (``SampleKeys``) in the files ``keys.rank*.<suffix>``."""
    return [
        (int(f.name.split(".")[1][4:]), int(step), keys)
        for f in sorted(folder.glob(f"keys.rank*.{suffix}"))
        for step, *keys in (line.split() for line in f.read_text().splitlines())
    ]


def stop_twice_then_finish(
    command: list[str], logs: Path, keys: Path, *, first: int, every: int, steps: int, batch: int, env: dict
) -> list[list[str]]:
    """One DDP epoch (two ranks, ``steps`` steps of ``batch`` samples a rank, a step checkpoint every ``every``
    steps, ``resume=auto``, ``SampleKeys`` writing to ``keys``) stopped twice and resumed each time: SIGTERM to
    rank 0 after ``first`` steps (a preemption: status 75); the resumed run killed by ``kill -9`` (every process of
    the run at once) once it has trained past a step checkpoint of its own; resumed again to the end.

    Each stop leaves a checkpoint between the last one and the end; the samples it holds are the keys of its
    steps, ``2 * batch`` a step from the previous checkpoint on (so the resumed run continued from there, not from
    the start). Returns the samples each of the three runs trained that count: those held by the first and the
    second checkpoint (past the first), then all that the last run trained."""
    import subprocess

    import torch

    last = Path(command[-1].split("=", 1)[1]) / "checkpoints" / "last.ckpt"  # hydra.run.dir=..., last
    assert command[-1].startswith("hydra.run.dir=") and "resume=auto" in command
    trained, saved = [], 0
    for stop, lines in (("sigterm", 2 * first), ("kill-9", 2 * (every + 1))):  # kill-9: a checkpoint, then a step
        stop_mid_run(command, logs / f"{stop}.log", lambda n=lines: len(sample_keys(keys)) >= n, stop, env)
        step = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
        assert saved < step < steps, f"{stop}: checkpoint at step {step}, the previous at {saved}, {steps} steps"
        held = [k for _, s, ks in sample_keys(keys) if s <= step for k in ks]  # what the checkpoint holds
        assert len(held) == 2 * batch * (step - saved), f"{stop}: {len(held)} samples to step {step} from {saved}"
        trained.append(held)
        saved = step
        for f in keys.glob("keys.rank*.txt"):
            f.rename(f.with_suffix(f".{stop}"))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained.append([k for _, _, ks in sample_keys(keys) for k in ks])
    return trained
