"""vitattn-serve: requests decoded as vitattn-caption reads files, batches captioned as it captions them,
a real server on localhost answering concurrent clients and a headless browser, and stopping on a signal
(sent to that server's process only, never to pytest's)."""

import base64
import contextlib
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

from tests.helpers.bundles import distinct, make_caption_bundle, put_in_hub_cache
from tests.helpers.images import write_bad_images, write_good_images
from vitattn.cli.serve import main, parse_args
from vitattn.inference import caption_images

httpx = pytest.importorskip("httpx")
pytest.importorskip("litserve")
pytest.importorskip("multipart", reason="python-multipart (the serve extra) parses uploaded files")

from vitattn.serve import CaptionAPI, decode_image_request  # noqa: E402 - needs litserve
from vitattn.serve.server import NOT_AN_IMAGE_BODY  # noqa: E402 - needs litserve

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


def test_decode_takes_a_forms_only_file_whatever_its_name(api, images, expected):
    upload = _form(images / "rgb.jpg")["image"]
    decoded = decode_image_request({"file": upload, "attention": "true"}, api.transform, api.max_image_bytes)
    assert decoded.error is None and tuple(decoded.image.shape) == (3, 32, 32) and decoded.attention
    assert api.predict(decoded)["caption"] == expected["rgb.jpg"]["caption"]
    two = {"a": _form(images / "rgb.jpg")["image"], "b": _form(images / "gray.png")["image"]}
    error = decode_image_request(two, api.transform, api.max_image_bytes).error
    assert error == "the form has files 'a', 'b' and none named 'image'; send one file, or name it 'image'"
    bad = decode_image_request({"file": _form(images / "notes.jpg")["image"]}, api.transform, 100_000)
    assert bad.error == expected["notes.jpg"]["error"]


def test_decode_takes_base64_and_data_urls(api, images):
    raw = base64.b64encode((images / "rgb.jpg").read_bytes()).decode()
    for payload in ({"image": raw}, {"image": "data:image/jpeg;base64," + raw, "attention": "true"}):
        decoded = decode_image_request(payload, api.transform, api.max_image_bytes)
        assert decoded.error is None and tuple(decoded.image.shape) == (3, 32, 32)
    assert decoded.attention


def test_predict_mixed_batch_matches_vitattn_caption(api, images, expected):
    names = ["rgb.jpg", "empty.png", "gray.png", "bomb.png", "cmyk.jpg"]
    distinct([expected[n]["caption"] for n in names if "caption" in expected[n]])  # a swap in the batch would show
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


def test_the_server_takes_a_hub_name_offline(bundle_dir, images, expected, hub_cache, hub_offline, no_network):
    put_in_hub_cache(hub_cache, "org/tiny", bundle_dir)
    api = CaptionAPI("hf-hub:org/tiny", max_image_bytes=100_000, max_batch_size=4)
    api.setup("cpu")  # what each inference worker of vitattn-serve model=hf-hub:org/tiny does
    names = ["rgb.jpg", "gray.png", "cmyk.jpg"]
    outputs = api.unbatch(api.predict(api.batch([api.decode_request(_form(images / n)) for n in names])))
    distinct([expected[n]["caption"] for n in names])  # a swap in the batch would show
    assert [out["caption"] for out in outputs] == [expected[n]["caption"] for n in names]


def test_the_servers_decoding_controls_caption_as_vitattn_caption_does(bundle_dir, images):
    controls = ["min_new_tokens=4", "no_repeat_ngram_size=2", "repetition_penalty=1.5"]
    cfg = parse_args([f"model={bundle_dir}", *controls])
    from vitattn.bundle import load_model

    generate = load_model(bundle_dir).generate_settings(cfg)
    assert {k: generate[k] for k in ("min_new_tokens", "no_repeat_ngram_size", "repetition_penalty")} == {
        "min_new_tokens": 4,
        "no_repeat_ngram_size": 2,
        "repetition_penalty": 1.5,
    }
    api = CaptionAPI(str(bundle_dir), generate=generate, max_batch_size=4)
    api.setup("cpu")
    names = ["rgb.jpg", "gray.png", "cmyk.jpg"]
    outputs = api.unbatch(api.predict(api.batch([api.decode_request(_form(images / n)) for n in names])))
    records = caption_images(load_model(bundle_dir), [images / n for n in names], batch_size=4, **generate)
    assert [o["caption"] for o in outputs] == [r["caption"] for r in records]
    assert all(len(o["tokens"]) >= 4 for o in outputs)  # no <eos> before the fourth token


def _echo_app(middleware, **kwargs):
    """A Starlette app whose ``POST /predict`` returns the JSON body it received, behind ``middleware``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"content_type": request.headers["content-type"], "body": await request.json()})

    app = Starlette(routes=[Route("/predict", echo, methods=["POST"]), Route("/health", lambda r: JSONResponse("ok"))])
    app.add_middleware(middleware, **kwargs)
    return TestClient(app)


def test_raw_image_body_becomes_the_json_decode_reads(api, images, expected):
    from vitattn.serve.server import RequestBodies

    client = _echo_app(RequestBodies, paths=["/predict"])
    raw = (images / "rgb.jpg").read_bytes()
    echoed = client.post("/predict?attention=true", content=raw, headers={"Content-Type": "image/jpeg"}).json()
    assert echoed["content_type"] == "application/json"
    assert base64.b64decode(echoed["body"]["image"]) == raw and echoed["body"]["attention"] == "true"
    decoded = decode_image_request(echoed["body"], api.transform, api.max_image_bytes)
    assert api.predict(decoded)["caption"] == expected["rgb.jpg"]["caption"] and decoded.attention
    octets = client.post("/predict", content=raw, headers={"Content-Type": "application/octet-stream"}).json()
    assert base64.b64decode(octets["body"]["image"]) == raw and "attention" not in octets["body"]
    assert client.post("/predict", json={"image": "x"}).json()["body"] == {"image": "x"}
    refused = client.post("/predict", content=b"\x00not json", headers={"Content-Type": "text/plain"})
    assert refused.status_code == 400 and refused.json() == {"detail": NOT_AN_IMAGE_BODY}


def test_graceful_stop_refuses_new_requests_and_ends_the_server_once_none_is_in_flight():
    import threading

    from vitattn.serve.stop import SHUTTING_DOWN, GracefulStop, StopGate

    ended = threading.Event()
    stop = GracefulStop(timeout=60, end_server=lambda server: ended.set())
    client = _echo_app(StopGate, stop=stop)
    assert client.get("/health").status_code == 200 and stop.in_flight() == 0
    assert stop.enter()  # a request in flight
    stop.begin("SIGTERM")
    refused = client.get("/health")
    assert refused.status_code == 503 and refused.json() == {"detail": SHUTTING_DOWN}
    assert not stop.enter() and stop.in_flight() == 1
    assert not ended.wait(0.5)  # still draining: the one in flight has not finished
    stop.leave()
    assert ended.wait(30)


def test_graceful_stop_ends_the_server_after_timeout_with_a_request_still_in_flight():
    import threading

    from vitattn.serve.stop import GracefulStop

    ended = threading.Event()
    stop = GracefulStop(timeout=0, end_server=lambda server: ended.set())
    assert stop.enter()
    stop.begin("SIGINT")
    assert ended.wait(30) and stop.in_flight() == 1


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


def _start_server(bundle_dir: Path, *settings: str) -> tuple[subprocess.Popen, str]:
    """``vitattn-serve`` in its own process group on a free port, once ``/health`` answers 200."""
    port = _free_port()
    command = [sys.executable, "-m", "vitattn.cli.serve", f"model={bundle_dir}", f"port={port}", "num_threads=1"]
    proc = subprocess.Popen(
        [*command, *settings], start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240  # start-up imports torch in two processes: slow on a busy machine
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy in 240 s"
            time.sleep(1)
    except BaseException:
        _end_group(proc)
        raise


def _end_group(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of the server's process group (the test's own cleanup, not what it tests)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _group(pgid: int) -> list[int]:
    """The live processes of a process group, read from /proc (zombies count as gone)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except (OSError, ValueError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def server(bundle_dir):
    """``vitattn-serve`` serving the tests of this module; its group is ended afterwards."""
    proc, url = _start_server(bundle_dir, "max_batch_size=4", "batch_timeout=0.05", "max_image_bytes=100000")
    try:
        yield url
    finally:
        _end_group(proc)


def _post(url: str, path: Path, as_json: bool) -> httpx.Response:
    if as_json:
        body = {"image": base64.b64encode(path.read_bytes()).decode()}
        return httpx.post(f"{url}/predict", json=body, timeout=120)
    return httpx.post(f"{url}/predict", files={"image": (path.name, path.read_bytes())}, timeout=120)


@pytest.mark.slow
def test_server_answers_concurrent_good_and_bad_images(server, images, expected):
    names = [n for n in expected if n != "folder.png"]
    distinct([expected[n]["caption"] for n in names if "caption" in expected[n]], at_least=4)  # routing shows
    jobs = [(n, as_json) for n in names for as_json in (False, True)]  # 28 requests, 8 clients at a time
    with ThreadPoolExecutor(8) as pool:  # a hang fails on httpx's timeout or pytest-timeout, not on a clock
        responses = list(pool.map(lambda job: _post(server, images / job[0], job[1]), jobs))
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
    assert garbage.status_code == 400 and garbage.json()["detail"] == NOT_AN_IMAGE_BODY
    # still serving after every kind of bad request
    assert httpx.get(f"{server}/health", timeout=10).text == "ok"
    assert _post(server, images / "rgb.jpg", False).json()["caption"] == expected["rgb.jpg"]["caption"]


@pytest.mark.slow
def test_server_takes_a_raw_image_body_and_a_file_field_of_another_name(server, images, expected):
    raw = (images / "rgb.jpg").read_bytes()
    as_body = httpx.post(f"{server}/predict", content=raw, headers={"Content-Type": "image/jpeg"}, timeout=120)
    assert as_body.status_code == 200 and as_body.json()["caption"] == expected["rgb.jpg"]["caption"]
    with_map = httpx.post(
        f"{server}/predict?attention=true", content=raw, headers={"Content-Type": "image/jpeg"}, timeout=120
    )
    assert with_map.json()["attention"].startswith("data:image/png;base64,")
    as_file = httpx.post(f"{server}/predict", files={"file": ("rgb.jpg", raw)}, timeout=120)
    assert as_file.status_code == 200 and as_file.json()["caption"] == expected["rgb.jpg"]["caption"]
    bad = (images / "notes.jpg").read_bytes()
    for response in (
        httpx.post(f"{server}/predict", content=bad, headers={"Content-Type": "image/jpeg"}, timeout=120),
        httpx.post(f"{server}/predict", files={"file": ("notes.jpg", bad)}, timeout=120),
    ):
        assert response.status_code == 400 and response.json() == {"detail": expected["notes.jpg"]["error"]}
    two = httpx.post(f"{server}/predict", files={"a": ("a.jpg", raw), "b": ("b.jpg", raw)}, timeout=120)
    assert two.status_code == 400 and "none named 'image'" in two.json()["detail"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "send"),
    [(signal.SIGTERM, os.kill), (signal.SIGINT, os.kill), (signal.SIGINT, os.killpg)],
    ids=["SIGTERM", "SIGINT", "ctrl-c-to-the-group"],
)
def test_server_stops_on_a_signal_after_its_request_in_flight(bundle_dir, images, expected, signum, send):
    """The signal goes to the server process alone (as ``kill PID`` sends it) or, as Ctrl+C in a terminal, to
    its whole process group; a request waiting in a batch (``batch_timeout=6``) is answered, new ones get
    503, then every process of the group exits."""
    from vitattn.serve.stop import SHUTTING_DOWN

    proc, url = _start_server(bundle_dir, "max_batch_size=8", "batch_timeout=6", "timeout=30")
    port = int(url.rpartition(":")[2])
    try:
        assert len(_group(proc.pid)) >= 4  # the server, its manager, an inference worker, an API server
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(_post, url, images / "rgb.jpg", False)
            time.sleep(2)  # the request reaches the server and waits for its batch to fill
            send(proc.pid, signum)  # the server's pid is its group's id (start_new_session)
            deadline = time.monotonic() + 10
            while (health := httpx.get(f"{url}/health", timeout=10)).status_code != 503:
                assert time.monotonic() < deadline, "the server did not start refusing requests in 10 s"
                time.sleep(0.1)
            assert health.json() == {"detail": SHUTTING_DOWN}
            refused = _post(url, images / "rgb.jpg", True)
            assert refused.status_code == 503 and refused.json() == {"detail": SHUTTING_DOWN}
            answered = in_flight.result()
        finished = time.monotonic()
        assert answered.status_code == 200, answered.text
        assert answered.json()["caption"] == expected["rgb.jpg"]["caption"]
        assert proc.wait(timeout=30) == 0, proc.stdout.read().decode()
        while left := _group(proc.pid):
            assert time.monotonic() - finished < 10, f"processes {left} still running 10 s after the last answer"
            time.sleep(0.2)
        with socket.socket() as again:  # as uvicorn binds it on a restart
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            again.bind(("127.0.0.1", port))
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=10)
    finally:
        _end_group(proc)


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

    from benchmarks.load_serve import LoadConfig, Sample, _report

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
def test_load_script_passes_its_checks_on_a_small_run(bundle_dir, tmp_path, capsys):
    from benchmarks.load_serve import main

    out = tmp_path / "load.json"  # the script's main in this process (the server it starts is its own process)
    status = main([f"model={bundle_dir}", "requests=60", "clients=6", "warmup=4", "num_threads=1", f"out={out}"])
    report = json.loads(out.read_text())
    assert status == 0, capsys.readouterr().out[-3000:]
    assert report["passed"] and report["answered"] == 60 and report["status_counts"] == {"200": 54, "400": 6}
    assert report["latency_ms"]["p50"] <= report["latency_ms"]["p99"]


# ---- /embed and /classify: a head=coca model's routes


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> dict[str, Path]:
    """One noisy square of each colour the coca model was trained on, as a PNG file."""
    import numpy as np

    from tests.helpers.coca import COLOURS, colour_image

    folder, rng = tmp_path_factory.mktemp("colours"), np.random.default_rng(11)
    paths = {colour: folder / f"{colour}.png" for colour in COLOURS}
    for colour, path in paths.items():
        colour_image(colour, rng).save(path)
    return paths


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _answers(api, requests: list) -> list:
    """Each request through the LitAPI as LitServe takes it: decoded, predicted as one batch, encoded."""
    outputs = api.unbatch(api.predict(api.batch([api.decode_request(r) for r in requests])))
    return [api.encode_response(out) for out in outputs]


def _detail(response) -> str:
    assert response.status_code == 400, response
    detail = json.loads(response.body)["detail"]
    assert "\n" not in detail
    return detail


def test_embed_gives_the_python_apis_unit_embeddings_of_images_and_texts(colour_coca, colours):
    import torch

    from vitattn import Captioner
    from vitattn.serve import EmbedAPI

    api = EmbedAPI(str(colour_coca), max_batch_size=8)
    api.setup("cpu")
    texts = ["a red square", "the blue square", "a photo of a green."]
    answers = _answers(
        api,
        [
            _form(colours["red"]),
            {"text": texts[0]},
            {"image": _b64(colours["blue"])},
            {"texts": texts},
            {"file": _form(colours["yellow"])["image"]},
        ],
    )
    captioner = Captioner.load(colour_coca)
    want_images = captioner.embed_images([colours[c] for c in ("red", "blue", "yellow")])  # (3, E)
    want_texts = captioner.embed_texts(texts)  # (3, E)
    got_images = torch.tensor([answers[i]["embedding"] for i in (0, 2, 4)])
    torch.testing.assert_close(got_images, want_images, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(answers[1]["embedding"]), want_texts[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(answers[3]["embeddings"]), want_texts, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_images.norm(dim=-1), torch.ones(3))
    assert got_images[0] @ want_texts[0] > got_images[1] @ want_texts[0]  # the red image nearest "a red square"


@pytest.mark.parametrize(
    "request_, message",
    [
        ({}, "the request has no 'image', 'text' or 'texts'"),
        ({"text": 3}, "'text' must be a string, got 3"),
        ({"texts": []}, "'texts' must be a non-empty list of strings, got []"),
        ({"texts": ["a", 1]}, "'texts' must be a non-empty list of strings"),
        ({"text": "a", "texts": ["b"]}, "the request has both 'text' and 'texts'"),
        ({"text": "a", "image": "AAAA"}, "the request has an image and text"),
        ({"image": "@@"}, "'image' is not valid base64"),
    ],
)
def test_embed_refuses_bad_requests_in_one_line_without_failing_the_batch(colour_coca, colours, request_, message):
    from vitattn.serve import EmbedAPI

    api = EmbedAPI(str(colour_coca), max_batch_size=4)
    api.setup("cpu")
    bad, good = _answers(api, [request_, {"text": "a red square"}])
    assert message in _detail(bad)
    assert len(good["embedding"]) == 16


def test_classify_gives_zero_shot_probabilities_most_probable_first(colour_coca, colours):
    import torch

    from vitattn import Classifier
    from vitattn.serve import ClassifyAPI

    api = ClassifyAPI(str(colour_coca), max_batch_size=8)
    api.setup("cpu")
    four, two, templates = ["blue", "yellow", "red", "green"], ["green", "red"], ["a {}.", "the {} square"]
    answers = _answers(
        api,
        [
            {"image": _b64(colours["red"]), "labels": four},
            _form(colours["green"], labels="green, red", templates="a {}.|the {} square"),
            {"image": _b64(colours["yellow"]), "labels": four, "templates": templates},
        ],
    )
    cases = [("red", four, None), ("green", two, templates), ("yellow", four, templates)]
    for answer, (colour, labels, prompts) in zip(answers, cases):
        want = Classifier.load(colour_coca, labels=labels, templates=prompts).predict(colours[colour], top_k=10)
        assert answer["labels"] == want.labels and answer["labels"][0] == colour
        torch.testing.assert_close(answer["probabilities"], want.probabilities, rtol=0, atol=1e-5)
        assert answer["probabilities"] == sorted(answer["probabilities"], reverse=True)
        assert sum(answer["probabilities"]) == pytest.approx(1.0, abs=1e-5)
    assert answers[0]["probabilities"] != answers[2]["probabilities"]  # the templates matter


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"labels": []}, "labels is empty; give the class names to choose from"),
        ({"labels": ""}, "labels is empty"),
        ({"labels": ["red", "red"]}, "labels repeats ['red']; give each class name once"),
        ({"labels": "red,blue,red"}, "labels repeats ['red']"),
        ({"labels": ["red", ""]}, "each class name is a non-blank string"),
        ({"labels": 3}, "'labels' must be a list of strings or one string, got 3"),
        ({}, "the request has no 'labels'"),
        ({"labels": ["red"], "templates": ["a photo"]}, "template 'a photo' has no {}"),
        ({"labels": ["red"], "templates": []}, "holds no template"),
        ({"labels": ["red"], "templates": str(Path(__file__))}, "has no {}"),  # a path is a template, never read
        ({"labels": ["red"], "image": None}, "the request has no 'image' field"),
    ],
)
def test_classify_refuses_bad_labels_templates_and_images_in_one_line(colour_coca, colours, fields, message):
    from vitattn.serve import ClassifyAPI

    api = ClassifyAPI(str(colour_coca), max_batch_size=4)
    api.setup("cpu")
    request_ = {"image": _b64(colours["red"]), **fields}
    if request_["image"] is None:
        del request_["image"]
    bad, good = _answers(api, [request_, {"image": _b64(colours["blue"]), "labels": ["red", "blue"]}])
    assert message in _detail(bad)
    assert good["labels"][0] == "blue"


def test_embedding_routes_are_served_for_coca_and_answer_404_in_one_line_otherwise(colour_coca, bundle_dir):
    from starlette.testclient import TestClient

    from vitattn.bundle import load_model
    from vitattn.serve import build_server, serving_apis

    apis, refused = serving_apis(CaptionAPI(str(colour_coca), max_batch_size=3), load_model(colour_coca))
    assert [a.api_path for a in apis] == ["/predict", "/embed", "/classify"] and refused is None
    assert [a.max_batch_size for a in apis] == [3, 3, 3]
    paths = {getattr(r, "path", None) for r in build_server(apis, accelerator="cpu").app.router.routes}
    assert {"/predict", "/embed", "/classify"} <= paths
    apis, refused = serving_apis(CaptionAPI(str(bundle_dir)), load_model(bundle_dir))
    assert [a.api_path for a in apis] == ["/predict", "/classify"]  # a head=caption model classifies by likelihood
    client = TestClient(build_server(apis, refused=refused, accelerator="cpu").app)
    response = client.post("/embed", json={"text": "a cat"})
    assert response.status_code == 404
    detail = response.json()["detail"]
    assert detail.startswith(f"model={bundle_dir} is a head=caption model without image and text embeddings")
    assert "POST /embed needs a head=coca model" in detail and "\n" not in detail


def test_classify_on_a_caption_model_answers_as_the_python_api_by_likelihood(bundle_dir, colours):
    import torch

    from vitattn import Classifier
    from vitattn.serve import ClassifyAPI

    api = ClassifyAPI(str(bundle_dir), max_batch_size=4)
    api.setup("cpu")
    labels = ["red circle", "blue square", "green"]
    answers = _answers(
        api,
        [
            {"image": _b64(colours["red"]), "labels": labels, "templates": ["a {}", "the {} on the left"]},
            {"image": _b64(colours["blue"]), "labels": labels, "scorer": "both"},
            {"image": _b64(colours["blue"]), "labels": labels, "scorer": "best"},
        ],
    )
    want = Classifier.load(bundle_dir, labels=labels, templates=["a {}", "the {} on the left"])
    want = want.predict(colours["red"], top_k=10)
    assert answers[0]["labels"] == want.labels
    torch.testing.assert_close(answers[0]["probabilities"], want.probabilities, rtol=0, atol=1e-5)
    assert "scorer=both needs image and text embeddings" in _detail(answers[1])
    assert "'scorer' is 'best'; choose one of" in _detail(answers[2])


@pytest.mark.slow
def test_a_coca_server_embeds_and_classifies_over_http(colour_coca, colours, server):
    from vitattn import Captioner, Classifier

    proc, url = _start_server(colour_coca, "max_batch_size=4")
    try:
        red = colours["red"].read_bytes()
        image = httpx.post(f"{url}/embed", files={"image": ("red.png", red)}, timeout=120)
        texts = httpx.post(f"{url}/embed", json={"texts": ["a red square", "a blue square"]}, timeout=120)
        labels = ["blue", "red", "green"]
        form = httpx.post(f"{url}/classify", files={"image": ("red.png", red)}, data={"labels": "blue,red,green"})
        raw = httpx.post(
            f"{url}/classify?labels=blue,red,green", content=red, headers={"Content-Type": "image/png"}, timeout=120
        )
        bad = httpx.post(f"{url}/classify", json={"image": _b64(colours["red"]), "labels": ["red", "red"]})
        caption = httpx.post(f"{url}/predict", files={"image": ("red.png", red)}, timeout=120)
    finally:
        _end_group(proc)
    captioner = Captioner.load(colour_coca)
    assert image.json()["embedding"] == pytest.approx(captioner.embed_images(colours["red"])[0].tolist(), abs=1e-5)
    want = captioner.embed_texts(["a red square", "a blue square"]).tolist()
    assert [row == pytest.approx(w, abs=1e-5) for row, w in zip(texts.json()["embeddings"], want)] == [True, True]
    expected = Classifier.load(colour_coca, labels=labels).predict(colours["red"], top_k=3)
    for response in (form, raw):
        assert response.status_code == 200 and response.json()["labels"] == expected.labels == [
            "red",
            *expected.labels[1:],
        ]
        assert response.json()["probabilities"] == pytest.approx(expected.probabilities, abs=1e-5)
    assert bad.status_code == 400 and bad.json() == {"detail": "labels repeats ['red']; give each class name once"}
    assert caption.status_code == 200 and caption.json()["caption"] == captioner.caption(colours["red"])
    # the head=caption server of this module has no embeddings: /embed answers 404, with why (it classifies by
    # likelihood: test_classify_on_a_caption_model_answers_as_the_python_api_by_likelihood)
    refused = httpx.post(f"{server}/embed", json={"text": "a cat"}, timeout=60)
    assert refused.status_code == 404 and "needs a head=coca model" in refused.json()["detail"]
