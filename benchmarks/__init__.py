"""vitattn's benchmarks and load tests: outside the package (not in the wheel), importing vitattn as a user would.

Run each from the repository root:

    python -m benchmarks [--quick] ...          # speed against timm and Hugging Face (docs/benchmarks.md)
    python -m benchmarks matmul [--threads N]   # this machine's fp32 matmul rate
    python -m benchmarks.learning_bench         # vitattn-train against a plain timm loop (docs/learning.md)
    python -m benchmarks.learning_data          # the learning bench's datasets, from Debian packages
    python -m benchmarks.transfer_bench         # captions on a pretrained encoder vs from scratch (docs/transfer.md)
    python -m benchmarks.load_caption           # vitattn-caption's memory and speed over many files
    python -m benchmarks.load_serve model=PATH  # load test of vitattn-serve on localhost (docs/serving.md)
    python -m benchmarks.onnx_speed             # bf16 eager, ONNX fp32 and int8 against fp32 eager (docs/benchmarks.md)
    python -m benchmarks.grad_checkpointing     # a training step's peak memory with and without gradient checkpointing
    scripts/gpu_check.sh                        # the GPU checks in one run (in scripts/, beside the project)

The speed bench is one module per section (``encoder``, ``compile``, ``caption``, ``scaling``,
``e2e``, ``data``, ``processes``) over shared timing (``timing``, ``env``), workloads
(``workloads``, ``flops``, ``machine``, ``procfs``) and output (``report``); ``cli`` parses the
arguments and runs the sections. Nothing here imports ``transformers`` (the ``bench`` extra) until
the caption section runs.
"""
