#!/usr/bin/env bash
# The GPU checks in one short run (for a machine with a CUDA GPU; not run in CI):
#   1. the test suite's fast part on the GPU machine's torch,
#   2. the bench on CUDA: ViT-Ti/16, the 32 px config and ViT-B/16 (batch 128) forward and
#      training step vs timm under bf16 autocast, with MFU against the bf16 matmul rate measured
#      in the same run, cached decoding vs recompute,
#   3. two training steps of the caption head with trainer=gpu (bf16-mixed, compile=auto),
#   5. a ViT-B/16 classifier's bf16-mixed training throughput on one GPU (224 px, batch 64), with gradient
#      checkpointing off and on: the run's steps/s and its model FLOPs utilisation against the bf16 matmul
#      rate of step 2,
#   6. captioning images/s from shards (3,000 shapes images in 6 shards) on one GPU,
#   7. channels_last against NCHW (forward and training step, bf16 autocast: `python -m benchmarks infer|train
#      --channels-last`); the device's normalisation is bit for bit the CPU's (tests/training/test_device_input.py
#      on CUDA).
#   8. the GPU defaults: trainer.precision=auto and precision=auto against the device's compute capability,
#      float32_matmul_precision=auto (TF32), and FSDP2 under bf16-mixed gathering weights in bf16
#      (tests/test_precision.py and tests/training/test_sharding.py's one-process tests, on CUDA),
#   9. token merging (ToMe): ViT-S/16 and ViT-B/16 forward at R in {4, 8, 13, 16} against unmerged and timm,
#      ViT-S/16 captions (beam 3, cache) and training step merged against unmerged (`python -m benchmarks merge`).
# Results go to ${OUT:-bench_results}/.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench_results}"
mkdir -p "$out"
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/gpu.txt"
python -m pytest -q -m "not slow" -x tests/layers/test_layers.py tests/models/test_models.py 2>&1 | tail -3 | tee -a "$out/gpu.txt"
python -m benchmarks --device cuda --threads 8 --sections encoder caption --out "$out/bench_gpu.json" \
  2>&1 | tee "$out/bench_gpu.txt"
python -m benchmarks merge --device cuda --threads 8 --out "$out/merge_gpu.json" 2>&1 | tail -20 | tee "$out/merge_gpu.txt"
python -m vitattn.cli.train trainer=gpu trainer.max_steps=20 test=false export_bundle=false \
  logger=csv paths.runs_dir="$out/runs" trainer.enable_progress_bar=false 2>&1 | tail -20 | tee -a "$out/gpu.txt"
for ckpt in false true; do
  python -m vitattn.cli.train head=classification model=base data.img_size=224 data.batch_size=64 \
    data.num_train=8192 data.num_val=64 data.num_test=64 trainer=gpu trainer.devices=1 trainer.max_steps=60 \
    trainer.limit_val_batches=0 test=false export_bundle=false logger=csv model.grad_checkpointing=$ckpt \
    paths.runs_dir="$out/runs" trainer.enable_progress_bar=false 2>&1 \
    | grep -E "^speed:" | sed "s/^/vit-b16 224 bf16-mixed batch 64 grad_checkpointing=$ckpt: /" | tee -a "$out/gpu.txt"
done
python - "$out/gpu.txt" <<'PY' | tee -a "$out/gpu.txt"
import re, sys
from benchmarks.flops import vit_flops
text = open(sys.argv[1]).read()
flops = 3 * 64 * vit_flops(img_size=224, patch_size=16, embed_dim=768, depth=12, mlp_ratio=4.0)  # fwd + bwd
for ckpt, rate in re.findall(r"grad_checkpointing=(\w+): speed: +([0-9.]+) steps/s", text):
    print(f"vit-b16 training grad_checkpointing={ckpt}: {float(rate) * flops / 1e12:.1f} TFLOP/s of model FLOPs "
          "(MFU: against the bf16 matmul rate of bench_gpu.txt)")
PY
python -m vitattn.cli.write_shards source=shapes split=val count=3000 samples_per_shard=500 img_size=64 \
  out="$out/shards" > /dev/null
model=$(ls -d "$out"/runs/caption/*/ | tail -1)
start=$(date +%s.%N)
python -m vitattn.cli.caption model="$model" shards="$out/shards" out="$out/shard_captions/" devices=1 > /dev/null
end=$(date +%s.%N)
python -c "print(f'captions from shards on one GPU: {3000 / ($end - $start):.0f} images/s (3,000 images, start-up included)')" \
  | tee -a "$out/gpu.txt"
for section in infer train; do
  python -m benchmarks $section --channels-last --precision bf16 --model base --img-size 224 --batch-size 64 \
    --device cuda --threads 8 --repeats 5 2>&1 | tee -a "$out/channels_last_gpu.txt"
done
python -m pytest -q -x tests/training/test_device_input.py -k "normalize or eval_transform or cuda" 2>&1 | tail -2 | tee -a "$out/gpu.txt"
python - <<'PY' | tee -a "$out/gpu.txt"
import torch
from vitattn.precision import cuda_bf16, resolve_precision
from vitattn.training.build import set_matmul_precision
from vitattn.training.config import compose_train
from vitattn.training.plan import resolve
plan = resolve(compose_train(["trainer=gpu", "trainer.precision=auto", "paths.output_dir=gpu_check_run"]))
print(f"compute capability {torch.cuda.get_device_capability()}: cuda_bf16={cuda_bf16()}, "
      f"precision=auto -> {resolve_precision('auto', 'cuda')}, trainer.precision=auto -> {plan.cfg.trainer.precision}, "
      f"float32_matmul_precision=auto -> {set_matmul_precision(plan)}")
PY
python -m pytest -q -x tests/training/test_sharding.py -k "gathered_in_bf16 or shard_layers_makes" 2>&1 | tail -2 | tee -a "$out/gpu.txt"
