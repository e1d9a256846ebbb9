"""Smoke tests of the speed bench (python -m benchmarks): its measurement helpers and its JSON, at tiny sizes."""

import ast
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import cli, steps, timing, workloads
from benchmarks.caption_bench import given_memory
from benchmarks.flops import counted_flops, vit_flops
from benchmarks.machine import matmul_gflops
from benchmarks.report import SCHEMA, STATUSES, TARGETS, compare, format_table, pending_row, row, status
from benchmarks.timing import interleaved, paired_speedup
from benchmarks.workloads import forced_length
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)


@pytest.fixture
def tiny_bench(monkeypatch):
    """The bench's model sizes shrunk to tiny ones (same code paths)."""
    monkeypatch.setattr(
        workloads,
        "ENCODERS",
        {
            "vit_ti16_224": dict(img_size=32, patch_size=16, embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0),
            "vit_192d6_32px": dict(TINY),
        },
    )
    monkeypatch.setattr(workloads, "ENCODER_BATCH", {"vit_ti16_224": 2, "vit_192d6_32px": 2})
    monkeypatch.setattr(
        workloads, "CAPTION_DECODER", dict(vocab_size=40, embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0, max_len=8)
    )
    monkeypatch.setattr(workloads, "CAPTION_BATCH", 2)
    monkeypatch.setattr(workloads, "CAPTION_TOKENS", 5)


def test_interleaved_calls_round_robin():
    calls = []
    samples = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=2)
    assert calls == ["a", "b", "b", "a"] * 2 + ["a", "b"]  # 2 warm-up + 3 timed rounds, order reversed every other
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3}
    assert all(s >= 0 for v in samples.values() for s in v)


def test_interleaved_min_time_sizes_an_inner_loop_and_reports_per_call(monkeypatch):
    now = [0.0]  # a clock that each call moves by 2 ms: no wall-clock time in the test
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    calls = []

    def two_ms() -> None:
        calls.append(1)
        now[0] += 0.002

    samples = interleaved({"s": two_ms}, repeats=2, warmup=1, min_time=0.05)["s"]
    assert len(calls) == 1 + 2 * 25  # one warm-up call, then 0.05 / 0.002 = 25 calls per sample
    assert samples == pytest.approx([0.002, 0.002])  # seconds per call, not per sample
    with pytest.raises(ValueError, match="warmup=0 and repeats=5 must be at least 1"):
        interleaved({"s": two_ms}, warmup=0)


def test_paired_speedup_is_median_of_round_ratios():
    assert paired_speedup([1.0, 2.0, 1.0], [2.0, 2.0, 3.0]) == 2.0  # ratios 2, 1, 3
    assert paired_speedup([2.0], [1.0]) == 0.5  # ours twice as slow
    with pytest.raises(ValueError, match=r"need the same number \(>0\) of samples, got 1 and 2"):
        paired_speedup([1.0], [1.0, 2.0])


def test_compare_row_ratio_status_and_table():
    fast = compare("fwd", [0.5, 0.5, 0.5], [1.0, 1.0, 1.0], 10, "img/s", "forward", "timm eager")
    assert (fast["ours"], fast["ref"], fast["ratio"], fast["status"]) == (20.0, 10.0, 2.0, "PASS")
    assert fast["note"] == "IQR 2.000-2.000"
    tie = compare("fwd", [1.0, 1.0, 1.0], [0.98, 1.0, 1.03], 1, "img/s", "forward", "timm eager")
    assert tie["status"] == "PASS" and "within noise" in tie["note"]
    slow = compare("fwd", [1.0, 1.0], [0.9, 0.9], 1, "img/s", "compiled", "timm eager")
    assert slow["status"] == "MISS" and slow["target"] == TARGETS["compiled"] == 1.15
    info = row("gflops", 5.0, 10.0, "GFLOP/s", 0.5, None, "matmul rate", percent=True)
    assert info["status"] == "info"
    assert status(None, 1.0) == "error" and status(0.8, 0.8) == "PASS"
    table = format_table([fast, info, pending_row("e2e", "e2e", "pending: no module")])
    assert "| fwd | 20.0 img/s | 10.0 img/s (timm eager) | 2.000x | >= 1.00x | PASS |" in table
    assert "| 50 % | - | info |" in table and "| pending | pending: no module |" in table


def test_vit_flops_match_the_flop_counter_on_the_explicit_path():
    # The explicit attention path runs plain matmuls, which FlopCounterMode counts (CPU flash attention it does not).
    model = VisionTransformer(**TINY, num_classes=3, fused_attn=False).eval()
    x = torch.randn(2, 3, 32, 32)
    assert counted_flops(lambda: model(x)) == 2 * vit_flops(**TINY, num_classes=3)
    assert vit_flops(**workloads.ENCODERS["vit_ti16_224"]) == pytest.approx(2.5e9, rel=0.02)  # ViT-Ti/16: 1.26 GMACs


def test_matmul_rate_is_positive():
    mm = matmul_gflops(n=64, repeats=2)
    assert mm["gflops"] > 0 and len(mm["seconds"]) == 2


@pytest.mark.parametrize("num_beams", [1, 2])
def test_forced_length_and_given_memory_generate_exactly_n_tokens(num_beams):
    dec = CaptionDecoder(vocab_size=30, embed_dim=32, depth=1, num_heads=2, max_len=10, drop_rate=0.0)
    model = ImageCaptioner(VisionTransformer(**TINY), dec).eval()
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():  # make <eos> the likeliest token everywhere, so that forcing the length is needed
        dec.norm.bias.fill_(1.0)
        dec.head.weight[dec.eos_id] = 1.0
    assert model.generate(images, max_new_tokens=9, num_beams=num_beams).shape[1] < 9  # <eos> does end it
    with forced_length(dec):
        free = model.generate(images, max_new_tokens=9, num_beams=num_beams)
        with given_memory(model, model.encode(images)):
            given = model.generate(torch.empty(0), max_new_tokens=9, num_beams=num_beams)
    assert free.shape == (3, 9) and dec.eos_id == 2 and "encode" not in vars(model)
    torch.testing.assert_close(given, free)


@pytest.mark.slow
def test_main_writes_the_json_schema_and_plot(tiny_bench, tmp_path):
    sections = ["encoder", "scaling", "e2e"]  # caption (Hugging Face): test_main_times_captions_against_hugging_face
    out = tmp_path / "bench.json"
    result = cli.main(
        ["--quick", "--no-compile", "--repeats", "2", "--min-time", "0", "--out", str(out), "--sections", *sections]
    )
    saved = json.loads(out.read_text())
    assert saved["schema"] == SCHEMA and saved["machine"]["torch_threads"] == 1
    assert saved["matmul"]["gflops"] > 0 and set(saved["targets"]) == set(TARGETS)
    keys = {"name", "ours", "ref", "unit", "ratio", "target", "status", "note"}
    for r in saved["rows"]:
        assert keys <= set(r) and r["status"] in STATUSES, r
        if r["status"] in ("PASS", "MISS"):
            assert r["ratio"] > 0 and (r["status"] == "PASS") == (r["ratio"] >= r["target"])
    names = [r["name"] for r in saved["rows"]]
    assert sum(n.startswith(("forward ", "train step ")) for n in names) == 8  # 4 rows x 2 CPU encoders
    mfu = [r for r in saved["rows"] if r["name"].startswith("train step MFU")]
    assert len(mfu) == 2 and all(0 < r["ratio"] < 1.5 for r in mfu)  # a share of the measured matmul rate
    assert "vit_b16_224 b128" not in " ".join(names)  # ViT-B/16 runs on GPUs only
    assert all(d["max_abs_diff_vs_timm"] < 1e-4 for d in saved["details"]["encoder"].values())  # same network
    assert Path(saved["scaling"]["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["batch"] for r in saved["scaling"]["by_batch"]] == [1, 4, 8]
    e2e = [r for r in saved["rows"] if r["name"].startswith("end-to-end")]
    assert len(e2e) == 1 and e2e[0]["status"] in ("PASS", "MISS", "pending")
    assert result["rows"] == saved["rows"]


@pytest.mark.slow
def test_main_times_captions_against_hugging_face(tiny_bench, tmp_path):
    """The caption section, against Hugging Face's VisionEncoderDecoder. transformers comes with .[dev] (the
    bench extra): without it this test is a skip, which fails CI (tests/helpers/skip_policy.py), never rows left out."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[dev]'")
    out = tmp_path / "bench.json"
    cli.main(
        ["--quick", "--no-compile", "--repeats", "2", "--min-time", "0", "--out", str(out), "--sections", "caption"]
    )
    saved = json.loads(out.read_text())
    caption = [r for r in saved["rows"] if r["name"].startswith("caption")]
    assert len(caption) == 6 and all(r["status"] in ("PASS", "MISS", "info") for r in caption), caption
    beam = saved["details"]["caption"]["decode only, beam 3"]
    assert beam["new_tokens"] == 5 and set(beam["seconds"]) == {"ours_cached", "ours_recompute", "hf"}
    assert all(seconds and min(seconds) > 0 for seconds in beam["seconds"].values()), beam


@pytest.mark.slow
def test_merge_section_times_each_r_against_unmerged_and_timm_and_captions_against_both(tiny_bench, tmp_path):
    """``python -m benchmarks merge``: every R's forward row against timm (the target row at R=16 on ViT-S/16) and
    against ours unmerged, in one run; captions and the training step at the largest R."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[dev]'")
    from benchmarks import merge_bench

    small = dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)  # 65 tokens
    workloads.ENCODERS["vit_s16_224"] = small
    out = tmp_path / "merge.json"
    cli.main(["merge", "--quick", "--repeats", "1", "--sizes", "vit_s16_224", "--merge", "4", "16", "--out", str(out)])
    saved = json.loads(out.read_text())
    names = [r["name"] for r in saved["rows"]]
    assert names == [
        f"forward vit_s16_224 b{merge_bench.CPU_BATCH['vit_s16_224']} R={r} vs {ref}"
        for r in (4, 16)
        for ref in ("timm", "unmerged")
    ] + [f"captions vit_s16_224 beam 3 b8 R=16 vs {ref}" for ref in ("unmerged", "HF")] + [
        f"train step vit_s16_224 b8 R=16 vs {ref}" for ref in ("unmerged", "timm")
    ]
    kinds = {r["name"]: r["kind"] for r in saved["rows"]}
    assert kinds["forward vit_s16_224 b8 R=16 vs timm"] == "merge_forward"
    assert kinds["captions vit_s16_224 beam 3 b8 R=16 vs unmerged"] == "merge_captions"
    encoder = saved["details"]["encoder vit_s16_224"]
    assert encoder["tokens_out"] == {"4": 65 - 8, "16": 65 - 2 * 16}  # what each merged copy really ran
    assert set(encoder["seconds"]) == {"timm", "ours", "R=4", "R=16"}


def test_candidates_section_times_k_candidates_against_greedy_with_the_encoder_decode_split(tiny_bench, tmp_path):
    """``python -m benchmarks candidates``: one row per size, the bound greedy + K x decode x 1.1 over K
    candidates' time, from the encoder, greedy and candidate samples of the same rounds."""
    from benchmarks import candidates

    small = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0)
    sizes = {"model_cpu": (small, 2), "vit_s16_224": (small, 3)}
    out = tmp_path / "candidates.json"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(candidates, "SIZES", sizes)
        cli.main(["candidates", "--quick", "--repeats", "1", "-k", "3", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [r["kind"] for r in saved["rows"]] == ["candidates", "candidates"]
    for name, B in (("model_cpu", 2), ("vit_s16_224", 3)):
        d = saved["details"][name]
        assert (d["k"], d["images"], set(d["seconds"])) == (3, B, {"encoder", "greedy", "K=3"})
        seconds = {k: statistics.median(v) for k, v in d["seconds"].items()}
        assert d["greedy_decode_s"] == pytest.approx(seconds["greedy"] - seconds["encoder"])
        assert d["bound_s"] == pytest.approx(seconds["greedy"] + 3 * d["greedy_decode_s"] * candidates.SLACK)
        row = next(r for r in saved["rows"] if name in r["name"])
        assert row["ratio"] == pytest.approx(d["bound_s"] / seconds["K=3"])


# A Python in which transformers is not installed, though it is (it comes with .[dev]): `import transformers`
# raises (a None entry in sys.modules) and its metadata is not found (torchmetrics, imported by Lightning, asks
# importlib.metadata whether transformers is installed before importing it).
WITHOUT_TRANSFORMERS = (
    "import importlib.metadata as md, sys; sys.modules['transformers'] = None; _version = md.version\n"
    "def version(name):\n"
    "    if name.lower() == 'transformers':\n"
    "        raise md.PackageNotFoundError(name)\n"
    "    return _version(name)\n"
    "md.version = version\n"
)


@pytest.mark.slow
def test_script_runs_without_transformers_imported():
    # `transformers` is the optional `bench` extra: no module of the bench may import it on import, and
    # `python -m benchmarks` still runs without it.
    code = WITHOUT_TRANSFORMERS + (
        "import runpy; sys.argv = ['benchmarks', 'speed', '--help'];"
        "runpy.run_module('benchmarks', run_name='__main__', alter_sys=True)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--sections {encoder,compile,caption,scaling,e2e}" in proc.stdout and "--no-compile" in proc.stdout
    assert proc.stdout.split("\n\n")[1].startswith("Speed of vitattn against timm and Hugging Face")


def test_python_m_benchmarks_matmul_prints_the_fp32_rate_at_the_threads_asked(capsys):
    from benchmarks.cli import main

    threads = torch.get_num_threads()
    try:
        main(["matmul", "--threads", "1", "--size", "64", "--repeats", "2"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    match = re.fullmatch(
        r"matmul rate: ([0-9.]+) GFLOP/s \(fp32 torch\.mm 64x64, 1 torch threads, median of 2\)\n", out
    )
    assert match and float(match.group(1)) > 0, out
    with pytest.raises(SystemExit, match="^2$"):
        main(["matmul", "--threads", "0"])
    assert "--threads=0 must be at least 1" in capsys.readouterr().err


def test_benchmarks_use_vitattn_as_a_user_would():
    # benchmarks/ sits outside the package: it imports only vitattn's public names, and nothing in vitattn
    # imports it back (the wheel does not ship it).
    private = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vitattn"):
                names = [node.module, *(alias.name for alias in node.names)]
                private += [
                    f"{path.name}: {node.module}.{n}" for n in names if any(p.startswith("_") for p in n.split("."))
                ]
    assert not private, private
    climbing = [
        str(p)
        for p in (ROOT / "vitattn").rglob("*.py")
        if re.search(r"^\s*(from|import) benchmarks", p.read_text(), re.M)
    ]
    assert not climbing, climbing


@pytest.mark.slow
def test_train_memory_sees_the_smaller_step_peak_of_grad_checkpointing_in_fresh_processes():
    """Four processes at a small size: checkpointing's step peak is under 0.6x (0.36x measured); a process
    that reused the memory of its first step (glibc's dynamic mmap threshold) would show about 1x."""
    shape = ["--model", "cpu", "--img-size", "64", "--batch-size", "16", "--steps", "1", "--repeats", "2"]
    result = cli.main(["train", *shape, "--memory", "--grad-checkpointing"])
    runs = result["runs"]
    assert [len(runs[s]) for s in ("flagged", "plain")] == [2, 2]
    for on, off in zip(runs["flagged"], runs["plain"]):
        assert 0 < on["step_peak_mib"] < 0.6 * off["step_peak_mib"] < off["process_peak_mib"]
    step_peak = result["rows"][0]
    assert step_peak["name"].startswith("step_peak_mib") and step_peak["ratio"] < 0.6
    assert "--grad-checkpointing" in step_peak["note"] and "on / off" not in step_peak["note"]


@pytest.mark.parametrize("section", ["train", "infer"])
@pytest.mark.parametrize("flags", [["--channels-last"], ["--precision", "bf16"], ["--grad-checkpointing"]])
def test_train_and_infer_time_the_flagged_model_against_the_plain_one(section, flags):
    argv = [section, "--model", "cpu", "--img-size", "32", "--batch-size", "2", "--repeats", "2", *flags]
    result = cli.main(argv)
    ((r,),) = [result["rows"]]
    assert r["ours"] > 0 and r["ref"] > 0 and r["ratio"] > 0 and r["unit"] == "img/s" and r["ref_name"] == "plain"
    assert flags[0] in r["note"] and result["flags"] in r["note"] and result["argv"] == argv[1:]
    assert [len(v) for v in result["seconds"].values()] == [2, 2]


def test_train_flags_change_the_flagged_model_only():
    args = cli.parser().parse_args(["train", "--model", "cpu", "--img-size", "32", "--channels-last"])
    for flagged in (True, False):
        model, images, _ = steps._build(args, flagged)
        layout = torch.channels_last if flagged else torch.contiguous_format
        assert images.is_contiguous(memory_format=layout)
        assert model.patch_embed.proj.weight.is_contiguous(memory_format=layout)


def test_naflex_section_counts_valid_tokens_and_times_native_against_square_and_the_mask(tmp_path):
    """``python -m benchmarks naflex``: the set's valid patches and padded shares as counted by hand from its grids,
    each tokens/s ratio the images/s ratio times the two arms' tokens, and the mask (every token valid) changing no
    output of the layers it is timed on."""
    from benchmarks import naflex_bench

    out = tmp_path / "naflex.json"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(naflex_bench, "ENCODER", dict(TINY))  # a 4 x 4 table: 16 patches
        m.setattr(naflex_bench, "DECODER", dict(vocab_size=40, embed_dim=32, depth=1, num_heads=2, max_len=8))
        argv = [
            "--repeats",
            "1",
            "--min-time",
            "0",
            "--budget",
            "16",
            "--batch",
            "3",
            "--images",
            "12",
            "--tokens",
            "3",
        ]
        cli.main(["naflex", *argv, "--out", str(out)])
    saved = json.loads(out.read_text())
    rows = {r["name"]: r for r in saved["rows"]}
    lengths = [r * c for r, c in naflex_bench.mixed_grids(12, 16)]
    assert max(lengths) <= 16 and len(set(lengths)) > 1  # within the budget, not one grid for all
    assert rows["valid patches per image"]["ratio"] == pytest.approx(sum(lengths) / 12 / 16)
    share = [1 - sum(b) / (3 * max(b)) for b in (lengths[i : i + 3] for i in range(0, 12, 3))]
    assert rows["padded share, batches of 3 in order"]["ratio"] == pytest.approx(sum(share) / 4)
    train = saved["details"]["train_step"]
    assert train["tokens"] == [sum(lengths[:3]), 3 * 16]
    tokens, images = rows["train step b3, patch tokens/s"], rows["train step b3, images/s"]
    assert tokens["ratio"] == pytest.approx(images["ratio"] * sum(lengths[:3]) / 48)
    assert saved["details"]["mask"]["max_abs_diff"] < 1e-5
    assert set(saved["details"]["captions"]["seconds"]) == {"native", "square"}
    assert train["max_abs_diff"] < 1e-5 and train["packed_rows"] == 1  # three images of at most 17 tokens in 68
    assert rows["padded share, b3 packed in 1 rows of 68"]["ratio"] == pytest.approx(1 - (sum(lengths[:3]) + 3) / 68)


def test_packed_rows_give_each_image_its_logits_alone():
    """NaViT's packing (``naflex_bench.packing``): images of different grids several to a row, each image's class
    logits equal to that image run alone (its own batch of one, no padding) within 1e-5."""
    from benchmarks import naflex_bench
    from vitattn.data.preprocess import pad_patches, patchify
    from vitattn.models.vit import Patches

    torch.manual_seed(0)
    model = VisionTransformer(**TINY, num_classes=5).eval()
    grids = [(4, 4), (2, 3), (1, 4), (3, 2), (4, 1), (2, 2)]  # 16, 6, 4, 6, 4, 4 patches
    images = [patchify(torch.randn(3, 8 * r, 8 * c), 8) for r, c in grids]
    batch = pad_patches(images)
    pack = naflex_bench.packing(torch.nn.functional.pad(batch.valid, (1, 0), value=True), 20)
    assert pack.mask.shape[0] < len(grids) - 1  # several images share a row
    with torch.no_grad():
        packed = naflex_bench.packed_logits(model, batch, pack)
        alone = torch.cat(
            [model(Patches(p[None], c[None], torch.ones(1, len(p), dtype=torch.bool))) for p, c in images]
        )
    assert alone.std(0).min() > 1e-3  # the images' logits differ
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
