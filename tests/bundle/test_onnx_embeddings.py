"""The ONNX folder of a ``head=coca`` model: its image and text embedding graphs against the PyTorch model (fp32
and int8), zero-shot classification, similarity and rerank from the folder, and a caption-only folder refused."""

import base64
import json
import shutil

import numpy as np
import pytest
import torch

from tests.helpers.bundles import distinct, make_caption_bundle
from tests.helpers.coca import COLOURS, colour_image
from tests.helpers.onnx import check_int8_graphs
from vitattn import Captioner, Classifier
from vitattn.bundle import load_bundle, load_model
from vitattn.bundle.onnx_export import export_onnx
from vitattn.bundle.onnx_folder import GRAPHS, ONNX_CONFIG_FILE, sha256
from vitattn.cli.evaluate import main as eval_main
from vitattn.inference.embeddings import embed_pixels, embed_texts, encode_texts
from vitattn.inference.zero_shot import zero_shot_model

INT8_MIN_COSINE = 0.999  # measured: 0.9999 per row on the inputs below; int8 moves each embedding a little


@pytest.fixture
def coca(colour_coca, colour_coca_onnx):
    """The colour coca bundle (conftest's ``colour_coca``), its fp32 and int8 ONNX folders and the products the
    int8 export kept in fp32."""
    return colour_coca, colour_coca_onnx.fp32, colour_coca_onnx.int8, colour_coca_onnx.kept_fp32


def _pixels(captioner: Captioner, per_colour: int = 3) -> tuple[torch.Tensor, list[str]]:
    """(4 * per_colour + 4, 3, 32, 32) model inputs: colour images then noise; and the colours."""
    rng = np.random.default_rng(7)
    names = [c for c in COLOURS for _ in range(per_colour)]
    pixels = captioner.pixels([colour_image(c, rng) for c in names])
    return torch.cat([pixels, torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))]), names


# texts of 2 to the decoder's max_len=8 tokens (one cut to it), words inside and outside the vocabulary
TEXTS = ["red", "a photo of a blue square.", "the green", "an image of a yellow square of red", "a", "zebra blue"]


def _embeddings(folder, model):
    """The ONNX folder's image and text embeddings through vitattn.inference, and the PyTorch model's."""
    bundle = load_model(folder)
    pixels, _ = _pixels(Captioner(bundle))
    got = embed_pixels(bundle, pixels), embed_texts(bundle, TEXTS, batch_size=4)  # two batches of other lengths
    with torch.no_grad():
        expected = model.embed_images(pixels), model.embed_texts(encode_texts(bundle.vocab, TEXTS, model.max_len))
    return got, expected


def test_onnx_fp32_embeddings_equal_pytorch_within_1e5(coca):
    bundle, onnx_dir, _, _ = coca
    (images, texts), (expected_images, expected_texts) = _embeddings(onnx_dir, load_bundle(bundle).model)
    assert images.shape == (16, 16) and texts.shape == (len(TEXTS), 16)
    differences = (images - expected_images).abs().max().item(), (texts - expected_texts).abs().max().item()
    print(f"fp32 embeddings: max abs difference {differences[0]:.2e} (images), {differences[1]:.2e} (texts)")
    assert max(differences) <= 1e-5
    torch.testing.assert_close(images.norm(dim=-1), torch.ones(16))  # unit length, as the model's


def test_onnx_int8_embeddings_keep_the_direction_of_pytorchs(coca):
    bundle, _, int8_dir, kept = coca
    counts = check_int8_graphs(int8_dir, kept)  # the graphs, not the label: quantized, the kept products float
    assert {"image_embed", "text_embed"} <= set(counts)
    (images, texts), (expected_images, expected_texts) = _embeddings(int8_dir, load_bundle(bundle).model)
    cosines = torch.cat([(images * expected_images).sum(-1), (texts * expected_texts).sum(-1)])
    print(f"int8 embeddings: min cosine {cosines.min():.6f} to PyTorch's over {len(cosines)} rows")
    assert cosines.min().item() >= INT8_MIN_COSINE
    assert (images - expected_images).abs().max().item() > 1e-5  # int8 indeed: not the fp32 graphs
    torch.testing.assert_close(torch.cat([images, texts]).norm(dim=-1), torch.ones(len(cosines)))  # normalised


def test_onnx_folder_records_the_embedding_graphs_and_scale(coca):
    bundle, onnx_dir, _, _ = coca
    config = json.loads((onnx_dir / ONNX_CONFIG_FILE).read_text())
    assert tuple(config["graphs"]) == GRAPHS["coca"]
    assert all(sha256(onnx_dir / g["file"]) == g["sha256"] for g in config["graphs"].values())
    model = load_bundle(bundle).model
    assert config["embed"] == {"embed_dim": 16, "logit_scale": pytest.approx(model.logit_scale.item())}


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_zero_shot_and_similarity_from_an_onnx_folder_choose_as_pytorch(coca, precision):
    bundle, onnx_dir, int8_dir, _ = coca
    folder = onnx_dir if precision == "fp32" else int8_dir
    labels = ["yellow", "red", "blue", "green"]
    eager, onnx = Classifier.load(bundle, labels=labels), Classifier.load(folder, labels=labels)
    assert onnx.runtime == "onnx"
    pixels, truth = _pixels(Captioner.load(folder))
    with torch.no_grad():
        expected, got = eager.model(pixels).argmax(-1), onnx.model(pixels).argmax(-1)
    predicted = [labels[i] for i in got[: len(truth)]]
    distinct(predicted, at_least=4)
    assert predicted == truth and got.tolist() == expected.tolist()  # the noise images too
    rng = np.random.default_rng(3)
    images = [colour_image(c, rng) for c in COLOURS]
    texts = [f"a photo of a {c}." for c in reversed(COLOURS)]
    eager_similarity = Captioner.load(bundle).similarity(images, texts)
    similarity = Captioner.load(folder).similarity(images, texts)
    assert similarity.argmax(-1).tolist() == eager_similarity.argmax(-1).tolist() == [3, 2, 1, 0]


@pytest.mark.parametrize(("head", "scorer"), [("caption", "likelihood"), ("coca", "likelihood"), ("coca", "both")])
def test_caption_likelihood_from_an_onnx_folder_equals_pytorch_within_1e4(coca, head, scorer, tmp_path):
    if head == "coca":
        bundle, folder = coca[:2]
    else:
        bundle = make_caption_bundle(tmp_path / "bundle")
        folder = export_onnx(load_bundle(bundle), tmp_path / "onnx")
    labels = ["red", "blue square", "green", "the", "purple"]  # words of both vocabularies but purple: <unk>
    templates = ["a {}.", "the {} on the right", "{}"]  # of other lengths
    logits = {}
    for name, path in (("torch", bundle), ("onnx", folder)):
        model = zero_shot_model(load_model(path), labels, templates, scorer)
        model.model.max_rows = 40  # 16 images: 2 prompts a chunk, each image's 2 its rows over one encoding
        pixels, _ = _pixels(Captioner.load(folder))
        with torch.no_grad():
            logits[name] = model.model(pixels)  # (16, 5)
    assert logits["onnx"].shape == (16, 5) and logits["onnx"].std() > 0.1
    torch.testing.assert_close(logits["onnx"], logits["torch"], rtol=0, atol=1e-4)


def test_rerank_from_an_onnx_folder_chooses_pytorchs_captions(coca):
    bundle, onnx_dir, _, _ = coca
    pixels, _ = _pixels(Captioner.load(onnx_dir), per_colour=2)
    captions = {}
    for name, folder in (("torch", bundle), ("onnx", onnx_dir)):
        captioner = Captioner.load(folder)
        captions[name] = captioner.caption_pixels(pixels, num_beams=4, rerank=4)[0]
        captions[f"{name}-beam"] = captioner.caption_pixels(pixels, num_beams=4)[0]
    assert captions["onnx"] == captions["torch"] and captions["onnx-beam"] == captions["torch-beam"]
    assert captions["onnx"] != captions["onnx-beam"]  # rerank chose other captions than the beam's best


def test_embeddings_of_a_caption_only_onnx_folder_are_refused_in_one_line(tmp_path):
    folder = export_onnx(load_bundle(make_caption_bundle(tmp_path / "bundle")), tmp_path / "onnx")
    assert tuple(json.loads((folder / ONNX_CONFIG_FILE).read_text())["graphs"]) == GRAPHS["caption"]
    with pytest.raises(ValueError) as info:
        Captioner.load(folder).embed_texts(["a red circle"])
    assert str(info.value) == (
        "this is a head=caption model (an ONNX folder of the captioner only) without image and text embeddings; "
        "embedding texts needs a head=coca model"
    )
    with pytest.raises(ValueError, match="scorer=contrastive needs image and text embeddings"):
        Classifier.load(folder, labels=["red", "blue"], scorer="contrastive")


def test_vitattn_eval_zero_shot_and_retrieval_on_an_onnx_folder_score_as_its_bundle(coca, tmp_path):
    bundle, onnx_dir, _, _ = coca
    rng, images, annotations = np.random.default_rng(11), [], []
    for n, colour in enumerate([c for c in COLOURS for _ in range(2)], start=1):  # val/<class>/<image>, and COCO
        (tmp_path / "val" / colour).mkdir(parents=True, exist_ok=True)
        colour_image(colour, rng).save(tmp_path / "val" / colour / f"{n}.png")
        images.append({"id": n, "file_name": f"{colour}/{n}.png"})
        annotations.append({"id": n, "image_id": n, "caption": f"a photo of a {colour}."})
    (tmp_path / "captions.json").write_text(json.dumps({"images": images, "annotations": annotations}))
    tasks = {
        "zero_shot": [f"data_root={tmp_path}"],
        "retrieval": [f"references={tmp_path / 'captions.json'}", f"image_dir={tmp_path / 'val'}"],
    }
    for task, args in tasks.items():
        metrics = {}
        for name, model in (("torch", bundle), ("onnx", onnx_dir)):
            out = tmp_path / f"{task}-{name}"
            common = [f"model={model}", f"task={task}", f"out={out}", "num_workers=0", "progress=false"]
            assert eval_main([*common, *args]) == 0
            metrics[name] = json.loads((out / "metrics.json").read_text())["metrics"]
        # each colour's two images share one caption: the twin's equal text ties with the match, a hit half the time
        key, expected = ("top1", 1.0) if task == "zero_shot" else ("i2t_r1", 0.5)
        assert metrics["onnx"] == pytest.approx(metrics["torch"]) and metrics["onnx"][key] == expected, (task, metrics)


def test_serving_embed_on_an_onnx_folder_answers_the_bundles_embeddings(coca, tmp_path):
    from vitattn.serve import EmbedAPI

    bundle, onnx_dir, _, _ = coca
    rng, paths = np.random.default_rng(5), []
    for colour in COLOURS:
        paths.append(tmp_path / f"{colour}.png")
        colour_image(colour, rng).save(paths[-1])
    requests = [{"image": base64.b64encode(p.read_bytes()).decode()} for p in paths] + [{"texts": TEXTS}]
    api = EmbedAPI(str(onnx_dir), max_batch_size=8)
    api.setup("cpu")
    answers = [
        api.encode_response(out)
        for out in api.unbatch(api.predict(api.batch([api.decode_request(r) for r in requests])))
    ]
    captioner = Captioner.load(bundle)
    got_images = torch.tensor([a["embedding"] for a in answers[:-1]])
    torch.testing.assert_close(got_images, captioner.embed_images(paths), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(answers[-1]["embeddings"]), captioner.embed_texts(TEXTS), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "drop, message",
    [
        ("image_embed", r"graphs\.image_embed needs 'file' and 'sha256'; export it again"),
        ("embed", r"embed needs a positive integer embed_dim and a number logit_scale; export it again"),
    ],
)
def test_a_coca_onnx_folder_without_its_embedding_parts_is_refused_in_one_line(coca, tmp_path, drop, message):
    folder = shutil.copytree(coca[1], tmp_path / "onnx")
    config = json.loads((folder / ONNX_CONFIG_FILE).read_text())
    del (config["graphs"] if drop == "image_embed" else config)[drop]
    (folder / ONNX_CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as info:
        Captioner.load(folder)
    assert "\n" not in str(info.value)
