"""vitattn's benchmarks: outside the package (not in the wheel), importing vitattn as a user would.

``python -m benchmarks SECTION [options]`` from the repository root; ``benchmarks.cli`` holds the registry of
sections and the one parser. The speed section's parts (``encoder``, ``compile``, ``caption``, ``scaling``,
``e2e``) share workloads (``workloads``, ``flops``, ``machine``); every timed section shares the timing
(``timing``, ``env``) and the report (``report``). Nothing imports ``transformers`` (the ``bench`` extra)
until the caption part runs.
"""
