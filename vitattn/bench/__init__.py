"""Speed of vitattn against timm and Hugging Face: the code behind ``scripts/bench.py``.

One module per section (``encoder``, ``compile``, ``caption``, ``scaling``, ``e2e``) over shared
timing (``timing``, ``env``), workloads (``workloads``, ``flops``, ``machine``) and output
(``report``); ``cli`` parses the arguments and runs the sections. Nothing here imports
``transformers`` (the ``bench`` extra) until the caption section runs. See docs/benchmarks.md.
"""
