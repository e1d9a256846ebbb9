"""What a user sees from ``vitattn-train``: each line once, no warnings about our own defaults."""

import collections
import os
import re
import subprocess

import pytest

from tests.helpers.runs import console_script

# "[2026-12-01 04:29:16,616][lightning.fabric.utilities.seed][INFO] - " (Hydra's) or "INFO: " (Lightning's own)
LOG_PREFIX = re.compile(r"^(\[[^]]*\]\[[^]]*\]\[[A-Z]+\] - |[A-Z]+: )")
# "/.../model_checkpoint.py:588: `ModelCheckpoint(...)` could not find ...": a warning as Lightning prints it
PY_WARNING = re.compile(r"\.py:\d+: ")


@pytest.mark.slow
def test_a_short_default_run_prints_each_line_once_and_no_warning(tmp_path):
    args = ["trainer.max_steps=3", "test=false", "export_bundle=false", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONWARNINGS": "default"}  # show every warning once, as a fresh shell would
    proc = subprocess.run(
        [str(console_script("vitattn-train")), *args], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    lines = [LOG_PREFIX.sub("", line).strip() for line in output.splitlines()]
    counts = collections.Counter(line for line in lines if line and not line.startswith(("Epoch ", "━")))
    assert [line for line, n in counts.items() if n > 1] == [], output
    noisy = [
        line
        for line in output.splitlines()
        if "WARNING" in line or "Warning:" in line or "litlogger" in line or PY_WARNING.search(line)
    ]
    assert noisy == [], output
    assert "Seed set to 42" in output and "Total FLOPs: 0" not in output  # Lightning speaks once; FLOPs are counted
