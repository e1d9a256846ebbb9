"""The machine a run measured: CPU, ISA flags, versions, and its dense matmul rate."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.timing import interleaved


def machine_info(threads: int) -> dict[str, Any]:
    """CPU model and ISA flags, thread count, library versions, load average, GPU name if any.

    Args:
        threads: the torch thread count of the run.

    Returns:
        The ``machine`` entry of the JSON (``loadavg_end`` is added by the caller at the end).
    """
    cpu, isa = platform.processor() or "unknown", []
    with contextlib.suppress(OSError):
        fields = dict(
            line.split(":", 1)
            for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
            if ":" in line
        )
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        family, model = fields.get("cpu family", "?"), fields.get("model", "?")
        cpu = f"{fields.get('model name', cpu)} (family {family}, model {model})"
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in fields.get("flags", "").split()]
    info = dict(
        cpu=cpu,
        isa=isa,
        logical_cpus=os.cpu_count(),
        torch_threads=threads,
        torch=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        loadavg_start=loadavg(),
        mkldnn=torch.backends.mkldnn.is_available(),
    )
    for name in ("timm", "transformers"):
        with contextlib.suppress(ImportError):
            info[name] = __import__(name).__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def loadavg() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def status_kib(field: str, pid: int | str = "self") -> int:
    """A KiB field of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``; ``PPid`` as is); 0 when the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in lines if line.startswith(f"{field}:")), 0)


def matmul_fn(n: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Callable[[], Tensor]:
    """One ``torch.mm`` of two (n, n) matrices (2n³ FLOPs), the reference for the achieved rate."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def matmul_gflops(
    n: int = 2048, repeats: int = 5, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """The machine's dense matmul rate: ``torch.mm`` of two (n, n) matrices, median GFLOP/s."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    seconds = interleaved({"mm": matmul_fn(n, device, dtype)}, repeats=repeats, warmup=2, sync=sync)["mm"]
    return dict(n=n, seconds=seconds, gflops=2 * n**3 / statistics.median(seconds) / 1e9)
