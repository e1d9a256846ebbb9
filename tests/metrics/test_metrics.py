"""Caption metrics against published COCO-toolkit figures, hand-worked cases and torchmetrics."""

from __future__ import annotations

import math

import pytest

from vitattn.metrics import (
    cider_d,
    coco_tokenize,
    compute_caption_metrics,
    corpus_bleu,
    rouge_l,
)
from vitattn.metrics.tokenize import coco_tokenize_file

# --------------------------------------------------------------------------------- known answer


def test_compute_caption_metrics_matches_published_coco_figures():
    # The README of bckim92/language-evaluation runs pycocoevalcap (with the Java PTB tokenizer)
    # on this corpus and prints these figures; "?" is dropped by the tokenizer.
    predictions = ["i am a boy", "she is a girl"]
    references = [["am i a boy ?"], ["is she a girl ?"]]
    published = {
        "bleu1": 0.9999999997500004,
        "bleu2": 0.5773502690332603,
        "bleu3": 4.3679023223468616e-06,
        "bleu4": 1.4287202142987477e-08,
        "rouge_l": 0.75,
        "cider_d": 3.333333333333333,
    }
    assert compute_caption_metrics(predictions, references) == pytest.approx(published, rel=1e-12)


# --------------------------------------------------------------------------------------- tokenizer


# What pycocoevalcap's own tokenizer (CoreNLP 3.4.1's PTBTokenizer in Java, lower-cased, its punctuation
# dropped) gives for each line; tests/metrics/test_coco_toolkit.py checks 30,000 captions against Java itself.
@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("A Dog's toy, on grass.", ["a", "dog", "'s", "toy", "on", "grass"]),
        (
            "Don't stop, we can't! Won't you? I'm sure they've gone.",
            ["do", "n't", "stop", "we", "ca", "n't", "wo", "n't", "you", "i", "'m", "sure", "they", "'ve", "gone"],
        ),
        (
            "We cannot go, we're gonna stay 'cause it's 'tis the season.",
            ["we", "can", "not", "go", "we", "'re", "gon", "na", "stay", "'cause", "it", "'s", "'t", "is", "the"]
            + ["season"],
        ),
        (
            "A well-dressed man, a 5-year-old boy and a T-shirt.",
            ["a", "well-dressed", "man", "a", "5-year-old", "boy", "and", "a", "t-shirt"],
        ),
        (
            "Mr. Smith and Dr. Jones at St. Paul's in the U.S. on Jan. 5, etc.",
            ["mr.", "smith", "and", "dr.", "jones", "at", "st.", "paul", "'s", "in", "the", "u.s.", "on", "jan."]
            + ["5", "etc."],
        ),
        ("Vitamin C. A dog at 10 a.m.", ["vitamin", "c", "a", "dog", "at", "10", "a.m."]),  # "C." ends a sentence
        (
            "AT&T, R&B and rock & roll; a $5 bill, $5.99, 50% off, #1 and #beach.",
            ["at&t", "r&b", "and", "rock", "&", "roll", "a", "$", "5", "bill", "$", "5.99", "50", "%", "off"]
            + ["#", "1", "and", "#beach"],
        ),
        (
            "\"Hello,\" she said to the dogs' owner: 'hi' and \u201cbye\u201d.",
            ["hello", "she", "said", "to", "the", "dogs", "owner", "hi", "and", "bye"],
        ),
        (  # the toolkit drops "-LRB-", but its tokens are lower case: brackets stay
            "A sign (closed) [now] {here} -- with a dash - and ... dots",
            ["a", "sign", "-lrb-", "closed", "-rrb-", "-lsb-", "now", "-rsb-", "-lcb-", "here", "-rcb-", "with"]
            + ["a", "dash", "and", "dots"],
        ),
        (
            "a/b, and/or, w/ a hat, 3/4-inch, 1 1/2 cups, 12/25/2019",
            ["a/b", "and/or", "w", "/", "a", "hat", "3/4-inch", "1\u00a01/2", "cups", "12/25/2019"],
        ),
        (
            "3.5 feet, 1,000 people at 10:30, \u00bd a sandwich, \u00a310 and \u20ac20",
            ["3.5", "feet", "1,000", "people", "at", "10:30", "1/2", "a", "sandwich", "#", "10", "and", "$", "20"],
        ),
        (
            "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9, Zo\u00eb in S\u00e3o Paulo, stra\u00dfe",
            ["caf\u00e9", "cr\u00e8me", "na\u00efve", "r\u00e9sum\u00e9", "zo\u00eb", "in", "s\u00e3o", "paulo"]
            + ["stra\u00dfe"],
        ),
        (  # emoji beyond the BMP are deleted, BMP symbols kept (the variation selector after the heart goes)
            "A dog \U0001f436 with a \u2764\ufe0f and thumbs\U0001f44dup \u2614 in the rain \U0001f600.",
            ["a", "dog", "with", "a", "\u2764", "and", "thumbs", "up", "\u2614", "in", "the", "rain"],
        ),
        (
            "o'clock, rock 'n' roll, ma'am, y'all, O'Neil, the '90s and 90's",
            ["o'clock", "rock", "'n'", "roll", "ma'am", "y'", "all", "o'neil", "the", "'90s", "and", "90", "'s"],
        ),
        (  # the toolkit's punctuation list has "!" and "?", not "!!!" or "?!"
            "Hello!!! Really?! Yes... a + b = c * d",
            ["hello", "!!!", "really", "?!", "yes", "a", "+", "b", "=", "c", "*", "d"],
        ),
        ("'Hello' said the dogs' owner", ["hello", "said", "the", "dogs", "owner"]),
        # "cont'd" is one word of the lexer's, but a word before a clitic wins the tie
        ("The story, cont'd on page 2.", ["the", "story", "cont", "'d", "on", "page", "2"]),
        # Java reads UTF-16: an emoji is two characters, enough for a URL after "http://"
        ("The site http://\U0001f600 is down", ["the", "site", "http://\U0001f600", "is", "down"]),
    ],
)
def test_coco_tokenize_follows_the_toolkits_ptb_tokenizer(text, tokens):
    assert coco_tokenize(text) == tokens


def test_coco_tokenize_file_looks_past_a_line_end_as_the_toolkit():
    # In the toolkit's file a few rules read the next line (Java gave these): "A." before a line that
    # starts a sentence ("The", after blank lines too) is the letter and a full stop, before "a dog" an
    # abbreviation; "no." before a number keeps its period; a smiley needs a character after it, which
    # the file's last line lacks.
    lines = ["the letter A.", "The dog", "the letter A.", "", "  ", "The cat", "the letter A.", "a dog"]
    lines += ["in room no.", "5 cats", "room no.", "cats", "a smile :)", "a smile :)"]
    tokens = coco_tokenize_file(lines)
    assert tokens[0] == tokens[2] == ["the", "letter", "a"] and tokens[6] == ["the", "letter", "a."]
    assert tokens[3] == tokens[4] == [] and tokens[5] == ["the", "cat"]
    assert tokens[8] == ["in", "room", "no."] and tokens[10] == ["room", "no"]
    assert tokens[12] == ["a", "smile", ":-rrb-"] and tokens[13] == ["a", "smile", "-rrb-"]  # ":" dropped
    assert coco_tokenize("the letter A.") == ["the", "letter", "a."]  # alone: a line break, nothing after


def test_bleu_and_cider_split_a_token_at_its_no_break_space_rouge_does_not():
    # PTB keeps "1 1/2" as one token with a no-break space inside; the toolkit's BLEU and CIDEr split
    # the tokenised caption at any whitespace ("1", "1/2"), its ROUGE-L at spaces only.
    assert coco_tokenize("1 1/2 cups") == ["1\u00a01/2", "cups"]
    assert corpus_bleu(["1 1/2 cups"], [["1/2 cups"]], max_n=1) == pytest.approx([2 / 3], rel=1e-8)
    assert rouge_l(["1 1/2 cups"], [["1/2 cups"]]) == pytest.approx(2.44 * 0.5 * 0.5 / (0.5 + 1.44 * 0.5))


# -------------------------------------------------------------------------------------------- BLEU


def test_corpus_bleu_perfect_match_is_one_up_to_coco_epsilons():
    # p_k = (c + 1e-15) / (c + 1e-9) and brevity exp(1 - (5 + 1e-9) / (5 + 1e-15)) are each a hair
    # under 1, so COCO never reports exactly 1 (the published 0.99999999975 above is this effect).
    scores = corpus_bleu(["A dog runs on grass."], [["a dog runs on grass", "a cat"]])
    assert scores == pytest.approx([1.0] * 4, abs=1e-9)
    assert all(score < 1.0 for score in scores)


def test_corpus_bleu_hand_computed_clipping_and_corpus_brevity():
    # Image 1: "the the cat" (3 tokens), closest reference "the cat sat" (3).
    #   unigrams: "the" x2 clipped to 1 (at most once in any reference) + "cat" -> 2 of 3
    #   bigrams: "the the" no, "the cat" yes -> 1 of 2; trigram "the the cat" no -> 0 of 1
    # Image 2: "a dog" (2), references of 4 and 5 tokens -> closest 4.
    #   unigrams 2 of 2; bigram "a dog" is in neither reference -> 0 of 1
    # Corpus: p1 = 4/5, p2 = 1/3, p3 = 0/1, p4 = 0/0; lengths 5 vs 3 + 4 = 7
    #   brevity = exp(1 - 7/5) = exp(-0.4), applied once to the corpus totals
    predictions = ["the the cat", "a dog"]
    references = [
        ["the cat sat", "a cat sat on the mat"],
        ["a big dog runs", "the dog runs fast now"],
    ]
    brevity = math.exp(-0.4)
    bleu1, bleu2, bleu3, bleu4 = corpus_bleu(predictions, references)
    assert bleu1 == pytest.approx(4 / 5 * brevity, rel=1e-8)
    assert bleu2 == pytest.approx(math.sqrt(4 / 5 * 1 / 3) * brevity, rel=1e-8)
    # No matching trigram: COCO's epsilons give (0 + 1e-15) / (1 + 1e-9) instead of 0, and an order
    # with no n-grams at all gives 1e-15 / 1e-9 = 1e-6.
    assert bleu3 == pytest.approx((4 / 5 * 1 / 3 * 1e-15) ** (1 / 3) * brevity, rel=1e-6)
    assert bleu4 == pytest.approx((4 / 5 * 1 / 3 * 1e-15 * 1e-6) ** (1 / 4) * brevity, rel=1e-6)
    assert corpus_bleu(predictions, references, max_n=2) == pytest.approx([bleu1, bleu2])


@pytest.mark.parametrize("references", [["a dog", "a dog sat down"], ["a dog sat down", "a dog"]])
def test_corpus_bleu_closest_reference_tie_goes_to_shorter(references):
    # 3 tokens, references of 2 and 4 are equally close: COCO takes 2 in either order, so no brevity
    # penalty; taking 4 would give exp(1 - 4/3) = 0.717.
    assert corpus_bleu(["a dog sat"], [references], max_n=1) == pytest.approx([1.0], abs=1e-9)


def test_corpus_bleu_matches_torchmetrics_when_every_order_matches():
    # torchmetrics' BLEUScore also sums clipped counts over the corpus and picks the closest
    # reference length, so the two agree (to float32) when every n-gram order has a match and no
    # closest-length tie occurs. Here lengths are 8 vs 8 and 6 vs 7 (not 10), so the brevity
    # penalty exp(1 - 15/14) applies.
    torchmetrics_text = pytest.importorskip("torchmetrics.text")
    predictions = ["A man riding a horse on the beach.", "Two dogs play with a ball."]
    references = [
        ["A man rides a horse on the beach.", "A person riding a horse near the sea."],
        ["Two dogs are playing with a ball in a park.", "Two dogs play with a ball outside."],
    ]
    tokenized_preds = [" ".join(coco_tokenize(p)) for p in predictions]
    tokenized_refs = [[" ".join(coco_tokenize(r)) for r in refs] for refs in references]
    ours = corpus_bleu(predictions, references)
    theirs = [torchmetrics_text.BLEUScore(n_gram=n)(tokenized_preds, tokenized_refs).item() for n in range(1, 5)]
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert ours[0] < 1.0  # the brevity penalty is really exercised


def test_corpus_bleu_differs_from_torchmetrics_where_coco_does():
    # Where they differ: torchmetrics breaks a closest-length tie by list order (here 4 tokens, so
    # brevity exp(1 - 4/3)), and returns exactly 0 when an order has no match, COCO a tiny number.
    torchmetrics_text = pytest.importorskip("torchmetrics.text")
    tie = (["a dog sat"], [["a dog sat down", "a dog"]])
    assert torchmetrics_text.BLEUScore(n_gram=1)(*tie).item() == pytest.approx(math.exp(1 - 4 / 3))
    assert corpus_bleu(*tie, max_n=1)[0] == pytest.approx(1.0, abs=1e-9)
    no_bigram = (["dog a"], [["a dog"]])
    assert torchmetrics_text.BLEUScore(n_gram=2)(*no_bigram).item() == 0.0
    assert 0.0 < corpus_bleu(*no_bigram, max_n=2)[1] < 1e-6


# ----------------------------------------------------------------------------------------- ROUGE-L


def test_rouge_l_perfect_match_is_one():
    assert rouge_l(["A dog runs."], [["a dog runs"]]) == pytest.approx(1.0, abs=1e-15)


def test_rouge_l_hand_computed_lcs():
    # LCS("a man riding a horse on the beach", "a man is riding a brown horse") is
    # "a man riding a horse" = 5, so P = 5/8, R = 5/7 and
    # F = (1 + 1.2^2) P R / (R + 1.2^2 P) = 2.44 * (25/56) / (5/7 + 0.9) = 0.674779...
    score = rouge_l(["a man riding a horse on the beach"], [["a man is riding a brown horse"]])
    assert score == pytest.approx(2.44 * (25 / 56) / (5 / 7 + 1.44 * 5 / 8), rel=1e-12)
    assert score == pytest.approx(0.674779, abs=1e-6)


def test_rouge_l_maximises_precision_and_recall_separately():
    # "a dog runs" vs "a dog": LCS 2 -> P 2/3, R 1;
    # vs "a big dog runs fast today": LCS 3 -> P 1, R 1/2.
    # COCO takes max P = 1 and max R = 1 from different references, so the score is 1 though no
    # reference matches.
    assert rouge_l(["a dog runs"], [["a dog", "a big dog runs fast today"]]) == pytest.approx(1.0)


def test_rouge_l_is_mean_over_images():
    # 1.0 for the exact match, 0.0 for no common word -> 0.5; an empty prediction scores 0.
    assert rouge_l(["a dog", "red car"], [["a dog"], ["blue sky"]]) == pytest.approx(0.5)
    assert rouge_l([""], [["a dog"]]) == 0.0


# ----------------------------------------------------------------------------------------- CIDEr-D


def test_cider_d_exact_matches_score_by_surviving_ngram_orders():
    # N = 2 images, idf = log 2 - log df. "a" is in both images (df 2) so its weight is 0, but every
    # other n-gram weighs log 2 and prediction == reference, so the cosine of orders 1-3 is 1. A
    # 3-token caption has no 4-gram: that order's vector is zero and scores 0.
    # Per image: mean(1, 1, 1, 0) * 10 = 7.5, not 10.
    score = cider_d(["a dog runs", "a cat sleeps"], [["a dog runs"], ["a cat sleeps"]])
    assert score == pytest.approx(7.5, rel=1e-12)


def test_cider_d_identical_corpus_scores_zero():
    # Every n-gram is in every image (df = N), so every idf weight is log N - log N = 0: all vectors
    # are zero and a perfect prediction scores 0. CIDEr rewards only what is specific to an image.
    assert cider_d(["a dog runs"] * 3, [["a dog runs"]] * 3) == 0.0
    assert cider_d(["a dog runs"], [["a dog runs"]]) == 0.0  # one image: N = 1, log 1 = 0


def test_cider_d_document_frequency_comes_from_the_whole_corpus():
    # Batch 1 alone (N = 2, L = log 2): "red" is in both images -> weight 0, so "red dog" vs
    # "red cat" shares only a zero-weight word and scores 0; "red fox" matches exactly: orders 1-2
    # -> cosine 1, orders 3-4 empty -> 10 * 2/4 = 5. Batch 1 = 2.5. Batch 2: two exact 2-word
    # matches = 5.
    # Whole corpus (N = 4, log 4 = 2L): "red" has df 2 -> weight L, every other word 2L, so
    # "red dog" vs "red cat" has unigram cosine L*L / (sqrt(5) L)^2 = 1/5 -> 10 * 0.2/4 = 0.5.
    # Corpus = (0.5 + 5 + 5 + 5) / 4 = 3.875, not the mean of batches (2.5 + 5) / 2 = 3.75.
    predictions = ["red dog", "red fox", "blue sky", "green sea"]
    references = [["red cat"], ["red fox"], ["blue sky"], ["green sea"]]
    batch1 = cider_d(predictions[:2], references[:2])
    batch2 = cider_d(predictions[2:], references[2:])
    assert (batch1, batch2) == pytest.approx((2.5, 5.0), rel=1e-12)
    assert cider_d(predictions, references) == pytest.approx(3.875, rel=1e-12)


def test_cider_d_clips_repeated_ngrams():
    # N = 2, every n-gram has df <= 1 -> weight L = log 2 per occurrence.
    # "dog dog" vs "dog cat": hyp unigram vector (dog: 2L), ref (dog: L, cat: L). Clipping uses
    # min(2L, L) * L = L^2, so cosine = L^2 / (2L * sqrt(2) L) = 1 / (2 sqrt 2) (without clipping
    # 1 / sqrt 2); bigrams differ. Image 1 = 10 * 0.35355 / 4; image 2 ("sun" == "sun") = 10 * 1/4.
    score = cider_d(["dog dog", "sun"], [["dog cat"], ["sun"]])
    assert score == pytest.approx((10 * (1 / (2 * math.sqrt(2))) / 4 + 2.5) / 2, rel=1e-12)


def test_cider_d_gaussian_length_penalty():
    # "dog runs fast" vs "dog runs" (N = 2, all weights L): unigram cosine 2 / (sqrt 3 sqrt 2),
    # bigram cosine 1 / sqrt 2, no common trigram; the lengths differ by 1, so each order is scaled
    # by exp(-1 / (2 * 6^2)). Image 2 ("sun") = 2.5.
    cosines = 2 / math.sqrt(6) + 1 / math.sqrt(2)
    image1 = 10 * cosines * math.exp(-1 / 72) / 4
    score = cider_d(["dog runs fast", "sun"], [["dog runs"], ["sun"]])
    assert score == pytest.approx((image1 + 2.5) / 2, rel=1e-12)
    no_penalty = (10 * cosines / 4 + 2.5) / 2
    assert cider_d(["dog runs fast", "sun"], [["dog runs"], ["sun"]], sigma=1e9) == pytest.approx(no_penalty, rel=1e-12)


def test_cider_d_averages_over_references():
    # Image 1 has an exact reference (10 * 2/4 = 5, as in the batch test) and one sharing nothing
    # (0): the mean over references gives 2.5. Image 2 ("sun") = 2.5.
    score = cider_d(["red fox", "sun"], [["red fox", "blue sky"], ["sun"]])
    assert score == pytest.approx(2.5, rel=1e-12)


# -------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("predictions", "references", "message"),
    [
        (["a", "b", "c"], [["a"], ["b"]], "predictions has 3 items but references has 2"),
        ([], [], "corpus is empty"),
        (["a dog"], [[]], r"references\[0\] is empty"),
        ("a dog", [["a dog"]] * 5, "got a single str"),
        (["a dog", "a cat"], ["a dog", "a cat"], r"references\[0\] must be a sequence"),
    ],
)
@pytest.mark.parametrize("metric", [corpus_bleu, rouge_l, cider_d, compute_caption_metrics])
def test_metrics_reject_malformed_corpus(metric, predictions, references, message):
    with pytest.raises(ValueError, match=message):
        metric(predictions, references)


def test_metrics_reject_bad_orders():
    with pytest.raises(ValueError, match="max_n=0 must be at least 1"):
        corpus_bleu(["a"], [["a"]], max_n=0)
    with pytest.raises(ValueError, match="n=0 must be at least 1"):
        cider_d(["a"], [["a"]], n=0)


def test_exact_match_compares_tokens_against_any_reference():
    from vitattn.metrics import exact_match

    predictions = ["A red circle.", "a blue square", "a green triangle"]
    references = [["a red circle"], ["a blue circle", "A blue square!"], ["a green square"]]
    assert exact_match(predictions, references) == pytest.approx(2 / 3)  # case and punctuation ignored


def test_distinct_share_flags_collapse():
    from vitattn.metrics import distinct_share

    assert distinct_share(["a cat"] * 4) == 0.25
    assert distinct_share(["a cat", "a dog"]) == 1.0
    with pytest.raises(ValueError, match="predictions is empty"):
        distinct_share([])
