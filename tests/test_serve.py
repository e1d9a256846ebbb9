"""vitattn-serve: requests decoded as vitattn-caption reads files, batches captioned as it captions them,
and a real server on localhost answering concurrent clients and a headless browser."""

import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers import make_caption_bundle
from tests.test_captioner import write_bad_images, write_good_images
from vitattn.cli.serve import main, parse_args
from vitattn.inference import caption_images

httpx = pytest.importorskip("httpx")
pytest.importorskip("litserve")
pytest.importorskip("multipart", reason="python-multipart (the serve extra) parses uploaded files")

from vitattn.serve import CaptionAPI, decode_image_request  # noqa: E402 - needs litserve

BAD_KINDS = ["corrupt.jpg", "truncated.png", "empty.png", "notes.jpg", "bomb.png", "bomb_warning.png"]


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    return make_caption_bundle(tmp_path_factory.mktemp("model") / "bundle")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    write_good_images(folder)
    write_bad_images(folder)
    return folder


@pytest.fixture(scope="module")
def expected(bundle_dir, images) -> dict[str, dict]:
    """vitattn-caption's record of every file: the oracle the server must agree with."""
    from vitattn.bundle import load_bundle

    paths = sorted(p for p in images.iterdir() if p.is_file())
    records = caption_images(load_bundle(bundle_dir), paths, batch_size=4)
    return {Path(r["image"]).name: r for r in records}


@pytest.fixture(scope="module")
def api(bundle_dir) -> CaptionAPI:
    api = CaptionAPI(str(bundle_dir), max_image_bytes=100_000, max_batch_size=4)
    api.setup("cpu")
    return api


def _form(path: Path, **fields) -> dict:
    """What LitServe hands ``decode_request`` for a multipart upload: fields with a ``.file``."""

    class Upload:
        file = io.BytesIO(path.read_bytes())

    return {"image": Upload(), **fields}


def test_decode_gives_vitattn_caption_reasons_for_bad_images(api, images, expected):
    for name in BAD_KINDS:
        decoded = decode_image_request(_form(images / name), api.transform, api.max_image_bytes)
        assert decoded.image is None and decoded.error == expected[name]["error"], name
        assert "\n" not in decoded.error


def test_decode_refuses_oversized_missing_and_malformed_requests(api, images):
    big = base64.b64encode(os.urandom(100_001)).decode()
    assert (
        "over the limit of max_image_bytes=100000" in decode_image_request({"image": big}, api.transform, 100_000).error
    )
    assert "no 'image' field" in decode_image_request({"file": "x"}, api.transform, 100).error
    assert "not valid base64" in decode_image_request({"image": "@@"}, api.transform, 100).error
    assert "multipart file" in decode_image_request([1, 2], api.transform, 100).error


def test_decode_takes_base64_and_data_urls(api, images):
    raw = base64.b64encode((images / "rgb.jpg").read_bytes()).decode()
    for payload in ({"image": raw}, {"image": "data:image/jpeg;base64," + raw, "attention": "true"}):
        decoded = decode_image_request(payload, api.transform, api.max_image_bytes)
        assert decoded.error is None and tuple(decoded.image.shape) == (3, 32, 32)
    assert decoded.attention


def test_predict_mixed_batch_matches_vitattn_caption(api, images, expected):
    names = ["rgb.jpg", "empty.png", "gray.png", "bomb.png", "cmyk.jpg"]
    batch = [api.decode_request(_form(images / n, attention="true" if n == "gray.png" else "false")) for n in names]
    outputs = api.unbatch(api.predict(api.batch(batch)))
    for name, out in zip(names, outputs):
        if "error" in expected[name]:
            response = api.encode_response(out)
            assert response.status_code == 400 and expected[name]["error"] in response.body.decode()
        else:
            assert out["caption"] == expected[name]["caption"] and out["caption"]
            assert " ".join(out["tokens"]) == out["caption"]
            assert ("attention" in out) == (name == "gray.png")
    png = base64.b64decode(outputs[2]["attention"].removeprefix("data:image/png;base64,"))
    assert Image.open(io.BytesIO(png)).format == "PNG"
    single = api.predict(api.decode_request(_form(images / "rgb.jpg")))  # max_batch_size=1: one request, no list
    assert single["caption"] == expected["rgb.jpg"]["caption"]


def test_serve_help_and_argument_errors(capsys):
    assert main(["--help"]) == 0
    assert "vitattn-serve model=PATH" in capsys.readouterr().out
    for argv, message in [
        ([], "missing model=..."),
        (["model=m", "port=80"], "port=80 must be from 1024"),
        (["model=m", "host=example.org"], "host='example.org'"),
        (["model=m", "devices=two"], "devices='two'"),
        (["model=m", "max_batch_size=0"], "max_batch_size=0 must be at least 1"),
        (["model=m", "batch_timeout=100"], "batch_timeout=100.0"),
    ]:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert parse_args(["model=m", "devices=2"]).devices == "2"


def test_serve_refuses_a_missing_model_in_one_line(capsys, tmp_path):
    assert main([f"model={tmp_path / 'nothing'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model not found") and err.count("\n") == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(bundle_dir):
    """``vitattn-serve`` in its own process group on a free port; the group is ended afterwards."""
    port = _free_port()
    command = [sys.executable, "-m", "vitattn.cli.serve", f"model={bundle_dir}", f"port={port}"]
    command += ["max_batch_size=4", "batch_timeout=0.05", "max_image_bytes=100000", "num_threads=1"]
    proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240  # start-up imports torch in two processes: slow on a busy machine
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy in 240 s"
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _post(url: str, path: Path, as_json: bool) -> httpx.Response:
    if as_json:
        body = {"image": base64.b64encode(path.read_bytes()).decode()}
        return httpx.post(f"{url}/predict", json=body, timeout=120)
    return httpx.post(f"{url}/predict", files={"image": (path.name, path.read_bytes())}, timeout=120)


@pytest.mark.slow
def test_server_answers_concurrent_good_and_bad_images(server, images, expected):
    names = [n for n in expected if n != "folder.png"]
    jobs = [(n, as_json) for n in names for as_json in (False, True)]  # 28 requests, 8 clients at a time
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda job: _post(server, images / job[0], job[1]), jobs))
    assert time.monotonic() - started < 120
    for (name, as_json), response in zip(jobs, responses):
        record = expected[name]
        if "error" in record:
            assert response.status_code == 400, (name, response.text)
            assert response.json() == {"detail": record["error"]}, name
        else:
            assert response.status_code == 200, (name, response.text)
            assert response.json()["caption"] == record["caption"], (name, as_json)
    big = Image.effect_noise((256, 256), 80).convert("RGB")
    buffer = io.BytesIO()
    big.save(buffer, format="PNG")
    over = httpx.post(f"{server}/predict", files={"image": ("big.png", buffer.getvalue())}, timeout=60)
    assert over.status_code == 400 and "over the limit of max_image_bytes=100000" in over.json()["detail"]
    garbage = httpx.post(f"{server}/predict", content=b"\x00not json", timeout=60)
    assert garbage.status_code == 400 and "neither a multipart form nor JSON" in garbage.json()["detail"]
    # still serving after every kind of bad request
    assert httpx.get(f"{server}/health", timeout=10).text == "ok"
    assert _post(server, images / "rgb.jpg", False).json()["caption"] == expected["rgb.jpg"]["caption"]


@pytest.mark.slow
def test_server_page_captions_an_upload_in_a_browser(server, images, expected):
    page_html = httpx.get(server, timeout=10)
    assert page_html.status_code == 200 and 'id="caption"' in page_html.text
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install .[dev])")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH: install Debian's chromium (apt-get install chromium) for the browser test")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server)
            page.set_input_files("#file", str(images / "rgb.jpg"))
            page.wait_for_function("document.getElementById('caption').textContent.length > 0", timeout=60_000)
            assert page.text_content("#caption") == expected["rgb.jpg"]["caption"]
            page.wait_for_function("(document.getElementById('attention').src || '').startsWith('data:image/png')")
            page.set_input_files("#file", str(images / "notes.jpg"))
            page.wait_for_function("document.getElementById('error').textContent.length > 0", timeout=60_000)
            assert page.text_content("#error") == "error: " + expected["notes.jpg"]["error"]
        finally:
            browser.close()


def test_load_report_fails_on_a_5xx_a_wrong_reason_or_growing_memory():
    from omegaconf import OmegaConf

    from vitattn.serve.load import LoadConfig, Sample, _report

    cfg = OmegaConf.structured(LoadConfig(model="m", requests=8))
    jobs = [(i, "bad" if i == 3 else "good", "x", b"", "empty file (0 bytes)" if i == 3 else None) for i in range(8)]

    def samples(bad_reason: str, status: int = 200) -> list:
        out = [Sample(i, "good", status if i == 5 else 200, 0.1, "{}", float(i)) for i in range(8) if i != 3]
        return [*out, Sample(3, "bad", 400, 0.1, f'{{"detail": "{bad_reason}"}}', 3.0)]

    flat = [(float(t), 100) for t in range(8)]
    good = _report(cfg, jobs, samples("empty file (0 bytes)"), flat, 1.0, 1.0)
    assert good["passed"] and good["status_counts"] == {"200": 7, "400": 1} and good["throughput_rps"] == 8.0
    assert not _report(cfg, jobs, samples("not an image"), flat, 1.0, 1.0)["checks"][
        "every_bad_image_400_with_its_reason"
    ]
    assert not _report(cfg, jobs, samples("empty file (0 bytes)", 500), flat, 1.0, 1.0)["checks"]["no_5xx"]
    growing = [(float(t), 100 + 10 * t) for t in range(8)]
    assert not _report(cfg, jobs, samples("empty file (0 bytes)"), growing, 1.0, 1.0)["checks"]["rss_flat"]


@pytest.mark.slow
def test_load_script_passes_its_checks_on_a_small_run(bundle_dir, tmp_path):
    out = tmp_path / "load.json"
    command = [sys.executable, "scripts/load_serve.py", f"model={bundle_dir}", "requests=60", "clients=6"]
    command += ["warmup=4", "num_threads=1", f"out={out}"]
    proc = subprocess.run(command, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["passed"] and report["answered"] == 60 and report["status_counts"] == {"200": 54, "400": 6}
    assert report["latency_ms"]["p50"] <= report["latency_ms"]["p99"]
