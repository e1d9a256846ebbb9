"""Processes as /proc shows them, and image folders for captioning runs: what the tests whose subject is a
process (a killed ``vitattn-caption`` and its DataLoader workers) inspect."""

from __future__ import annotations

import os
from pathlib import Path

from vitattn.data.shapes import generate_scene, render_scene

__all__ = ["RecordCounter", "process_tree", "rss_kib", "scan_processes", "write_images"]


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
