"""Processes as /proc shows them: a process tree, its resident memory, the machine's busy CPU time.

What the load scripts (``benchmarks/load_caption.py``, ``benchmarks/load_serve.py``) sample while they run.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["busy_ticks", "process_tree", "rss_kib", "scan_processes", "tree_rss_kib"]


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


def busy_ticks() -> int:
    """CPU ticks the whole machine has spent busy (``/proc/stat``: all but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(values) - values[3] - values[4]


def rss_kib(pid: int) -> int:
    """``VmRSS`` of ``pid`` in KiB; 0 when it is gone (or a zombie, which has none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_kib(root: int) -> int:
    """The summed ``VmRSS`` of ``root`` and its descendants, in KiB (pages shared by forks counted per process)."""
    return sum(rss_kib(pid) for pid in process_tree(root))
