"""Zero-shot classification and embeddings in the Python API: a trained tiny CoCa model names colours it was never
given as classes, the class embeddings are the renormalised mean over templates, and bad input is refused in one
line before anything runs."""

import logging
import math

import numpy as np
import pytest
import torch

from tests.helpers.bundles import (
    CAPTION_PREPROCESS,
    distinct,
    make_caption_bundle,
    make_classifier_bundle,
    teacher_forced_log_prob,
)
from tests.helpers.coca import COLOURS, WORDS, colour_image
from vitattn import Captioner, Classifier
from vitattn.bundle import load_model, save_bundle
from vitattn.data.tokenizer import Vocabulary
from vitattn.inference.zero_shot import DEFAULT_TEMPLATES, spellable_templates, zero_shot_classifier, zero_shot_model
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer


def _images(seed: int = 5, per_colour: int = 2) -> tuple[list, list[str]]:
    rng = np.random.default_rng(seed)
    names = [c for c in COLOURS for _ in range(per_colour)]
    return [colour_image(c, rng) for c in names], names


def test_zero_shot_on_a_trained_coca_model_names_the_colour_of_each_image(colour_coca, tmp_path):
    images, truth = _images()
    labels = ["blue", "yellow", "red", "green"]  # another order than training saw: classes are names, not indices
    predicted = [p.labels[0] for p in Classifier.load(colour_coca, labels=labels).predict(images, top_k=2)]
    distinct(predicted, at_least=4)
    assert predicted == truth
    (tmp_path / "labels.txt").write_text("\n".join(labels) + "\n\n")
    from_file = Classifier.load(colour_coca, labels_file=tmp_path / "labels.txt", templates=["a {}."])
    assert [p.labels[0] for p in from_file.predict(images, top_k=1)] == truth


def test_class_embeddings_are_the_renormalised_mean_of_the_template_embeddings(colour_coca):
    bundle = load_model(colour_coca)
    labels, templates = ["red", "blue", "green"], ["a photo of a {}.", "the {} square", "{}"]
    classifier = zero_shot_model(bundle, labels, templates).model
    model, vocab = bundle.model, bundle.vocab
    with torch.no_grad():
        expected = []
        for label in labels:
            rows = [model.embed_texts(torch.tensor([vocab.encode(t.replace("{}", label))])) for t in templates]
            mean = torch.cat(rows).mean(0)  # (E,)
            expected.append(mean / mean.norm())
        expected = torch.stack(expected)  # (K, E)
        torch.testing.assert_close(classifier.classes, expected)
        images = torch.randn(2, 3, 32, 32)
        scale = model.logit_scale.exp()  # below the cap of 100 here
        torch.testing.assert_close(classifier(images), scale * model.embed_images(images) @ expected.T)
    assert len(DEFAULT_TEMPLATES) > 1 and all("{}" in t for t in DEFAULT_TEMPLATES)


def test_captioner_embeddings_are_unit_length_and_similarity_is_their_product(colour_coca):
    captioner, (images, truth) = Captioner.load(colour_coca), _images(per_colour=1)
    texts = [f"a photo of a {c}." for c in truth]
    image, text = captioner.embed_images(images), captioner.embed_texts(texts)
    assert image.shape == (4, 16) and text.shape == (4, 16)
    torch.testing.assert_close(image.norm(dim=-1), torch.ones(4))
    similarity = captioner.similarity(images, texts)
    torch.testing.assert_close(similarity, image @ text.T)
    assert similarity.argmax(1).tolist() == [0, 1, 2, 3]  # each image nearest its own colour's caption
    torch.testing.assert_close(captioner.embed_texts(texts[0]), text[:1])
    assert isinstance(captioner.caption(images[0]), str)  # it still captions


def test_a_text_longer_than_max_len_is_cut_with_a_count_in_a_warning(colour_coca, caplog):
    captioner = Captioner.load(colour_coca)  # max_len 8: <bos>, six words, <eos>
    long, cut = "a photo of a red square a photo of a red", "a photo of a red square"
    with caplog.at_level(logging.WARNING):
        embedded = captioner.embed_texts([long, "a red.", long])
    assert "2 of 3 texts are longer than the decoder's max_len=8 tokens" in caplog.text
    torch.testing.assert_close(embedded[0], captioner.embed_texts(cut)[0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"labels": []}, "labels is empty; give the class names to choose from"),
        ({"labels": ["red", "blue", "red"]}, "labels repeats ['red']; give each class name once"),
        ({"labels": ["red", " "]}, "labels has ' '; each class name is a non-blank string"),
        ({"labels": "red"}, "labels='red' must be a list of class names"),
        ({"labels": ["red"], "templates": ["a photo of a", "a {}"]}, "template 'a photo of a' has no {}"),
        ({"labels": ["red"], "templates": "prompts.txt"}, "template 'prompts.txt' has no {} (nor is it a file)"),
        ({"labels": ["red"], "templates": []}, "templates=[] holds no template"),
        ({"templates": ["a {}"]}, "templates= name classes for zero-shot classification; give labels= with them"),
        ({"labels": ["red"], "labels_file": "x.txt"}, "give labels= or labels_file=, not both"),
    ],
)
def test_bad_labels_and_templates_are_refused_in_one_line(kwargs, message, colour_coca):
    with pytest.raises(ValueError) as error:
        Classifier.load(colour_coca, **kwargs)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_scorers_and_models_without_embeddings_are_refused_in_one_line(tmp_path):
    caption = make_caption_bundle(tmp_path / "caption")
    classifier = make_classifier_bundle(tmp_path / "classifier")
    cases = [
        (lambda: Classifier.load(caption, labels=["red"], scorer="both"), "scorer=both needs image and text"),
        (lambda: Classifier.load(caption, labels=["red"], scorer="best"), "scorer='best' is unknown; choose one of"),
        (lambda: Captioner.load(caption).embed_texts("a red"), "this is a head=caption model without image and"),
        (lambda: Captioner.load(caption).embed_images(np.zeros((8, 8, 3), np.uint8)), "this is a head=caption"),
        (lambda: Classifier.load(classifier, labels=["red"]), f"{classifier} is a classification model with its"),
        (lambda: Classifier.load(caption), f"{caption} is a caption model; load it with Captioner.load"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)
    assert "only a head=coca model has" in str(pytest.raises(ValueError, cases[0][0]).value)


def _pixels(bundle, images) -> torch.Tensor:
    return torch.stack([bundle.transform(image) for image in images])


@pytest.mark.parametrize("head", ["caption", "coca"])
def test_likelihood_scores_equal_a_plain_teacher_forced_oracle(head, colour_captioner, colour_coca_both):
    bundle = load_model(colour_captioner if head == "caption" else colour_coca_both)
    model, vocab = bundle.model, bundle.vocab
    labels, templates = ["red", "blue", "green", "yellow", "purple"], ["a {}.", "the {} square", "{}"]  # purple: <unk>
    classifier = zero_shot_classifier(model, vocab, labels, templates, "likelihood")
    classifier.max_rows = 7  # 3 images: 2 prompts a chunk, so 8 chunks, the last one short
    pixels = _pixels(bundle, _images(per_colour=1)[0][:3])  # (3, 3, 32, 32)
    with torch.no_grad():
        got = classifier(pixels)  # (3, 5)
        prompts = [[vocab.encode(t.replace("{}", label))[1:] for t in templates] for label in labels]
        oracle = torch.empty(3, len(labels), len(templates))
        for b in range(3):
            for k, rows in enumerate(prompts):
                for m, ids in enumerate(rows):
                    tokens = torch.tensor([ids])
                    oracle[b, k, m] = teacher_forced_log_prob(model, pixels[b : b + 1], tokens, banned=False)[0]
    expected = oracle.logsumexp(-1) - math.log(len(templates))  # the mean probability of a class's prompts
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    if head == "caption":  # images red, green, blue: the trained captioner names each colour
        assert got.argmax(1).tolist() == [labels.index(c) for c in list(COLOURS)[:3]]


@pytest.mark.parametrize("scorer", ["likelihood", "both", "contrastive"])
def test_each_image_is_encoded_once_per_batch_however_many_prompt_chunks(scorer, colour_coca_both, monkeypatch):
    bundle = load_model(colour_coca_both)
    model = bundle.model
    classifier = zero_shot_classifier(model, bundle.vocab, list(COLOURS), ["a {}.", "the {} square"], scorer)
    classifier.max_rows = 4  # 2 images: 2 prompts a chunk, 4 chunks
    calls = []
    encode = model.encoder.forward_tokens
    monkeypatch.setattr(model.encoder, "forward_tokens", lambda x: calls.append(len(x)) or encode(x))
    with torch.no_grad():
        classifier(torch.randn(2, 3, 32, 32))
    assert calls == [2]


def test_both_is_the_sum_of_the_two_scorers_log_softmaxes(colour_coca_both):
    bundle = load_model(colour_coca_both)
    pixels = _pixels(bundle, _images(per_colour=1)[0])
    scores = {}
    with torch.no_grad():
        for scorer in ("contrastive", "likelihood", "both"):
            scores[scorer] = zero_shot_classifier(bundle.model, bundle.vocab, list(COLOURS), None, scorer)(pixels)
    expected = scores["contrastive"].log_softmax(-1) + scores["likelihood"].log_softmax(-1)
    torch.testing.assert_close(scores["both"], expected)


def test_a_trained_captioner_classifies_by_name_through_the_python_api(colour_captioner):
    images, truth = _images()
    labels = ["blue", "yellow", "red", "green"]
    classifier = Classifier.load(colour_captioner, labels=labels)
    assert classifier.model.scorer == "likelihood"  # auto: the only scorer a head=caption model has
    predicted = [p.labels[0] for p in classifier.predict(images, top_k=2)]
    assert predicted == truth
    with pytest.raises(ValueError, match="scorer=contrastive needs image and text embeddings"):
        Classifier.load(colour_captioner, labels=labels, scorer="contrastive")


def test_words_the_vocabulary_cannot_spell_are_named_in_one_warning(colour_coca, caplog):
    bundle = load_model(colour_coca)
    with caplog.at_level(logging.INFO, logger="vitattn.inference.zero_shot"):
        zero_shot_classifier(bundle.model, bundle.vocab, ["red", "purple"], ["a {} thing", "the {} square"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].endswith("become <unk>: purple, thing"), warnings
    assert "2 classes, 2 distinct class prompts, 2 templates" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        zero_shot_classifier(bundle.model, bundle.vocab, ["red", "blue"], ["a {}."])
    assert not caplog.records  # every word spelled: nothing said


def test_classes_whose_prompts_encode_alike_are_refused_naming_them(colour_coca):
    bundle = load_model(colour_coca)
    labels = ["red", "purple", "blue", "orange", "dark red", "pale red", "cyan"]  # <unk>, <unk> red, <unk>
    with pytest.raises(ValueError) as error:
        zero_shot_classifier(bundle.model, bundle.vocab, labels, ["a {}."])
    message = str(error.value)
    assert message.startswith("zero-shot classes purple, orange, cyan; dark red, pale red encode to the same tokens")
    assert "\n" not in message
    with pytest.raises(ValueError, match="classes purple, orange encode to the same tokens"):
        Classifier.load(colour_coca, labels=["purple", "orange"])


def test_one_letter_class_names_get_the_templates_whose_prompts_spell_them(tmp_path, caplog):
    # The toolkit's tokenizer keeps "a." whole (an abbreviation): in "a {}." class "letter a" ends in <unk>, and
    # every one-letter class would encode alike; templates are judged by their prompts, as the model reads them.
    vocab = Vocabulary([*WORDS, "letter", "b"])
    torch.manual_seed(0)
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    model = ImageCaptioner(encoder, CaptionDecoder(len(vocab), embed_dim=32, depth=1, num_heads=2, max_len=12))
    bundle = save_bundle(tmp_path / "letters", model.eval(), task="caption", preprocess=CAPTION_PREPROCESS, vocab=vocab)
    labels = ["letter a", "letter b"]
    with caplog.at_level(logging.WARNING):
        assert Classifier.load(bundle, labels=labels).model.templates == ["{}"]
    assert not caplog.records
    with pytest.raises(ValueError) as error:
        Classifier.load(bundle, labels=labels, templates=["a {}."])
    message = str(error.value)
    assert message.startswith("zero-shot classes letter a, letter b encode to the same tokens ('a letter a.' spells")
    assert "spells 'a.' as <unk>" in message and "\n" not in message


def test_default_templates_fall_back_to_those_the_vocabulary_spells(tmp_path, caplog):
    assert spellable_templates(Vocabulary(WORDS), ["red"]) == list(DEFAULT_TEMPLATES)  # photo, picture, image
    assert spellable_templates(Vocabulary(["a", "red", "square"]), ["red", "purple"]) == ["a {}."]  # purple: its own
    assert spellable_templates(Vocabulary(["red", "square"]), ["red"]) == ["{}"]  # not even "a": the name alone
    bundle = load_model(make_caption_bundle(tmp_path / "caption"))  # its words: a red blue green circle square ...
    with caplog.at_level(logging.WARNING):
        classifier = zero_shot_classifier(bundle.model, bundle.vocab, ["red circle", "blue square"])
    assert classifier.templates == ["a {}."] and not caplog.records
    assert Classifier.load(tmp_path / "caption", labels=["red", "blue"]).model.templates == ["a {}."]
