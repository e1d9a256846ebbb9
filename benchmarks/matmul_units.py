"""What the CPU's matrix units give each runtime: one (n, n) product in every precision PyTorch and ONNX Runtime run.

    python -m benchmarks.matmul_units                 # n = 1024, one thread, 7 interleaved rounds
    python -m benchmarks.matmul_units --n 2048 --threads 2

PyTorch: ``torch.mm`` in fp32 and bf16 (oneDNN: AMX or AVX512-BF16 where the CPU has them). ONNX Runtime's
CPU provider: ``MatMul`` in fp32, fp16 and bf16, and ``MatMulInteger`` (uint8 x int8, int32 out: the
product of a dynamically quantised int8 export, on VNNI or AMX int8 kernels where MLAS has them). A
precision the provider has no kernel for is reported with its one-line error instead of a rate.

All sides take turns in the same process (``benchmarks.timing.interleaved``); each figure is the median
GFLOP/s (2n³ per product) and its ratio to PyTorch fp32 in the same run.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from benchmarks.machine import machine_info, matmul_fn
from benchmarks.timing import interleaved
from vitattn.precision import cpu_bf16_units


def _ort_product(n: int, kind: str, threads: int) -> Callable[[], Any]:
    """One ONNX Runtime CPU-provider product of two (n, n) matrices of ``kind``; raises where it has no kernel."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    if kind == "int8":
        types, out, op = (TensorProto.UINT8, TensorProto.INT8), TensorProto.INT32, "MatMulInteger"
        feed = {"a": rng.integers(0, 255, (n, n), dtype=np.uint8), "b": rng.integers(-127, 127, (n, n), dtype=np.int8)}
    else:
        onnx_type = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}[kind]
        types, out, op = (onnx_type, onnx_type), onnx_type, "MatMul"
        values = rng.standard_normal((2, n, n)).astype(np.float32)
        if kind == "bf16":  # numpy has no bfloat16: the top half of each float32, as ONNX stores it
            feed = {"a": values[0].view(np.uint32) >> 16, "b": values[1].view(np.uint32) >> 16}
            feed = {k: v.astype(np.uint16) for k, v in feed.items()}
        else:
            feed = {"a": values[0].astype(np.float16 if kind == "fp16" else np.float32), "b": values[1]}
            feed["b"] = feed["b"].astype(feed["a"].dtype)
    inputs = [helper.make_tensor_value_info(name, t, [n, n]) for name, t in zip("ab", types)]
    graph = helper.make_graph(
        [helper.make_node(op, ["a", "b"], ["y"])], "product", inputs, [helper.make_tensor_value_info("y", out, None)]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    if kind == "bf16":  # ONNX Runtime takes bf16 inputs only as OrtValues
        feed = {k: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(v, TensorProto.BFLOAT16) for k, v in feed.items()}
    return lambda: session.run(None, feed)


def measure(n: int, threads: int, repeats: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Rows ``{runtime, precision, gflops, vs_torch_fp32}`` and the sides that could not run, with their reason."""
    torch.set_num_threads(threads)
    sides: dict[str, Callable[[], Any]] = {
        "PyTorch fp32": matmul_fn(n, dtype=torch.float32),
        "PyTorch bf16": matmul_fn(n, dtype=torch.bfloat16),
    }
    missing = {}
    for kind in ("fp32", "fp16", "bf16", "int8"):
        name = f"ONNX Runtime {kind}"
        try:
            sides[name] = _ort_product(n, kind, threads)
            sides[name]()
        except Exception as err:  # noqa: BLE001 - the provider's own one-line reason is the finding
            sides.pop(name, None)
            missing[name] = str(err).splitlines()[0]
    seconds = interleaved(sides, repeats=repeats, warmup=2, min_time=0.2)
    base = statistics.median(seconds["PyTorch fp32"])
    rows = []
    for name, samples in seconds.items():
        runtime, precision = name.rsplit(" ", 1)
        median = statistics.median(samples)
        rows.append(dict(runtime=runtime, precision=precision, gflops=2 * n**3 / median / 1e9, vs=base / median))
    return rows, missing


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rows, missing = measure(args.n, args.threads, args.repeats)
    cpu = machine_info(args.threads).get("cpu", "?")
    units = ", ".join(cpu_bf16_units()) or "none"
    print(f"{cpu}; bf16 units: {units}; {args.threads} thread(s); n = {args.n}")
    print("| runtime | precision | GFLOP/s | vs PyTorch fp32 |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['runtime']} | {r['precision']} | {r['gflops']:.0f} | {r['vs']:.2f}x |")
    for name, reason in missing.items():
        print(f"| {name.rsplit(' ', 1)[0]} | {name.rsplit(' ', 1)[1]} | no kernel: {reason} | |")


if __name__ == "__main__":
    main()
