"""ONNX folders against the PyTorch runtime, on a captioner and a classifier trained on the shapes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.helpers.onnx import check_int8_graphs
from tests.helpers.runs import CAPTION_TEST_IMAGES, LABEL_TEST_IMAGES, console_script, shapes_split
from vitattn import Captioner, Classifier
from vitattn.bundle import load_bundle
from vitattn.bundle.onnx_folder import ONNX_CONFIG_FILE, ONNX_VERSIONS
from vitattn.cli.caption import main as caption_main
from vitattn.cli.evaluate import main as eval_main
from vitattn.cli.export import main as export_main
from vitattn.data.shapes import ShapesDataset
from vitattn.data.shards import expand_shards, read_shard
from vitattn.data.shards.writer import shapes_samples, write_shards
from vitattn.errors import MissingDependencyError
from vitattn.metrics import compute_caption_metrics

pytestmark = pytest.mark.slow  # every test here needs a shared trained run (tests/conftest.py; about a minute)

pytest.importorskip("onnxruntime", reason="the onnx extra: pip install -e '.[onnx]'")

SPLIT = 200  # test-split images compared


@pytest.fixture
def caption_run(shapes_caption_run, shapes_caption_onnx):
    """The shared captioner (tests/conftest.py: 300 steps on the shapes, 158 distinct greedy captions on its 1,000
    test images) and its fp32 and int8 ONNX folders, written by vitattn-export inside the run."""
    return shapes_caption_run, shapes_caption_onnx.fp32, shapes_caption_onnx.int8


@pytest.fixture(scope="module")
def test_split():
    return shapes_split("caption", SPLIT)


def _tokens(captioner: Captioner, images: torch.Tensor, **generate) -> list[list[int]]:
    with torch.inference_mode():
        return captioner.model.generate(images, **{**captioner.bundle.generate, **generate}).tolist()


CONTROLS = {"min_new_tokens": 4, "no_repeat_ngram_size": 2, "repetition_penalty": 1.5}


@pytest.mark.parametrize(
    "generate",
    [{}, {"num_beams": 3}, CONTROLS, {"num_beams": 3, **CONTROLS}],
    ids=["greedy", "beam3", "greedy-controls", "beam3-controls"],
)
def test_onnx_fp32_captions_equal_pytorch_on_every_image(caption_run, test_split, generate):
    run, onnx_dir, _ = caption_run
    images, _ = test_split
    torch_tokens = _tokens(Captioner.load(run), images, **generate)
    onnx_captioner = Captioner.load(onnx_dir)
    assert onnx_captioner.runtime == "onnx"
    onnx_tokens = _tokens(onnx_captioner, images, **generate)
    assert len(onnx_tokens) == SPLIT
    differ = [i for i, (a, b) in enumerate(zip(torch_tokens, onnx_tokens)) if a != b]
    assert differ == [], f"{len(differ)} of {SPLIT} captions differ, first image {differ[:1]}"
    if "min_new_tokens" in generate:  # the controls hold in both runtimes
        eos = onnx_captioner.vocab.eos_id
        assert all(eos not in row[:4] for row in onnx_tokens)
        assert onnx_tokens != _tokens(onnx_captioner, images, num_beams=generate.get("num_beams", 1))


def test_onnx_fp32_step_logits_within_1e4_of_pytorch(caption_run, test_split):
    """Every decoder step's logits along PyTorch's greedy captions: the ONNX step (with its own cache)
    against one teacher-forced PyTorch pass."""
    run, onnx_dir, _ = caption_run
    images, _ = test_split
    model = load_bundle(run).model
    onnx_model = Captioner.load(onnx_dir).model
    with torch.inference_mode():
        generated = model.generate(images)  # (B, T')
        tokens = torch.cat([torch.full_like(generated[:, :1], model.decoder.bos_id), generated], dim=1)
        expected = model(images, tokens[:, :-1])  # (B, T', V)
        step = onnx_model.decode_step(onnx_model.encode(images), generated.shape[1])
        got = torch.stack([step(tokens[:, : i + 1]) for i in range(generated.shape[1])], dim=1)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


def test_onnx_int8_keeps_95_percent_of_greedy_captions_and_cider_within_2_percent(
    caption_run, shapes_caption_onnx, test_split
):
    _, onnx_dir, int8_dir = caption_run
    images, references = test_split
    fp32 = Captioner.load(onnx_dir)
    int8 = Captioner.load(int8_dir)
    assert int8.bundle.config["precision"] == "int8"
    check_int8_graphs(
        int8_dir, shapes_caption_onnx.kept_fp32
    )  # the graphs, not the label: quantized, the kept products float
    fp32_captions = fp32.vocab.decode_batch(_tokens(fp32, images))
    int8_captions = int8.vocab.decode_batch(_tokens(int8, images))
    equal = sum(a == b for a, b in zip(fp32_captions, int8_captions)) / SPLIT
    cider_fp32 = compute_caption_metrics(fp32_captions, references)["cider_d"]
    cider_int8 = compute_caption_metrics(int8_captions, references)["cider_d"]
    print(f"int8: {equal:.1%} of greedy captions equal to fp32; CIDEr-D {cider_int8:.4f} vs fp32 {cider_fp32:.4f}")
    assert equal >= 0.95
    assert abs(cider_int8 - cider_fp32) <= 0.02 * cider_fp32


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_onnx_classifier_top1_equals_pytorch(shapes_classifier_run, shapes_classifier_onnx, tmp_path, precision):
    run, onnx_dir = shapes_classifier_run, shapes_classifier_onnx.fp32
    if precision == "int8":
        onnx_dir = shapes_classifier_onnx.int8  # in the run: vitattn-eval takes its split
        check_int8_graphs(onnx_dir, shapes_classifier_onnx.kept_fp32)
    images, labels = shapes_split("classification", LABEL_TEST_IMAGES)  # the run's whole test split
    model = load_bundle(run).model
    onnx_classifier = Classifier.load(onnx_dir)
    with torch.inference_mode():
        expected = model(images)
        got = onnx_classifier.model(images)
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    print(f"classifier {precision}: top-1 equal on {agree:.1%} of {len(images)} images")
    assert len(set(expected.argmax(-1).tolist())) >= 10  # a model whose answers differ between images
    if precision == "fp32":
        assert agree == 1.0
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    else:
        assert agree >= 0.95
    # vitattn-eval on the folder (inside the run: its test split, one batch as above) scores what the model predicts
    out = tmp_path / "eval"
    args = [f"model={onnx_dir}", "split=test", f"out={out}", "num_workers=0", "progress=false"]
    assert eval_main([*args, f"batch_size={len(images)}"]) == 0
    scored = json.loads((out / "metrics.json").read_text())["metrics"]
    top1 = (got.argmax(-1) == torch.tensor(labels)).float().mean()
    assert scored["num_images"] == LABEL_TEST_IMAGES and scored["top1"] == pytest.approx(float(top1), abs=1e-6)


def test_vitattn_caption_on_an_onnx_folder_writes_the_bundles_captions(caption_run, tmp_path):
    run, onnx_dir, _ = caption_run
    folder = tmp_path / "images"
    folder.mkdir()
    data = ShapesDataset("test", 6, img_size=32, seed=0, task="caption")
    for i in range(len(data)):
        Image.fromarray(data.image(i).permute(1, 2, 0).numpy()).save(folder / f"{i}.png")
    outs = {}
    for name, model in (("torch", run), ("onnx", onnx_dir), ("controls", onnx_dir)):
        out = tmp_path / f"{name}.jsonl"
        args = [f"model={model}", f"images={folder}", f"out={out}", "num_workers=0", "progress=false"]
        if name == "controls":
            args += [f"{k}={v}" for k, v in CONTROLS.items()]
        assert caption_main(args) == 0
        outs[name] = {r["image"]: r["caption"] for r in map(json.loads, out.read_text().splitlines())}
    assert outs["onnx"] == outs["torch"] and len(outs["onnx"]) == 6
    expected = Captioner.load(onnx_dir).caption(sorted(folder.iterdir()), **CONTROLS)
    assert [outs["controls"][str(p)] for p in sorted(folder.iterdir())] == expected != list(outs["onnx"].values())


def test_vitattn_eval_on_an_onnx_folder_scores_as_its_run(caption_run, tmp_path):
    run, onnx_dir, _ = caption_run
    metrics = {}
    for name, model in (("torch", run), ("onnx", onnx_dir)):  # the ONNX folder inside the run: its test split
        out = tmp_path / name
        assert eval_main([f"model={model}", "split=test", f"out={out}", "num_workers=0", "progress=false"]) == 0
        metrics[name] = json.loads((out / "metrics.json").read_text())["metrics"]
    assert metrics["onnx"] == metrics["torch"] and metrics["onnx"]["num_images"] == CAPTION_TEST_IMAGES


def test_serving_an_onnx_folder_answers_the_bundles_captions(caption_run):
    pytest.importorskip("litserve")
    from vitattn.serve.api import CaptionAPI, ImageRequest

    run, onnx_dir, _ = caption_run
    images, _ = shapes_split("caption", SPLIT)
    answers = {}
    for name, model in (("torch", run), ("onnx", onnx_dir)):
        api = CaptionAPI(str(model))
        api.setup("cpu")
        answers[name] = api.predict(
            [ImageRequest(image=x) for x in images[:8]] + [ImageRequest(image=images[0], attention=True)]
        )
    assert [a["caption"] for a in answers["onnx"][:8]] == [a["caption"] for a in answers["torch"][:8]]
    assert answers["onnx"][8] == {
        "error": "attention=true needs the PyTorch runtime; serve the bundle, not the ONNX folder"
    }


def test_an_onnx_folder_of_another_version_is_refused_in_one_line(caption_run, tmp_path, capsys):
    import shutil

    folder = shutil.copytree(caption_run[1], tmp_path / "onnx")
    config = json.loads((folder / ONNX_CONFIG_FILE).read_text())
    config.update(version=max(ONNX_VERSIONS) + 1, vitattn_version="9.0.0")
    (folder / ONNX_CONFIG_FILE).write_text(json.dumps(config))
    assert caption_main([f"model={folder}", f"images={folder}", f"out={tmp_path / 'o.jsonl'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    readable = " or ".join(map(str, ONNX_VERSIONS))
    expected = (
        f"has version={max(ONNX_VERSIONS) + 1} (written by vitattn '9.0.0'); this vitattn reads version {readable}"
    )
    assert expected in err
    assert "vitattn-export model=RUN format=onnx out=DIR" in err


def test_a_tampered_onnx_graph_is_refused_in_one_line(caption_run, tmp_path):
    import shutil

    folder = shutil.copytree(caption_run[1], tmp_path / "onnx")
    graph = folder / "decoder_step.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of a weight
    graph.write_bytes(bytes(data))
    with pytest.raises(
        ValueError,
        match=r"decoder_step.onnx does not match the checksum in .*onnx.json \(the graph was changed after export\); "
        r"export it again",
    ) as info:
        Captioner.load(folder)
    assert "\n" not in str(info.value)


def test_a_missing_onnxruntime_names_the_extra(caption_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    with pytest.raises(
        MissingDependencyError,
        match=r"ONNX folders need onnxruntime, which is not installed: pip install -e '\.\[onnx\]'",
    ):
        Captioner.load(caption_run[1])
    assert caption_main([f"model={caption_run[1]}", f"images={tmp_path}", f"out={tmp_path / 'o.jsonl'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ONNX folders need onnxruntime") and "\n" not in err


@pytest.mark.parametrize("missing", ["onnxruntime", "onnx"])
def test_export_without_the_onnx_extra_names_it(caption_run, tmp_path, monkeypatch, capsys, missing):
    monkeypatch.setitem(sys.modules, missing, None)
    assert export_main([f"model={caption_run[0]}", f"out={tmp_path / 'o'}", "format=onnx"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"{missing}, which is not installed: pip install -e '.[onnx]' (or pip install 'vitattn[onnx]')")
    assert "\n" not in err and not (tmp_path / "o").exists()


def test_attention_maps_of_an_onnx_folder_ask_for_the_pytorch_runtime(caption_run, test_split):
    captioner = Captioner.load(caption_run[1])
    with pytest.raises(
        ValueError, match="attention maps need the PyTorch runtime; use the bundle or run folder, not the ONNX folder"
    ):
        captioner.attention_maps(test_split[0][0] * 0.5 + 0.5)


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["attention_maps=maps"],
            "attention maps need the PyTorch runtime; use the bundle or run folder, not the ONNX folder",
        ),
        (
            ["devices=2", "accelerator=gpu"],
            "an ONNX folder runs on ONNX Runtime's CPU provider, not on GPUs; caption it on CPU processes",
        ),
    ],
)
def test_vitattn_caption_asks_for_what_an_onnx_folder_cannot_do_in_one_line(
    caption_run, tmp_path, capsys, extra, message
):
    args = [f"model={caption_run[1]}", f"images={tmp_path}", f"out={tmp_path / 'o.jsonl'}", "num_workers=0", *extra]
    (tmp_path / "a.png").write_bytes(b"")  # never read: the model is refused first
    assert caption_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_export_refuses_quantize_without_format_onnx(caption_run, tmp_path, capsys):
    assert export_main([f"model={caption_run[0]}", f"out={tmp_path / 'b'}", "quantize=int8"]) == 2
    assert capsys.readouterr().err.strip() == "error: quantize=int8 needs format=onnx (or format=hub hub_format=onnx)"


def _run_console(args: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env_extra or {})}
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)


def _vitattn_caption(args: list[str]) -> None:
    """vitattn-caption on the CPU: its main in this process for one device; for two, the console script, whose
    second process Lightning Fabric starts."""
    if "devices=1" in args:
        assert caption_main([*args, "accelerator=cpu"]) == 0
        return
    done = _run_console([str(console_script("vitattn-caption")), *args, "accelerator=cpu"])
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_entry_point_runs_an_int8_onnx_folder(caption_run, tmp_path):
    """The one loader behind the API, vitattn-caption on files and on shards (one process and two),
    vitattn-eval and vitattn-serve: each gives the int8 folder's own captions, image for image. One image a
    batch throughout: int8 activations are quantized with one scale per batch, so batch mates can change a
    caption."""
    pytest.importorskip("litserve")
    from vitattn.serve.api import CaptionAPI, ImageRequest

    run, _, int8_dir = caption_run
    captioner = Captioner.load(int8_dir)
    assert captioner.runtime == "onnx" and captioner.bundle.config["precision"] == "int8"
    write_shards(shapes_samples("test", 12, img_size=32), tmp_path / "shards", 5)
    images = {}  # shard key -> the sample's image, also written as a file
    (tmp_path / "images").mkdir()
    for url in expand_shards(str(tmp_path / "shards")):
        for sample in read_shard(url):
            images[sample["__key__"]] = tmp_path / "images" / f"{sample['__key__']}.jpg"
            images[sample["__key__"]].write_bytes(sample["jpg"])
    expected = {key: captioner.caption(path, batch_size=1) for key, path in images.items()}  # the API: the oracle
    assert len(set(expected.values())) >= 4, expected  # the images get different captions: a swap would show

    common = [f"model={int8_dir}", "num_workers=0", "progress=false", "num_threads=1", "batch_size=1"]
    for devices in (1, 2):
        out = tmp_path / f"files{devices}.jsonl"  # files, one process and two (Lightning Fabric, CPU)
        _vitattn_caption([*common, f"images={tmp_path / 'images'}", f"out={out}", f"devices={devices}"])
        assert {Path(r["image"]).stem: r["caption"] for r in map(json.loads, out.read_text().splitlines())} == expected
        out = tmp_path / f"shards{devices}"  # shards, one process and two
        _vitattn_caption([*common, f"shards={tmp_path / 'shards'}", f"out={out}", f"devices={devices}"])
        rows = [json.loads(line) for f in sorted(out.glob("*.jsonl")) for line in f.read_text().splitlines()]
        assert {r["key"]: r["caption"] for r in rows} == expected and len(rows) == len(expected)

    out = tmp_path / "eval"  # vitattn-eval: the run's test split
    args = [f"model={int8_dir}", "split=test", f"out={out}", "num_workers=0", "progress=false", "batch_size=1"]
    assert eval_main(args) == 0
    lines = (out / "captions.jsonl").read_text().splitlines()
    scored = {r["image_id"]: r["caption"] for r in map(json.loads, lines)}
    pixels, _ = shapes_split("caption", CAPTION_TEST_IMAGES)  # the run's whole test split
    assert [scored[i] for i in range(CAPTION_TEST_IMAGES)] == [captioner.caption_pixels(x[None])[0][0] for x in pixels]

    api = CaptionAPI(str(int8_dir))  # vitattn-serve's worker, one request a batch
    api.setup("cpu")
    for key, path in images.items():
        (answer,) = api.predict([ImageRequest(image=captioner.transform(Image.open(path).convert("RGB")))])
        assert answer["caption"] == expected[key]
