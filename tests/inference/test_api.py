import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.bundles import distinct, make_caption_bundle, make_classifier_bundle, teacher_forced_log_prob
from tests.helpers.coca import COLOURS, colour_image
from vitattn import Captioner, Classifier
from vitattn.bundle import load_bundle
from vitattn.data.images import BadImageError, read_image
from vitattn.inference import caption_images

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def caption_dir(tmp_path_factory) -> Path:
    return make_caption_bundle(tmp_path_factory.mktemp("api") / "caption")


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory) -> Path:
    return make_classifier_bundle(tmp_path_factory.mktemp("api") / "classifier")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Path]:
    """Five small RGB photos of different sizes and colours (red, green, blue, yellow, grey, with noise), as files."""
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    colours = [(200, 40, 40), (40, 160, 60), (40, 90, 215), (240, 200, 20), (128, 128, 128)]
    paths = []
    for i, ((w, h), colour) in enumerate(zip([(40, 30), (32, 32), (50, 64), (33, 45), (64, 40)], colours)):
        path = folder / f"p{i}.png"
        pixels = np.clip(np.array(colour) + rng.integers(-30, 30, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def test_captioner_pixels_are_the_file_readers_for_every_image_kind(caption_dir, photos):
    captioner = Captioner.load(caption_dir)
    path = photos[0]
    pil = Image.open(path)
    array = np.array(pil.convert("RGB"))  # (H, W, 3) uint8
    as_uint8 = torch.from_numpy(array).permute(2, 0, 1)  # (3, H, W)
    as_float = as_uint8.float() / 255
    expected = captioner.transform(read_image(path))  # what vitattn-caption feeds the model
    pixels = captioner.pixels([str(path), path, pil, array, as_uint8, as_float])
    for row in pixels:
        torch.testing.assert_close(row, expected, rtol=0, atol=0)


def test_caption_of_files_equals_vitattn_captions_batch_captioner(caption_dir, photos):
    captioner = Captioner.load(caption_dir)
    records = caption_images(load_bundle(caption_dir), photos, num_workers=0)
    distinct([r["caption"] for r in records])  # photos swapped in the batch would show
    assert captioner.caption(photos) == [r["caption"] for r in records]
    assert captioner.caption(photos[1]) == records[1]["caption"]  # one image -> one string


@pytest.mark.parametrize("generate", [{}, {"num_beams": 3, "max_new_tokens": 5}])
def test_caption_batches_give_the_captions_of_one_image_at_a_time(caption_dir, photos, generate):
    captioner = Captioner.load(caption_dir)
    one_by_one = [captioner.caption(p, **generate) for p in photos]
    distinct(one_by_one)  # photos swapped in a batch would show
    assert captioner.caption(photos, batch_size=2, **generate) == one_by_one
    assert captioner.caption(tuple(photos), batch_size=32, **generate) == one_by_one


def test_caption_details_score_is_the_models_log_probability(caption_dir, photos):
    captioner = Captioner.load(caption_dir)
    details = captioner.caption(photos, details=True, num_beams=2)
    pixels = captioner.pixels(photos)
    with torch.no_grad():
        tokens = captioner.model.generate(pixels, num_beams=2)
        oracle = teacher_forced_log_prob(captioner.model, pixels, tokens)
    distinct([c.text for c in details])
    for caption, row, score in zip(details, tokens.tolist(), oracle.tolist()):
        assert caption.tokens == [t for t in row if t != captioner.vocab.pad_id]
        assert caption.text == captioner.vocab.decode(caption.tokens)
        assert caption.score == pytest.approx(score, abs=1e-4)


def test_caption_details_score_is_what_the_search_ranked_under_its_controls(caption_dir, photos):
    from vitattn.models.generate import Controls, sequence_log_prob

    captioner = Captioner.load(caption_dir)
    controls = Controls(repetition_penalty=1.05)
    details = captioner.caption(photos, details=True, num_beams=3, repetition_penalty=1.05)
    pixels = captioner.pixels(photos)
    model = captioner.model
    with torch.no_grad():
        tokens = model.generate(pixels, num_beams=3, repetition_penalty=1.05)
        step = model.decode_step(model.encode(pixels), tokens.shape[1] + 1)
        oracle = sequence_log_prob(step, tokens, model.special_ids, controls)
        step = model.decode_step(model.encode(pixels), tokens.shape[1] + 1)
        uncontrolled = sequence_log_prob(step, tokens, model.special_ids)  # the same tokens, no penalty
    assert [c.score for c in details] == pytest.approx(oracle.tolist(), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(oracle.tolist(), uncontrolled.tolist())) > 1e-2  # the penalty shows


def _attention_seen_while_captioning(model, pixels: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What the model attends to while it captions ``pixels`` greedily, computed here, not by vitattn: each
    attention layer's ``attend`` is wrapped to take softmax(q kᵀ / √d) of the queries and keys it is given
    (neither ``record_attention`` nor ``vitattn.inference.attention_maps`` runs). Returns the last decoder
    layer's cross-attention of each decoding step, (B, H, 1, N) each, and each encoder layer's (B, H, N, N)."""
    from vitattn.layers import MultiHeadAttention

    seen: dict[str, list[torch.Tensor]] = {}

    def catch(name: str, attend):
        def attend_and_keep(q, k, v, *args, **kwargs):
            seen.setdefault(name, []).append((q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).softmax(-1))
            return attend(q, k, v, *args, **kwargs)

        return attend_and_keep

    layers = {n: m for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    for name, layer in layers.items():
        layer.attend = catch(name, layer.attend)
    try:
        with torch.inference_mode():
            model.generate(pixels)
    finally:
        for layer in layers.values():
            del layer.attend
    last = f"decoder.layers.{len(model.decoder.layers) - 1}.mha2"
    return seen[last], [seen[f"encoder.blocks.{i}.mha"][0] for i in range(len(model.encoder.blocks))]


def _expected_maps(model, pixels: torch.Tensor, words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(words, gh, gw) maps of the word each step chose: the step's cross-attention averaged over heads,
    the class token dropped, renormalised; and (gh, gw) the rollout: per encoder layer, heads averaged,
    the identity added and rows renormalised, multiplied first layer rightmost, the class row over the patches."""
    cross, encoder = _attention_seen_while_captioning(model, pixels)
    gh, gw = model.encoder.patch_embed.grid_size
    maps = torch.cat([step[0].mean(0)[:, 1:] for step in cross[:words]])  # (words, N - 1)
    rollout = torch.eye(encoder[0].shape[-1])
    for weights in encoder:
        a = weights[0].mean(0) + torch.eye(weights.shape[-1])
        rollout = (a / a.sum(-1, keepdim=True)) @ rollout
    row = rollout[0, 1:]
    return (maps / maps.sum(-1, keepdim=True)).view(words, gh, gw), (row / row.sum()).view(gh, gw)


@pytest.fixture
def sharp_captioner(caption_dir) -> Captioner:
    """The fixture captioner with sharper attention (queries and keys x 10) than a fresh model's near-uniform
    one: heads and layers attend differently, so a map of the wrong head or layer shows."""
    from vitattn.layers import MultiHeadAttention

    captioner = Captioner.load(caption_dir)
    with torch.no_grad():
        for layer in captioner.model.modules():
            if isinstance(layer, MultiHeadAttention):
                layer.wq.weight.mul_(10)
                layer.wk.weight.mul_(10)
    return captioner


def test_attention_maps_are_what_each_decoding_step_attended_to(sharp_captioner, photos):
    captioner = sharp_captioner
    maps = captioner.attention_maps(photos[2])
    assert maps.caption == captioner.caption(photos[2])
    assert len(maps.words) == maps.cross.shape[0] > 0
    cross, rollout = _expected_maps(captioner.model, captioner.pixels([photos[2]]), len(maps.words))
    torch.testing.assert_close(maps.cross, cross)
    torch.testing.assert_close(maps.rollout, rollout)


def test_figures_vitattn_caption_draws_show_what_each_step_attended_to(sharp_captioner, photos, monkeypatch):
    """The figure path of vitattn-caption attention_maps= and vitattn-serve attention=true: the maps handed
    to each figure are those of the decoding steps."""
    import vitattn.inference.attention_maps as figures

    captioner = sharp_captioner
    drawn = []
    monkeypatch.setattr(
        figures, "attention_figure", lambda image, words, cross, rollout, title: drawn.append((words, cross, rollout))
    )
    pixels = captioner.pixels(photos[:3])
    _, tokens = captioner.caption_pixels(pixels)
    figures.attention_figures(captioner.model, pixels, tokens, captioner.vocab, captioner.bundle.preprocess, [None] * 3)
    assert len(drawn) == 3
    for row, (words, cross, rollout) in enumerate(drawn):
        expected_cross, expected_rollout = _expected_maps(captioner.model, pixels[row : row + 1], len(words))
        torch.testing.assert_close(cross[: len(words)], expected_cross)
        torch.testing.assert_close(rollout, expected_rollout)


def test_classifier_predict_is_the_models_top_k(classifier_dir, photos):
    classifier = Classifier.load(classifier_dir)
    pixels = torch.stack([classifier.transform(read_image(p)) for p in photos])
    with torch.no_grad():
        probs = classifier.model(pixels).softmax(-1)
    predictions = classifier.predict(photos, top_k=2, batch_size=2)
    distinct([p.labels for p in predictions])  # photos swapped in a batch would show
    for prediction, row in zip(predictions, probs):
        values, indices = row.topk(2)
        assert prediction.labels == [classifier.class_names[i] for i in indices.tolist()]
        assert prediction.probabilities == pytest.approx(values.tolist(), abs=1e-6)
    single = classifier.predict(photos[0], top_k=10)  # more than the classes: all of them
    assert sorted(single.labels) == sorted(classifier.class_names)
    assert sum(single.probabilities) == pytest.approx(1.0, abs=1e-5)


def test_an_empty_list_gives_an_empty_list(caption_dir, classifier_dir):
    assert Captioner.load(caption_dir).caption([]) == []
    assert Classifier.load(classifier_dir).predict([]) == []


@pytest.mark.parametrize(
    "image,error,message",
    [
        ({"path": "cat.jpg"}, TypeError, r"images\[0\] is .* \(dict\); pass a file path, a PIL image, a \(height, wid"),
        (b"\x89PNG", TypeError, r"\(bytes\); pass a file path"),
        (np.zeros((8, 8, 3), np.float32), ValueError, r"float32 numpy array; pass uint8 pixels"),
        (np.zeros((4, 8, 8, 3), np.uint8), ValueError, r"shape \[4, 8, 8, 3\]; pass \(height, width, 3\)"),
        (torch.randn(3, 8, 8), ValueError, r"float tensor outside \[0, 1\]; pass pixels in \[0, 1\]"),
        (torch.zeros(3, 8, 8, dtype=torch.int32), ValueError, r"torch.int32 tensor; pass uint8 pixels"),
    ],
)
def test_caption_refuses_an_image_of_the_wrong_kind_in_one_line(caption_dir, image, error, message):
    captioner = Captioner.load(caption_dir)
    with pytest.raises(error, match=message) as info:
        captioner.caption([image])
    assert "\n" not in str(info.value)


def test_caption_names_a_file_it_cannot_read(caption_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(BadImageError, match=r"notes.txt: not an image \(unrecognised file format\)"):
        Captioner.load(caption_dir).caption(tmp_path / "notes.txt")


def test_load_refuses_the_other_task_and_names_the_right_class(caption_dir, classifier_dir):
    with pytest.raises(ValueError, match="is a classification model; load it with Classifier.load"):
        Captioner.load(classifier_dir)
    with pytest.raises(ValueError, match="is a caption model; load it with Captioner.load"):
        Classifier.load(caption_dir)


def test_readme_python_api_example_runs_as_written(caption_dir, classifier_dir, photos, tmp_path, monkeypatch):
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python API") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shutil.copytree(caption_dir, tmp_path / "runs" / "caption" / "RUN")
    shutil.copytree(classifier_dir, tmp_path / "runs" / "classification" / "RUN")
    shutil.copy(photos[0], tmp_path / "cat.jpg")  # a PNG named .jpg: the reader goes by content
    shutil.copy(photos[1], tmp_path / "dog.png")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert len(namespace["captions"]) == 3 and all(isinstance(c, str) for c in namespace["captions"])
    assert namespace["best"].text == namespace["captioner"].caption("cat.jpg")
    assert namespace["prediction"].labels[0] in ("cat", "dog", "bird")
    assert (tmp_path / "cat_attention.png").stat().st_size > 0


def _rerank_seen(captioner: Captioner, images: list, **generate) -> tuple[list[str], list[list[str]]]:
    """The captions ``caption(images, **generate)`` returns and the candidates (as texts) each was chosen from."""
    seen = []
    choose = captioner.model.choose

    def spy(pixels, candidates):
        seen.append(candidates.clone())
        return choose(pixels, candidates)

    captioner.model.choose = spy
    try:
        captions = captioner.caption(images, **generate)
    finally:
        del captioner.model.choose
    texts = captioner.vocab.decode_batch(torch.cat(seen))
    N = len(texts) // len(images)
    return captions, [texts[i * N : (i + 1) * N] for i in range(len(images))]


@pytest.mark.parametrize(
    "generate",
    [{"num_beams": 5, "rerank": 5}, {"num_beams": 6, "rerank": 3}, {"do_sample": True, "rerank": 6}],
    ids=["beam-5-of-5", "beam-3-of-6", "sample-6"],
)
def test_rerank_keeps_the_candidate_whose_text_embedding_is_nearest_the_image(colour_coca, generate):
    """The oracle embeds every candidate through the public API (texts, not token ids) and takes the argmax."""
    rng = np.random.default_rng(7)
    images = [colour_image(c, rng) for c in COLOURS for _ in range(3)]
    captioner = Captioner.load(colour_coca)
    if generate.get("do_sample"):
        generate = {**generate, "generator": torch.Generator().manual_seed(0)}
    captions, candidates = _rerank_seen(captioner, images, batch_size=5, **generate)
    image_embeddings = captioner.embed_images(images)  # (B, E)
    chosen = []
    for b, texts in enumerate(candidates):
        assert len(texts) == generate["rerank"]
        cosine = captioner.embed_texts(texts) @ image_embeddings[b]  # (N,)
        i = texts.index(captions[b])
        assert cosine[i] >= cosine.max() - 1e-6, (b, texts, cosine.tolist())  # identical texts may tie
        chosen.append(i)
    assert any(i > 0 for i in chosen), chosen  # the choice is not always the beam's best (or the first sample)
    distinct(captions, at_least=2)


def test_rerank_is_off_at_one_and_the_beams_best_is_kept(colour_coca):
    captioner = Captioner.load(colour_coca)
    images = [colour_image(c, np.random.default_rng(1)) for c in COLOURS]
    assert captioner.caption(images, num_beams=4, rerank=1) == captioner.caption(images, num_beams=4)


@pytest.mark.parametrize(
    "generate, message",
    [
        ({"num_beams": 2, "rerank": 3}, "rerank=3 chooses among the beam's best captions and needs num_beams >= 3"),
        ({"num_beams": 1, "rerank": 2}, "needs num_beams >= 2 (num_beams=1; leave num_beams out for 2), or do_"),
        ({"num_beams": 3, "rerank": 0}, "rerank=0 must be at least 1"),
    ],
)
def test_rerank_refuses_settings_it_cannot_use_in_one_line(colour_coca, generate, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        Captioner.load(colour_coca).caption(colour_image("red", np.random.default_rng(0)), **generate)
    assert "\n" not in str(err.value)


def test_rerank_alone_takes_as_many_beams_over_the_bundles_stored_one(colour_coca, tmp_path, capsys):
    from vitattn.cli.caption import main as caption_main

    bundle = tmp_path / "bundle"
    shutil.copytree(colour_coca, bundle)
    config = json.loads((bundle / "config.json").read_text())
    (bundle / "config.json").write_text(json.dumps({**config, "generate": {"num_beams": 1}}))
    rng = np.random.default_rng(3)
    paths = [tmp_path / f"{i}.png" for i in range(8)]
    for path, colour in zip(paths, [c for c in COLOURS for _ in range(2)]):
        colour_image(colour, rng).save(path)
    (tmp_path / "list.txt").write_text("".join(f"{p}\n" for p in paths))
    args = [f"model={bundle}", f"images={tmp_path / 'list.txt'}", "num_workers=0", "device=cpu", "progress=false"]
    assert caption_main([*args, f"out={tmp_path / 'c.jsonl'}", "rerank=4"]) == 0
    written = [json.loads(line)["caption"] for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert written == Captioner.load(colour_coca).caption(paths, num_beams=4, rerank=4)
    assert Captioner.load(bundle).caption(paths, rerank=4) == written
    capsys.readouterr()
    assert caption_main([*args, f"out={tmp_path / 'd.jsonl'}", "rerank=4", "num_beams=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs num_beams >= 4 (num_beams=2; leave num_beams out for 4)" in err[0], err


def test_rerank_on_a_model_without_embeddings_is_refused_in_one_line(caption_dir, photos):
    with pytest.raises(
        ValueError, match=r"^rerank=3 chooses among captions by image and text embeddings, which only"
    ) as err:
        Captioner.load(caption_dir).caption(photos[0], num_beams=3, rerank=3)
    assert "head=coca" in str(err.value) and "\n" not in str(err.value)


def test_vitattn_caption_rerank_writes_the_captions_the_api_chooses(colour_coca, caption_dir, tmp_path, capsys):
    from vitattn.cli.caption import main as caption_main

    rng = np.random.default_rng(3)
    paths = []
    for i, colour in enumerate([c for c in COLOURS for _ in range(2)]):
        paths.append(tmp_path / f"{i}.png")
        colour_image(colour, rng).save(paths[-1])
    (tmp_path / "list.txt").write_text("".join(f"{p}\n" for p in paths))
    args = [f"images={tmp_path / 'list.txt'}", "num_beams=5", "rerank=4", "device=cpu", "progress=false"]
    assert caption_main([f"model={colour_coca}", f"out={tmp_path / 'c.jsonl'}", "num_workers=0", *args]) == 0
    written = [json.loads(line)["caption"] for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    chosen = Captioner.load(colour_coca).caption(paths, num_beams=5, rerank=4)
    assert written == chosen
    assert chosen != Captioner.load(colour_coca).caption(paths, num_beams=5)  # reranking changed some captions
    capsys.readouterr()
    assert caption_main([f"model={caption_dir}", f"out={tmp_path / 'd.jsonl'}", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: rerank=4 chooses among captions by image and text embeddings"), err
