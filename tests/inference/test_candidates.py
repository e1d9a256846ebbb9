"""K scored caption candidates per image (``num_return_sequences``): one encoding whose cross-attention keys the
K rows share, identical captions merged, a candidate fixed by (seed, image key) whatever the batch, process count
or kill -9, scores equal to a hand computation, null scores counted in the manifest."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.helpers.bundles import CAPTION_PREPROCESS, CAPTION_WORDS, teacher_forced_log_prob
from tests.helpers.processes import write_images
from tests.helpers.runs import console_script
from tests.inference.test_captioning_processes import _kill, _start, _wait_for_chunks
from vitattn.bundle import load_bundle, save_bundle
from vitattn.data.tokenizer import Vocabulary
from vitattn.inference import caption_files, list_inputs
from vitattn.inference.api import Captioner
from vitattn.inference.candidates import CandidateFilter, CandidateOptions, candidate_lists, write_manifest
from vitattn.inference.captioning import manifest_path
from vitattn.layers.transformer import LayerCache
from vitattn.models import CocaCaptioner
from vitattn.models.generate import Candidates

SAMPLE = dict(do_sample=True, top_p=0.95)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("pool"), 7, img_size=40)


def _pixels(model, folder: Path) -> torch.Tensor:
    return torch.stack([model.transform(Image.open(p).convert("RGB")) for p in list_inputs(folder).paths])


@pytest.mark.parametrize(
    "settings, rows",
    [(SAMPLE, {6}), ({}, {5, 1, 6})],  # 5 samples and the greedy row together; the beam, greedy, then the scoring
    ids=["sampled", "beam"],
)
def test_the_encoder_runs_once_per_image_and_the_k_rows_share_its_keys(
    bundle_dir, images, tmp_path, monkeypatch, settings, rows
):
    bundle = load_bundle(bundle_dir)
    encoded, cross_rows, steps = [], [], []
    encode, append = bundle.model.encoder.forward_tokens, LayerCache.append
    monkeypatch.setattr(bundle.model.encoder, "forward_tokens", lambda x, *a: encoded.append(len(x)) or encode(x, *a))

    def spy(cache, k, v):
        cross_rows.append(None if cache.cross_k is None else cache.cross_k.shape[0])
        steps.append(k.shape[0])
        return append(cache, k, v)

    monkeypatch.setattr(LayerCache, "append", spy)
    out = tmp_path / "once.jsonl"
    options = CandidateOptions(5, include_greedy=True)
    inputs = list_inputs(images)
    caption_files(bundle, inputs, out, batch_size=4, num_workers=0, progress=False, candidates=options, **settings)
    assert encoded == [4, 3]  # each image once, for its 5 candidates and its greedy caption
    assert set(steps) == {b * r for b in (4, 3) for r in rows}
    assert set(cross_rows) - {None} == {4, 3}  # their cross-attention keys: one row per image, not per row
    assert len(_jsonl(out)) == 7


def test_candidates_are_the_search_s_rows_with_the_plain_model_s_log_probability(bundle_dir, images):
    bundle = load_bundle(bundle_dir)
    model, pixels = bundle.model, _pixels(bundle, images)
    for settings in (dict(**SAMPLE, temperature=1.5, repetition_penalty=1.3), dict(num_beams=4)):
        found = model.candidates(pixels, 3, include_greedy=True, **settings)
        assert isinstance(found, Candidates) and found.tokens.shape[:2] == (7, 4)
        rows = found.tokens.flatten(0, 1)
        plain = teacher_forced_log_prob(model, pixels.repeat_interleave(4, 0), rows, banned=False).view(7, 4)
        torch.testing.assert_close(found.log_prob, plain, rtol=1e-5, atol=1e-4)
        assert torch.equal(found.length, (found.tokens != model.decoder.pad_id).sum(-1))
        greedy = model.generate(pixels, repetition_penalty=settings.get("repetition_penalty", 1.0))
        assert torch.equal(found.tokens[:, 0, : greedy.shape[1]], greedy)  # row 0: the model's own greedy caption
    beams = model.candidates(pixels, 3, num_beams=4)
    expected = model.generate(pixels, num_beams=4, rerank=1).view(7, 1, -1)
    assert torch.equal(beams.tokens[:, :1, : expected.shape[-1]], expected)  # the beam's best first


def test_a_candidate_depends_on_its_seed_and_key_alone(bundle_dir, images):
    model = load_bundle(bundle_dir).model
    pixels = _pixels(load_bundle(bundle_dir), images)
    keys = [f"img{i}" for i in range(7)]
    whole = model.candidates(pixels, 4, keys, seed=3, **SAMPLE)
    alone = model.candidates(pixels[5:6], 4, keys[5:6], seed=3, **SAMPLE)  # another batch, another place
    width = alone.tokens.shape[-1]
    assert torch.equal(whole.tokens[5:6, :, :width], alone.tokens)
    other_key = model.candidates(pixels[5:6], 4, ["img0"], seed=3, **SAMPLE)
    other_seed = model.candidates(pixels[5:6], 4, keys[5:6], seed=4, **SAMPLE)
    assert not torch.equal(other_key.tokens, alone.tokens) and not torch.equal(other_seed.tokens, alone.tokens)


def test_identical_candidates_appear_once_with_their_count(bundle_dir, images, monkeypatch):
    bundle = load_bundle(bundle_dir)
    pixels = _pixels(bundle, images)[:2]
    # the toolkit's tokens: case and punctuation apart, "A red circle." is "a red circle"
    texts = ["A red circle.", "a red circle", "blue square", "a red circle !", "blue square", "red"]
    monkeypatch.setattr(bundle.vocab, "decode_batch", lambda tokens: texts[: len(tokens)] * (len(tokens) // 6))
    lists = candidate_lists(bundle, pixels, ["a", "b"], CandidateOptions(5, include_greedy=True), dict(SAMPLE))
    assert [[(c["text"], c["count"], c.get("greedy", False)) for c in cs] for cs in lists] == [
        [("A red circle.", 3, True), ("blue square", 2, False), ("red", 1, False)]
    ] * 2


def _coca_bundle(bundle_dir: Path, folder: Path, words=CAPTION_WORDS) -> Path:
    torch.manual_seed(1)
    base = load_bundle(bundle_dir).model
    model = CocaCaptioner(base.encoder, base.decoder, embed_dim=16, text_depth=1, text_num_heads=2).eval()
    return save_bundle(folder, model, task="caption", preprocess=CAPTION_PREPROCESS, vocab=Vocabulary(words))


def _narrow_captioner(bundle_dir: Path, folder: Path) -> Path:
    """The tiny captioner's weights under a vocabulary without "circle" (its id is ``<unk>`` there), with its own
    normalisation: a filter apart from the captioner, which sees the images as it would."""
    base = load_bundle(bundle_dir)
    words = [w if w != "circle" else "triangle" for w in CAPTION_WORDS]
    vocab = Vocabulary(words)
    return save_bundle(
        folder, base.model, task="caption", preprocess={**CAPTION_PREPROCESS, "mean": [0.4] * 3}, vocab=vocab
    )


def test_filter_scores_equal_a_hand_computation(bundle_dir, images, tmp_path):
    bundle = load_bundle(bundle_dir)
    pixels = _pixels(bundle, images)
    texts = [["a red circle", "blue square on the left"], ["green"]]
    likelihood = CandidateFilter(bundle, "self")
    assert likelihood.kind == "likelihood"
    got = likelihood.score(pixels[:2], texts)
    model = bundle.model
    for b, row in enumerate(texts):
        for text, score in zip(row, got[b]):
            ids = torch.tensor([bundle.vocab.encode(text)[1:]])  # after <bos>, <eos> included
            with torch.no_grad():
                expected = teacher_forced_log_prob(model, pixels[b : b + 1], ids, banned=False) / ids.shape[1]
            assert score == pytest.approx(float(expected), abs=1e-5)
    coca = load_bundle(_coca_bundle(bundle_dir, tmp_path / "coca"))
    contrastive = CandidateFilter(coca, "coca")
    assert contrastive.kind == "contrastive"
    got = contrastive.score(pixels[:2], texts)
    with torch.no_grad():
        image = coca.model.embed_images(pixels[:2])
    for b, row in enumerate(texts):
        for text, score in zip(row, got[b]):
            with torch.no_grad():
                text_embedding = coca.model.embed_texts(torch.tensor([coca.vocab.encode(text)]))
            assert score == pytest.approx(float(image[b] @ text_embedding[0]), abs=1e-5)
    with pytest.raises(ValueError, match="score_by=contrastive.*head=coca"):
        CandidateFilter(bundle, "self", "contrastive")


def test_a_run_writes_candidates_scored_by_a_filter_apart_and_a_manifest_counting_null_scores(bundle_dir, tmp_path):
    folder = write_images(tmp_path / "pool", 6, img_size=40)
    (folder / "broken.jpg").write_bytes(b"not an image")
    narrow = _narrow_captioner(bundle_dir, tmp_path / "narrow")
    out = tmp_path / "cands.jsonl"
    cmd = [
        str(console_script("vitattn-caption")),
        f"model={bundle_dir}",
        f"images={folder}",
        f"out={out}",
        "num_return_sequences=4",
        "do_sample=true",
        "include_greedy=true",
        f"score={narrow}",
        "seed=5",
        "num_workers=0",
        "progress=false",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]  # the broken image
    records = _jsonl(out)
    manifest = json.loads(manifest_path(out).read_text())
    scored = [c for r in records if "candidates" in r for c in r["candidates"]]
    nulls = [c for c in scored if c["score"] is None]
    assert nulls == [c for c in scored if "circle" in c["text"].split()] and nulls  # the filter cannot spell it
    assert all(r["caption"] == r["candidates"][0]["text"] and r["candidates"][0]["greedy"] for r in records[1:])
    assert manifest["counts"] == {
        "images": 7,
        "captioned": 6,
        "candidates": len(scored),
        "drawn": 6 * 5,
        "null_scores": len(nulls),
        "unreadable": 1,
    }
    assert manifest["unreadable"][0]["image"].endswith("broken.jpg") and manifest["unreadable"][0]["error"]
    assert manifest["filter"] == {"model": str(narrow), "score": "likelihood", "runtime": "torch"}
    assert manifest["captioner"] == str(bundle_dir) and manifest["settings"]["num_return_sequences"] == 4
    values = sorted(c["score"] for c in scored if c["score"] is not None)
    assert manifest["score_quantiles"]["0"] == values[0] and manifest["score_quantiles"]["1"] == values[-1]
    assert f"{len(nulls)} null" in done.stdout
    # the manifest is read from the files: written again from them, it is the same
    again = write_manifest(
        tmp_path / "again.json", [out], {k: manifest[k] for k in ("captioner", "filter", "settings")}
    )
    assert again == manifest


def test_candidate_settings_are_refused_in_one_line(bundle_dir, tmp_path, images):
    bundle = load_bundle(bundle_dir)
    inputs = list_inputs(images)
    with pytest.raises(ValueError, match="format=coco holds one caption per image"):
        caption_files(bundle, inputs, tmp_path / "c.json", format="coco", candidates=CandidateOptions(3))
    with pytest.raises(ValueError, match="rerank=2 keeps one of them; choose one"):
        bundle.model.candidates(_pixels(bundle, images), 3, do_sample=True, rerank=2)
    with pytest.raises(ValueError, match="needs num_beams >= 3"):
        bundle.model.candidates(_pixels(bundle, images), 3, num_beams=2)
    refused = subprocess.run(
        [str(console_script("vitattn-caption")), f"model={bundle_dir}", f"images={images}", "out=x", "score=y"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "add num_return_sequences=K" in refused.stderr


def test_captioner_caption_gives_a_list_per_image(bundle_dir, images):
    captioner = Captioner.load(bundle_dir)
    paths = list_inputs(images).paths
    lists = captioner.caption(paths[:3], num_return_sequences=4, seed=2, **SAMPLE)
    assert len(lists) == 3 and all(isinstance(texts, list) and 1 <= len(texts) <= 4 for texts in lists)
    assert captioner.caption(paths[1], num_return_sequences=4, seed=2, **SAMPLE) == lists[1]  # keyed by its path


@pytest.mark.slow
def test_candidates_are_the_same_from_two_processes_killed_and_resumed_as_from_one(bundle_dir, tmp_path):
    folder = write_images(tmp_path / "imgs", 30, img_size=40)
    stall = folder / "zzz_stall.jpg"
    os.mkfifo(stall)  # its reader blocks until killed: the run cannot finish while it is there
    out, parts = tmp_path / "two.jsonl", tmp_path / "two.jsonl.parts"
    settings = ["num_return_sequences=3", "do_sample=true", "top_p=0.9", "seed=11", "batch_size=2", "num_workers=0"]
    cmd = [str(console_script("vitattn-caption")), f"model={bundle_dir}", f"images={folder}", f"out={out}", *settings]
    cmd += ["num_threads=1", "progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    first = _start([*cmd, "devices=2", "accelerator=cpu"], tmp_path / "first.log", env)
    _wait_for_chunks(first, parts, 1, tmp_path / "first.log")
    _kill(first, first.pid)
    stall.unlink()
    Image.new("RGB", (40, 40), (40, 90, 215)).save(stall)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)  # one process resumes
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already captioned" in again.stderr
    one = tmp_path / "one.jsonl"
    alone = subprocess.run([*cmd[:3], f"out={one}", *cmd[4:]], capture_output=True, text=True, timeout=600, env=env)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert out.read_bytes() == one.read_bytes()
    assert sum(len(r["candidates"]) for r in _jsonl(one)) > 31  # sampled: not one caption each
