"""benchmarks/transfer_bench.py: its runs on tiny settings, its table and its doc update."""

import json
from subprocess import CompletedProcess

import pytest
from safetensors.torch import load_file

from benchmarks import cli, transfer_bench
from benchmarks.report import update_doc

TINY = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "data.img_size=32", "data.num_val=16"]
LR = 2e-3  # conf/train.yaml's optim.lr, which the bench keeps


def _encoder(run_dir) -> dict:
    """The encoder tensors of a run's bundle (a classifier's without its head)."""
    state = load_file(f"{run_dir}/bundle/model.safetensors")
    if any(k.startswith("encoder.") for k in state):
        return {k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")}
    return {k: v for k, v in state.items() if not k.startswith("head.")}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_bench_captions_three_ways_and_transfers_the_classifiers_encoder(tmp_path, monkeypatch):
    steps = 3
    out = tmp_path / "transfer.json"
    argv = ["--pretrain-steps", "4", "--steps", str(steps), "--batch-size", "8", "--jobs", "2", "--out", str(out)]
    tiny = ["--vitattn-args", *TINY, f"optim.lr={LR}"]
    result = cli.main(["transfer", *argv, *tiny])
    rows = result["rows"]
    assert [r["arm"] for r in rows] == ["scratch", "pretrained", "frozen"]
    assert all(r["steps"] == steps for r in rows)
    for r in rows:
        assert set(transfer_bench.TABLE_METRICS) <= r["metrics"].keys()
        assert 0 <= r["metrics"]["bleu4"] <= 1 and 0 <= r["metrics"]["exact_match"] <= 1
    table = result["table"].splitlines()
    for name in transfer_bench.ARM_NAMES.values():
        assert sum(line.startswith(f"| {name} | 0 |") for line in table) == 1
    assert json.loads(out.read_text())["rows"] == rows

    pretrain = result["pretrain"][0]["run_dir"]
    scratch, pretrained, frozen = rows
    assert scratch["loaded"] == ""
    for r in (pretrained, frozen):
        assert (
            r["loaded"].startswith("pretrained encoder: loaded ") and f"classification model {pretrain}" in r["loaded"]
        )
        assert f"finetune.init={pretrain} finetune.init_kind=encoder" in r["command"]
    classifier = _encoder(pretrain)
    assert _max_diff(_encoder(frozen["run_dir"]), classifier) == 0  # frozen from the first step to the last
    # AdamW moves a weight by about lr a step (at most ~lr early on): the fine-tuned encoder started from
    # the classifier's, and trained; the scratch one started elsewhere.
    moved = _max_diff(_encoder(pretrained["run_dir"]), classifier)
    assert 0 < moved <= 2 * LR * steps
    assert _max_diff(_encoder(scratch["run_dir"]), classifier) > 2 * LR * steps

    def no_run(*args, **kwargs):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(transfer_bench.subprocess, "run", no_run)
    again = cli.main(["transfer", *argv, *tiny])  # the same overrides: every run is kept
    assert [r["metrics"] for r in again["rows"]] == [r["metrics"] for r in rows]

    launched = []  # another classifier in the same folder: it and every caption run on it run again
    monkeypatch.setattr(
        transfer_bench.subprocess, "run", lambda cmd, **kw: launched.append(cmd) or CompletedProcess(cmd, 0)
    )
    cli.main(["transfer", *argv, "--pretrain-steps", "5", *tiny])
    heads = [next(a for a in cmd if a.startswith("head=")) for cmd in launched]
    assert heads == ["head=classification", "head=caption", "head=caption", "head=caption"]


def _row(seed: int, arm: str, bleu4: float, exact: float) -> dict:
    metrics = {"bleu4": bleu4, "cider_d": 10 * bleu4, "exact_match": exact, "loss": 1 - bleu4}
    return {"seed": seed, "arm": arm, "metrics": metrics, "steps": 300, "seconds": 12.0}


def test_table_has_a_row_per_seed_and_arm_and_the_spread_of_several_seeds():
    rows = [
        _row(s, arm, 0.1 * (i + 1) + 0.01 * s, 0.2 * s) for s in (0, 1) for i, arm in enumerate(transfer_bench.ARMS)
    ]
    lines = transfer_bench.format_table(rows).splitlines()
    assert len(lines) == 2 + 6 + 3
    assert lines[2] == "| from scratch | 0 | 0.100 | 1.000 | 0.0 % | 0.900 | 300 | 12 |"
    assert lines[-1] == (
        "| **pretrained, frozen** | mean (min-max) | 0.305 (0.300-0.310) | 3.050 (3.000-3.100) | "
        "10.0 % (0.0-20.0) | 0.695 (0.690-0.700) |  |  |"
    )
    one_seed = transfer_bench.format_table(rows[:3]).splitlines()
    assert len(one_seed) == 2 + 3 and "mean" not in "".join(one_seed)


def test_doc_update_replaces_only_between_the_markers(tmp_path):
    doc = tmp_path / "transfer.md"
    start, end = transfer_bench.DOC_START, transfer_bench.DOC_END
    doc.write_text(f"intro\n{start}\nold table\n{end}\nreading\n")
    update_doc(doc, start, end, "new table")
    assert doc.read_text() == f"intro\n{start}\nnew table\n{end}\nreading\n"
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="has no <!-- transfer-bench:table:start -->"):
        update_doc(doc, start, end, "new table")
    assert doc.read_text() == "no markers\n"


@pytest.mark.parametrize("option", ["--steps", "--pretrain-steps", "--batch-size", "--threads"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_counts_below_one_are_refused(option, value):
    args = cli.parser().parse_args(["transfer", option, value])
    with pytest.raises(ValueError, match=f"^{option} {value} must be at least 1$"):
        transfer_bench.config_from(args)
