"""``vitattn-eval task=zero_shot`` and ``task=retrieval`` on a trained tiny CoCa model: the classification report
from class names, recall@k and median rank against a brute-force oracle, and bad input refused in one line with
nothing written."""

import itertools
import json
import statistics
from math import comb
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.bundles import make_caption_bundle, make_classifier_bundle
from tests.helpers.coca import COLOURS, colour_image
from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn import Captioner
from vitattn.cli.evaluate import main as eval_main
from vitattn.data.shapes import ShapesDataset
from vitattn.metrics.retrieval import retrieval_metrics
from vitattn.training import train


def _oracle(similarity: torch.Tensor, text_image: list[int]) -> dict[str, float]:
    """Recall@k and median rank averaged over every order of each query's candidates tied with its best match:
    image -> its best-placed own caption, text -> its image."""

    def spread(scores: list[float], own: set[int]) -> list[int]:  # the first match's rank in each tie order
        best = max(scores[j] for j in own)
        above = sum(score > best for score in scores)
        tied = [j for j, score in enumerate(scores) if score == best]
        return [above + 1 + min(o.index(j) for j in own if j in o) for o in itertools.permutations(tied)]

    B, N = similarity.shape
    s = similarity.tolist()
    image_ranks = [spread(s[i], {j for j in range(N) if text_image[j] == i}) for i in range(B)]
    text_ranks = [spread([s[i][j] for i in range(B)], {text_image[j]}) for j in range(N)]
    expected = {}
    for way, ranks in (("i2t", image_ranks), ("t2i", text_ranks)):
        for k in (1, 5, 10):
            expected[f"{way}_r{k}"] = statistics.mean(statistics.mean(r <= k for r in rs) for rs in ranks)
        expected[f"{way}_median_rank"] = float(statistics.median(statistics.mean(rs) for rs in ranks))
    return expected


def _plain_sort(similarity: torch.Tensor, text_image: torch.Tensor) -> dict[str, float]:
    """Recall@k from the rank ``1 + the candidates scoring strictly higher``: right where nothing ties."""
    B, N = similarity.shape
    best = similarity.masked_fill(text_image[None, :] != torch.arange(B)[:, None], float("-inf")).amax(dim=1)
    image_ranks = 1 + (similarity > best[:, None]).sum(dim=1)
    text_ranks = 1 + (similarity > similarity[text_image, torch.arange(N)][None, :]).sum(dim=0)
    return {
        f"{way}_r{k}": float((r <= k).double().mean())
        for way, r in zip(("i2t", "t2i"), (image_ranks, text_ranks))
        for k in (1, 5, 10)
    }


def test_retrieval_metrics_match_a_brute_force_oracle_with_several_captions_per_image():
    generator = torch.Generator().manual_seed(0)
    text_image = [0, 1, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11]  # 12 images, 16 texts: k = 10 is not all
    similarity = torch.randn(12, len(text_image), generator=generator)
    metrics = retrieval_metrics(similarity, torch.tensor(text_image))
    assert metrics == pytest.approx(_oracle(similarity, text_image))
    assert 0 < metrics["i2t_r1"] < metrics["i2t_r10"] < 1 and 0 < metrics["t2i_r1"] < metrics["t2i_r10"] < 1


@pytest.mark.parametrize("seed", range(5))
def test_retrieval_metrics_without_ties_are_those_of_a_plain_sort(seed):
    generator = torch.Generator().manual_seed(seed)
    text_image = torch.randint(0, 9, (30,), generator=generator)
    text_image[:9] = torch.arange(9)  # every image has a caption; some have several
    similarity = torch.randn(9, 30, generator=generator)
    metrics = retrieval_metrics(similarity, text_image)
    assert {k: metrics[k] for k in _plain_sort(similarity, text_image)} == _plain_sort(similarity, text_image)


def test_retrieval_metrics_of_all_equal_similarities_are_chance():
    text_image = [0, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 15 images, 18 texts: one, two, three
    B, N = 15, len(text_image)
    metrics = retrieval_metrics(torch.full((B, N), 0.3), torch.tensor(text_image))
    own = [text_image.count(i) for i in range(B)]
    for k in (1, 5, 10):  # an image misses when the k texts drawn hold none of its own
        assert metrics[f"i2t_r{k}"] == pytest.approx(statistics.mean(1 - comb(N - m, k) / comb(N, k) for m in own))
        assert metrics[f"t2i_r{k}"] == pytest.approx(k / B)
    assert metrics["i2t_r1"] == pytest.approx(N / B / N)  # 1/N per own caption
    assert metrics["i2t_median_rank"] == pytest.approx((N + 1) / 2)  # the one-caption images' (N + 1) / 2
    assert metrics["t2i_median_rank"] == pytest.approx((B + 1) / 2)


def test_retrieval_metrics_of_a_hand_built_tie():
    similarity = torch.tensor([[0.9, 0.9, 0.9, 0.1], [0.2, 0.9, 0.9, 0.8]])
    text_image = torch.tensor([0, 0, 1, 1])
    metrics = retrieval_metrics(similarity, text_image)
    # image 0: three texts tie at the top, two its own: one first with p 2/3, else second (expected rank 4/3);
    # image 1: its text 2 ties with image 0's text 1: first with p 1/2 (expected rank 3/2)
    assert metrics["i2t_r1"] == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert metrics["i2t_r5"] == 1.0
    assert metrics["i2t_median_rank"] == pytest.approx((4 / 3 + 3 / 2) / 2)
    # texts 1 and 2 score both images 0.9: their image is first with p 1/2; texts 0 and 3 find theirs first
    assert metrics["t2i_r1"] == pytest.approx((1 + 1 / 2 + 1 / 2 + 1) / 4)
    assert metrics == pytest.approx(_oracle(similarity, text_image.tolist()))


def _colour_coco(root: Path) -> tuple[Path, Path, list[str]]:
    """Eight colour images, two of each colour, one to three captions each, in a COCO caption file (the two images
    of a colour share captions: ties)."""
    rng, images, annotations, names = np.random.default_rng(3), [], [], []
    captions = ["a photo of a {}.", "the {} square", "an image of a {}."]
    (root / "images").mkdir(parents=True)
    for n, colour in enumerate([c for c in COLOURS for _ in range(2)], start=1):
        colour_image(colour, rng).save(root / "images" / f"{n}.png")
        images.append({"id": n, "file_name": f"{n}.png"})
        names.append(f"{n}.png")
        for caption in captions[: 1 + n % 3]:
            annotations.append({"id": len(annotations) + 1, "image_id": n, "caption": caption.format(colour)})
    path = root / "captions.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations}))
    return path, root / "images", names


def test_eval_retrieval_on_a_coco_file_matches_the_oracle_of_the_apis_similarity(colour_coca, tmp_path, capsys):
    references, image_dir, files = _colour_coco(tmp_path / "coco")
    out = tmp_path / "eval"
    argv = [f"model={colour_coca}", "task=retrieval", f"references={references}", f"image_dir={image_dir}"]
    assert eval_main([*argv, f"out={out}", "num_workers=0", "progress=false", "batch_size=3"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    annotations = json.loads(references.read_text())["annotations"]
    texts, text_image = [a["caption"] for a in annotations], [a["image_id"] - 1 for a in annotations]
    similarity = Captioner.load(colour_coca).similarity([str(image_dir / f) for f in files], texts)
    expected = _oracle(similarity, text_image)
    assert {k: metrics[k] for k in expected} == pytest.approx(expected)
    assert metrics["num_images"] == 8 and metrics["num_texts"] == len(texts)
    assert metrics["i2t_r5"] == 1.0  # two images of each colour: a trained model puts its own in the top five
    assert "image->text R@1" in capsys.readouterr().out


def _colour_folder(root: Path, per_colour: int = 2) -> Path:
    rng = np.random.default_rng(7)
    for colour in COLOURS:
        (root / "val" / colour).mkdir(parents=True)
        for i in range(per_colour):
            colour_image(colour, rng).save(root / "val" / colour / f"{i}.png")
    return root


def test_a_coca_system_with_a_zero_shot_folder_and_no_preprocess_reads_its_images_at_the_encoders_size(tmp_path):
    from PIL import Image

    from tests.training.test_self_critical import _scst_system

    system = _scst_system("coca", 0.0, zero_shot={"data_root": str(_colour_folder(tmp_path))})
    *_, transform = system._zero_shot
    assert transform(Image.new("RGB", (50, 40))).shape == (3, 32, 32)


def test_eval_zero_shot_on_an_image_folder_writes_the_classification_report(colour_coca, tmp_path, capsys):
    root = _colour_folder(tmp_path / "data")
    out = tmp_path / "eval"
    argv = [f"model={colour_coca}", "task=zero_shot", f"data_root={root}", f"out={out}", "num_workers=0"]
    assert eval_main([*argv, "progress=false", "templates=a photo of a {}.|the {} square"]) == 0
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["task"] == "zero_shot" and summary["decoding"]["templates"] == ["a photo of a {}.", "the {} square"]
    assert summary["metrics"]["top1"] == 1.0 and summary["metrics"]["num_images"] == 8
    confusion = json.loads((out / "confusion_matrix.json").read_text())
    assert confusion["class_names"] == sorted(COLOURS) and (out / "confusion_matrix.png").is_file()
    assert np.array_equal(np.array(confusion["matrix"]), 2 * np.eye(4))
    assert confusion["per_class"] == [{"class": c, "images": 2, "accuracy": 1.0} for c in sorted(COLOURS)]
    assert "zero_shot evaluation" in capsys.readouterr().out
    # labels=: the candidates, folders matched by name; a distractor class takes no image
    (tmp_path / "labels.txt").write_text("purple\n" + "\n".join(COLOURS) + "\n")
    assert eval_main([*argv, "progress=false", f"labels={tmp_path / 'labels.txt'}"]) == 0
    confusion = json.loads((out / "confusion_matrix.json").read_text())
    assert confusion["class_names"][0] == "purple" and sum(row[0] for row in confusion["matrix"]) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("task=zero_shot", "task=zero_shot needs data_root=DIR"),
        ("task=zero_shot data_root=D labels=,", "labels has ''; each class name is a non-blank string"),
        ("task=zero_shot data_root=D labels=red,blue,red", "labels repeats ['red']; give each class name once"),
        ("task=zero_shot data_root=D templates=a_photo", "template 'a_photo' has no {} (nor is it a file)"),
        ("labels=red,blue", "labels go with task=zero_shot"),
        ("task=search", "task='search' is unknown; choose caption, classification, zero_shot, retrieval"),
        ("task=retrieval data_root=D", "data_root apply to caption models; task=retrieval embeds"),
        ("task=zero_shot data_root=D num_beams=3", "num_beams apply to caption models; task=zero_shot"),
        ("task=classification", "task=classification but model=M is a caption model"),
    ],
)
def test_eval_bad_zero_shot_and_retrieval_arguments_are_one_line_and_write_nothing(
    args, message, colour_coca, tmp_path, capsys
):
    root = _colour_folder(tmp_path / "data")
    argv = [a.replace("=D", f"={root}") for a in args.split()]
    assert eval_main([f"model={colour_coca}", *argv, f"out={tmp_path / 'eval'}", "progress=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message.replace('model=M', f'model={colour_coca}')}") and "\n" not in err, err
    assert not (tmp_path / "eval").exists()


def test_eval_zero_shot_or_retrieval_on_a_model_without_embeddings_is_one_line(tmp_path, capsys):
    caption, classifier = make_caption_bundle(tmp_path / "caption"), make_classifier_bundle(tmp_path / "classifier")
    root = _colour_folder(tmp_path / "data")
    zero_shot = ["task=zero_shot", f"data_root={root}"]
    for model, args, message in (
        (caption, ["task=retrieval"], f"model={caption} is a head=caption model without image and text embeddings"),
        (caption, [*zero_shot, "zero_shot_scorer=both"], "scorer=both needs image and text embeddings"),
        (classifier, zero_shot, "this is a classification model with its own classes"),
        (classifier, ["task=retrieval"], f"model={classifier} is a classification model, which has no text"),
    ):
        assert eval_main([f"model={model}", *args, f"out={tmp_path / 'eval'}", "progress=false"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {message}"), err
        assert "\n" not in err and not (tmp_path / "eval").exists(), err


def test_eval_zero_shot_on_a_caption_model_classifies_by_likelihood(colour_coca, tmp_path, capsys):
    root, out = _colour_folder(tmp_path / "data"), tmp_path / "eval"
    caption = make_caption_bundle(tmp_path / "caption")
    for model, scorer, used in ((caption, "auto", "likelihood"), (colour_coca, "both", "both")):
        argv = [f"model={model}", "task=zero_shot", f"data_root={root}", f"out={out}", "num_workers=0"]
        assert eval_main([*argv, "progress=false", f"zero_shot_scorer={scorer}"]) == 0
        summary = json.loads((out / "metrics.json").read_text())
        assert summary["decoding"]["scorer"] == used and summary["metrics"]["num_images"] == 8
    assert "zero_shot_scorer go with task=zero_shot" in _refused(colour_coca, "zero_shot_scorer=both", capsys)
    bad = f"task=zero_shot data_root={root} zero_shot_scorer=best"
    assert "zero_shot_scorer='best' is unknown" in _refused(colour_coca, bad, capsys)


def _refused(model, args: str, capsys) -> str:
    assert eval_main([f"model={model}", *args.split(), "progress=false"]) == 2
    return capsys.readouterr().err


def test_eval_retrieval_on_the_runs_own_caption_split(tmp_path):
    overrides = ["head=coca", "trainer.precision=32-true", *TINY, *TINY_SHAPES, "trainer.fast_dev_run=true"]
    train(compose_train(overrides, tmp_path))
    assert eval_main([f"model={tmp_path}", "task=retrieval", "num_workers=0", "progress=false"]) == 0
    metrics = json.loads((tmp_path / "eval-val" / "metrics.json").read_text())["metrics"]
    val = ShapesDataset("val", 16, img_size=32)
    assert metrics["num_images"] == 16 and metrics["num_texts"] == sum(len(val.references(i)) for i in range(16))
    assert 0 <= metrics["i2t_r1"] <= metrics["i2t_r5"] <= metrics["i2t_r10"] <= 1
