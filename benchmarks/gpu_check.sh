#!/usr/bin/env bash
# The GPU checks in one short run (for a machine with a CUDA GPU; not run in CI):
#   1. the test suite's fast part on the GPU machine's torch,
#   2. the bench on CUDA: ViT-Ti/16, the 32 px config and ViT-B/16 (batch 128) forward and
#      training step vs timm under bf16 autocast, with MFU against the bf16 matmul rate measured
#      in the same run, cached decoding vs recompute,
#   3. two training steps of the caption head with trainer=gpu (bf16-mixed, compile=auto),
#   4. vitattn-caption on 2,000 files with every GPU of the machine (devices=N, DDP) vs one.
# Results go to ${OUT:-bench_results}/.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench_results}"
mkdir -p "$out"
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/gpu.txt"
python -m pytest -q -m "not slow" -x tests/test_layers.py tests/test_models.py 2>&1 | tail -3 | tee -a "$out/gpu.txt"
python -m benchmarks --device cuda --threads 8 --sections encoder caption --out "$out/bench_gpu.json" \
  2>&1 | tee "$out/bench_gpu.txt"
python -m vitattn.cli.train trainer=gpu trainer.max_steps=20 test=false export_bundle=false \
  logger=csv paths.runs_dir="$out/runs" trainer.enable_progress_bar=false 2>&1 | tail -20 | tee -a "$out/gpu.txt"
python -m benchmarks --device cuda --sections processes --out "$out/bench_processes_gpu.json" \
  2>&1 | tail -8 | tee "$out/bench_processes_gpu.txt"
