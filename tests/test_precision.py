"""``precision=auto|fp32|bf16`` for inference (``vitattn.precision``): the setting and its one-line refusals, the
detection of bf16 matrix units, and bf16 against fp32 on a captioner and a classifier trained on the shapes."""

import json
import logging
from pathlib import Path

import pytest
import torch
from PIL import Image

import vitattn.bundle
import vitattn.inference.api
import vitattn.inference.jobs
import vitattn.precision
import vitattn.serve
import vitattn.serve.api
from tests.helpers.bundles import make_caption_bundle
from tests.helpers.runs import CAPTION_TEST_IMAGES, LABEL_TEST_IMAGES, TINY, compose_train
from vitattn import Captioner, Classifier
from vitattn.bundle import load_model
from vitattn.cli import caption as caption_cli
from vitattn.cli import evaluate as evaluate_cli
from vitattn.cli import serve as serve_cli
from vitattn.cli.export import main as export_main
from vitattn.cli.run_split import run_split
from vitattn.data.shapes import ShapesDataset
from vitattn.errors import ConfigError
from vitattn.evaluation import evaluate_captions, evaluate_classification
from vitattn.inference.api import to_pixels
from vitattn.models.generate import sequence_log_prob
from vitattn.precision import NATIVE_BF16_ENV, check_precision, native_bf16, resolve_precision
from vitattn.training import train

CAPTIONS, LABELS = CAPTION_TEST_IMAGES, LABEL_TEST_IMAGES  # test-split images compared


@pytest.fixture
def fresh_detection(monkeypatch):
    """``native_bf16`` detects again in the test, and again after it (as VITATTN_NATIVE_BF16 says then)."""
    native_bf16.cache_clear()
    yield monkeypatch
    native_bf16.cache_clear()


def _units(monkeypatch, found: bool) -> None:
    """``precision=auto`` as on a CPU with (or without) bf16 matrix units."""
    monkeypatch.setattr(vitattn.precision, "native_bf16", lambda: found)


def _images(n: int) -> list[torch.Tensor]:
    data = ShapesDataset("test", n, img_size=32, seed=1, task="caption")
    return [data.image(i) for i in range(n)]  # (3, 32, 32) uint8 each


@pytest.mark.parametrize("value", ["fp16", "BF16", "int8", None])
def test_precision_refuses_an_unknown_value_in_one_line_naming_it(value, tmp_path, capsys):
    message = f"precision={value!r} is unknown; choose auto, fp32 or bf16"
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        check_precision(value)
    bundle = make_caption_bundle(tmp_path / "caption")
    for load in (load_model, Captioner.load):
        with pytest.raises(ValueError) as err:
            load(bundle, "cpu", value)
        assert str(err.value) == message
    if value is None:
        return
    clis = ((caption_cli, ["images=x", "out=y", "device=cpu"]), (evaluate_cli, ["device=cpu"]), (serve_cli, []))
    for cli, extra in clis:
        assert cli.main([f"model={bundle}", *extra, f"precision={value}"]) == 2  # load_model's line
        assert capsys.readouterr().err == f"error: {message}\n"


def test_native_bf16_is_detected_once_and_said_in_one_line(fresh_detection, caplog):
    monkeypatch = fresh_detection
    monkeypatch.delenv(NATIVE_BF16_ENV)
    calls = []
    monkeypatch.setattr(vitattn.precision, "cpu_bf16_units", lambda: calls.append(1) or ["avx512_bf16"])
    with caplog.at_level(logging.INFO, logger="vitattn.precision"):
        assert [resolve_precision("auto", "cpu") for _ in range(3)] == ["bf16"] * 3
    assert len(calls) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "precision=auto: bf16 matrix instructions on this CPU: avx512_bf16, so inference runs in bf16"
    ]
    native_bf16.cache_clear()
    caplog.clear()
    monkeypatch.setattr(vitattn.precision, "cpu_bf16_units", lambda: [])
    with caplog.at_level(logging.INFO, logger="vitattn.precision"):
        assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert [r.getMessage() for r in caplog.records] == [
        "precision=auto: bf16 matrix instructions on this CPU: none of amx_bf16, avx512_bf16, so inference runs in fp32"
    ]


@pytest.mark.parametrize("value, found", [("0", False), ("1", True)])
def test_native_bf16_env_decides_instead_of_the_cpu(fresh_detection, value, found):
    monkeypatch = fresh_detection
    monkeypatch.setenv(NATIVE_BF16_ENV, value)
    monkeypatch.setattr(vitattn.precision, "cpu_bf16_units", lambda: pytest.fail("the CPU was asked"))
    assert native_bf16() is found
    assert resolve_precision("auto", "cpu") == ("bf16" if found else "fp32")


def test_native_bf16_env_refuses_other_values_in_one_line(fresh_detection):
    fresh_detection.setenv(NATIVE_BF16_ENV, "yes")
    with pytest.raises(ValueError, match=r"^VITATTN_NATIVE_BF16='yes' must be 0 \(fp32\) or 1 \(bf16\), or unset"):
        native_bf16()


def _cuda(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("found", [False, True])
def test_auto_is_bf16_on_cuda_and_on_cpus_with_the_units_only(monkeypatch, found):
    _units(monkeypatch, found)
    assert resolve_precision("auto", "cpu") == ("bf16" if found else "fp32")
    _cuda(monkeypatch, (8, 0) if found else (7, 5))  # A100 / T4
    assert resolve_precision("auto", "cuda:1") == ("bf16" if found else "fp32")
    assert resolve_precision("auto", "mps") == "fp32"
    for device in ("cpu", "cuda"):
        assert resolve_precision("fp32", device) == "fp32"
        assert resolve_precision("bf16", device) == "bf16"


def test_auto_without_the_units_is_exactly_fp32(shapes_caption_run, shapes_classifier_run, monkeypatch):
    """Captions, their scores and the classifier's logits are the plain fp32 model's, bit for bit: a laptop loses
    nothing."""
    _units(monkeypatch, False)
    images = _images(32)
    captioner = Captioner.load(shapes_caption_run)
    assert captioner.precision == "fp32"
    got = captioner.caption(images, details=True)
    pixels, model = captioner.pixels(images), captioner.model
    with torch.inference_mode():  # the model alone: no autocast, nothing of vitattn.precision
        tokens = model.generate(pixels)
        step = model.decode_step(model.encode(pixels), tokens.shape[1] + 1)
        scores = sequence_log_prob(step, tokens, model.special_ids)
    pad = captioner.vocab.pad_id
    assert [c.tokens for c in got] == [[t for t in row if t != pad] for row in tokens.tolist()]
    assert [c.score for c in got] == scores.tolist()
    classifier = Classifier.load(shapes_classifier_run)
    assert classifier.precision == "fp32"
    with torch.inference_mode():
        expected = classifier.model(to_pixels(images, classifier.transform))
    assert torch.equal(classifier.logits(images), expected)


def test_auto_with_the_units_runs_bf16(shapes_caption_run, shapes_classifier_run, monkeypatch):
    """What a CPU with the units gets from auto (forced on here: autocast runs on any CPU, only slower)."""
    _units(monkeypatch, True)
    images = _images(32)
    auto, bf16 = Captioner.load(shapes_caption_run), Captioner.load(shapes_caption_run, precision="bf16")
    assert auto.precision == bf16.precision == "bf16"
    got, expected = auto.caption(images, details=True), bf16.caption(images, details=True)
    assert [(c.tokens, c.score) for c in got] == [(c.tokens, c.score) for c in expected]
    fp32_scores = [c.score for c in Captioner.load(shapes_caption_run, precision="fp32").caption(images, details=True)]
    assert [c.score for c in got] != fp32_scores  # the model did run in bf16
    auto = Classifier.load(shapes_classifier_run)
    assert auto.precision == "bf16"
    logits = auto.logits(images)
    assert torch.equal(logits, Classifier.load(shapes_classifier_run, precision="bf16").logits(images))
    assert not torch.equal(logits, Classifier.load(shapes_classifier_run, precision="fp32").logits(images))


@pytest.mark.cpu_bf16
def test_bf16_keeps_97_percent_of_greedy_captions_and_cider_d_within_1_percent(shapes_caption_run):
    """vitattn-eval's captions of the run's test split (greedy), bf16 against fp32."""
    reports = {
        p: evaluate_captions(bundle, split="test", run_split=run_split(bundle, shapes_caption_run, "test"))
        for p in ("fp32", "bf16")
        for bundle in [load_model(shapes_caption_run, precision=p)]
    }
    captions = {p: [c for _, c, _ in report.captions] for p, report in reports.items()}
    cider = {p: report.metrics["cider_d"] for p, report in reports.items()}
    assert len(captions["fp32"]) == CAPTIONS and len(set(captions["fp32"])) >= 10  # a model worth comparing
    equal = sum(a == b for a, b in zip(captions["fp32"], captions["bf16"])) / CAPTIONS
    print(
        f"bf16: {equal:.1%} of greedy captions equal to fp32; CIDEr-D {cider['bf16']:.4f} vs fp32 {cider['fp32']:.4f}"
    )
    assert equal >= 0.97
    assert abs(cider["bf16"] - cider["fp32"]) <= 0.01 * cider["fp32"]


@pytest.mark.cpu_bf16
def test_bf16_classifier_top1_within_half_a_percent(shapes_classifier_run):
    """vitattn-eval's top-1 on the run's test split, bf16 against fp32."""
    top1 = {
        p: evaluate_classification(
            bundle, split="test", run_split=run_split(bundle, shapes_classifier_run, "test")
        ).metrics["top1"]
        for p in ("fp32", "bf16")
        for bundle in [load_model(shapes_classifier_run, precision=p)]
    }
    print(f"bf16: top-1 {top1['bf16']:.4f} vs fp32 {top1['fp32']:.4f} on {LABELS} images")
    assert top1["fp32"] > 0.25  # a model worth comparing: 18 classes
    assert abs(top1["bf16"] - top1["fp32"]) <= 0.005


def test_on_a_cpu_the_encoder_runs_in_bf16_and_each_decoding_step_in_fp32(tmp_path):
    """Under bf16 autocast on a CPU the encoder runs in bf16 and every decoding step is
    the fp32 decoder over them (faster there than bf16 at one query position, and nearer fp32's captions)."""
    model = load_model(make_caption_bundle(tmp_path / "caption"), precision="fp32").model
    images = torch.randn(3, 3, 32, 32)
    tokens = torch.full((3, 1), model.decoder.bos_id)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        memory = model.encode(images)  # (B, N, D)
        logits = model.decode_step(memory, 4)(tokens)  # (B, V)
    with torch.inference_mode():
        expected = model.decoder(tokens, memory._replace(tokens=memory.tokens.float()))[:, -1]  # fp32, no autocast
    assert logits.dtype == torch.float32
    assert torch.equal(logits, expected)


def test_an_onnx_folder_runs_in_its_exported_precision_and_refuses_bf16_in_one_line(tmp_path, capsys):
    pytest.importorskip("onnxruntime", reason="the onnx extra: pip install -e '.[onnx]'")
    bundle, onnx_dir = make_caption_bundle(tmp_path / "caption"), tmp_path / "onnx"
    assert export_main([f"model={bundle}", f"out={onnx_dir}", "format=onnx"]) == 0
    message = (
        f"precision=bf16 but {onnx_dir} is an ONNX folder, which runs in the fp32 it was exported in; use "
        "precision=auto, or load the bundle or run folder for bf16"
    )
    with pytest.raises(ValueError) as err:
        Captioner.load(onnx_dir, precision="bf16")
    assert str(err.value) == message
    assert [Captioner.load(onnx_dir, precision=p).precision for p in ("auto", "fp32")] == ["fp32", "fp32"]
    capsys.readouterr()
    out = tmp_path / "captions.jsonl"
    assert caption_cli.main([f"model={onnx_dir}", f"images={bundle}", f"out={out}", "precision=bf16"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_caption_eval_and_serve_load_in_the_precision_given(shapes_caption_run, tmp_path, monkeypatch):
    folder = tmp_path / "images"
    folder.mkdir()
    for i, image in enumerate(_images(6)):
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{i}.png")
    loaded = []
    load = vitattn.bundle.load_model

    def spy(path, device="cpu", precision="auto", merge_tokens=None):
        loaded.append(precision)
        return load(path, device, precision, merge_tokens)

    for module in (vitattn.bundle, vitattn.inference.api, vitattn.inference.jobs, vitattn.serve.api):
        monkeypatch.setattr(module, "load_model", spy)
    out = tmp_path / "captions.jsonl"
    common = [f"model={shapes_caption_run}", "num_workers=0", "progress=false", "precision=bf16"]
    assert caption_cli.main([*common, f"images={folder}", f"out={out}"]) == 0
    captions = {Path(r["image"]).name: r["caption"] for r in map(json.loads, out.read_text().splitlines())}
    files = sorted(folder.iterdir())
    assert [captions[f.name] for f in files] == Captioner(load(shapes_caption_run, precision="bf16")).caption(files)
    assert evaluate_cli.main([*common, "split=test", f"out={tmp_path / 'eval'}"]) == 0

    class Served(Exception):
        pass

    def no_server(apis, **kwargs):
        apis[0].setup("cpu")  # what each inference worker does
        assert apis[0].bundle.precision == "bf16"
        raise Served

    monkeypatch.setattr(vitattn.serve, "build_server", no_server)
    with pytest.raises(Served):
        serve_cli.run(serve_cli.parse_args([f"model={shapes_caption_run}", "precision=bf16"]))
    assert loaded == ["bf16"] * 4  # caption, eval, serve before it starts the server, the server's worker


@pytest.mark.parametrize(
    ("accelerator", "width", "units", "expected"),
    [
        ("cpu", 192, True, "bf16-mixed"),
        ("cpu", 384, False, "32-true"),  # a CPU without the units loses nothing
        ("cpu", 128, True, "32-true"),  # products too small for bf16 to pay (make train's width)
        ("gpu", 64, True, "bf16-mixed"),  # compute capability 8.0
        ("gpu", 64, False, "16-mixed"),  # 7.5: bf16 would be emulated
    ],
)
def test_training_precision_auto_follows_the_units_and_the_width(accelerator, width, units, expected, fresh_detection):
    from vitattn.training.plan import BF16_TRAIN_MIN_WIDTH, resolve

    fresh_detection.setenv(NATIVE_BF16_ENV, "1" if units else "0")
    if accelerator == "gpu":
        _cuda(fresh_detection, (8, 0) if units else (7, 5))
    cfg = compose_train(
        [*TINY, f"model.embed_dim={width}", f"trainer.accelerator={accelerator}", "trainer.precision=auto"], "run"
    )
    assert BF16_TRAIN_MIN_WIDTH == 192  # docs/benchmarks.md's crossover
    assert resolve(cfg).cfg.trainer.precision == expected and cfg.trainer.precision == "auto"  # cfg left as it is
    cfg.trainer.precision = "32-true"  # a value given is kept as it is
    assert resolve(cfg).cfg.trainer.precision == "32-true"


def test_training_precision_auto_on_a_gpu_trainer_without_a_gpu_says_no_gpu(fresh_detection, caplog):
    from vitattn.training.plan import resolve

    fresh_detection.setattr(torch.cuda, "is_available", lambda: False)
    cfg = compose_train([*TINY, "trainer.accelerator=gpu", "trainer.precision=auto"], "run")
    with caplog.at_level(logging.INFO, logger="vitattn"):
        assert resolve(cfg).cfg.trainer.precision == "32-true"
    lines = [r.getMessage() for r in caplog.records if "trainer.precision=auto" in r.getMessage()]
    assert len(lines) == 1 and "no GPU" in lines[0] and "compute capability" not in lines[0], lines


def test_training_precision_auto_trains_and_saves_what_it_chose(tmp_path, fresh_detection, caplog):
    """The run's trainer and its saved config carry the chosen precision, said in one log line."""
    import lightning.pytorch as pl
    from omegaconf import OmegaConf

    fresh_detection.setenv(NATIVE_BF16_ENV, "1")
    chosen: list[str] = []
    real_fit = pl.Trainer.fit

    def fit(trainer, *args, **kwargs):
        chosen.append(trainer.precision)
        return real_fit(trainer, *args, **kwargs)

    fresh_detection.setattr(pl.Trainer, "fit", fit)
    run = [*TINY, "model.embed_dim=192", "model.depth=1", "model.num_heads=6", "head.decoder.depth=1"]
    with caplog.at_level(logging.INFO, logger="vitattn.training.plan"):
        result = train(compose_train([*run, "trainer.precision=auto", "trainer.max_steps=2"], tmp_path))
    assert chosen == ["bf16-mixed"] and result.global_step == 2
    assert OmegaConf.load(tmp_path / "config.yaml").trainer.precision == "bf16-mixed"
    lines = [r.getMessage() for r in caplog.records if "trainer.precision=auto" in r.getMessage()]
    assert lines == ["trainer.precision=auto: bf16-mixed (bf16 matrix units on this CPU and model.embed_dim=192)"]


@pytest.mark.parametrize(
    ("overrides", "gpu", "expected"),
    [
        (["trainer=gpu"], True, "high"),  # TF32, as conf/trainer/gpu.yaml says
        ([], False, "highest"),  # torch's default on the CPU
        (["float32_matmul_precision=medium"], False, "medium"),
    ],
)
def test_float32_matmul_precision_is_set_as_the_config_says(overrides, gpu, expected, monkeypatch):
    from vitattn.training.build import set_matmul_precision
    from vitattn.training.plan import resolve

    if gpu:
        _cuda(monkeypatch, (8, 0))
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert set_matmul_precision(resolve(compose_train([*TINY, *overrides], "run"))) == expected
        assert torch.get_float32_matmul_precision() == expected
    finally:
        torch.set_float32_matmul_precision(before)


def test_an_unknown_float32_matmul_precision_is_one_line():
    from vitattn.training.plan import resolve

    with pytest.raises(ConfigError, match="^float32_matmul_precision='tf32' is unknown; choose one of auto, highest"):
        resolve(compose_train([*TINY, "float32_matmul_precision=tf32"], "run"))
