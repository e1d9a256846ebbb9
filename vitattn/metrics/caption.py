"""Corpus caption metrics (BLEU, ROUGE-L, CIDEr-D) as the COCO caption toolkit computes them, quirks included.

No Java and no torch: the toolkit's arithmetic on ``coco_tokenize``'s tokens (docs/metrics.md).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any

from vitattn.metrics.tokenize import coco_tokenize_file

Tokens = list[str]
Ngram = tuple[str, ...]
EOS_WORD = "<eos>"  # the end of a caption as a word, as self-critical.pytorch appends it to every reference

# pycocoevalcap's BLEU smoothing: 'tiny' keeps a zero count from giving log(0), 'small' a zero guess
# from dividing by zero.
_TINY = 1e-15
_SMALL = 1e-9


def check_corpus(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    """Raise ValueError unless there is one prediction and one or more references per image, at least one image."""
    if isinstance(predictions, str):
        raise ValueError("predictions must be a sequence of captions, got a single str")
    if len(predictions) != len(references):
        raise ValueError(f"predictions has {len(predictions)} items but references has {len(references)}")
    if not predictions:
        raise ValueError("the corpus is empty: need at least one prediction and its references")
    for i, image_refs in enumerate(references):
        if isinstance(image_refs, str):
            raise ValueError(f"references[{i}] must be a sequence of reference captions, got str {image_refs!r}")
        if not image_refs:
            raise ValueError(f"references[{i}] is empty: each image needs at least one reference")


def _tokenize_corpus(
    predictions: Sequence[str], references: Sequence[Sequence[str]]
) -> tuple[list[Tokens], list[list[Tokens]]]:
    """Validate the corpus and tokenise every caption."""
    check_corpus(predictions, references)
    flat = iter(coco_tokenize_file([r for image_refs in references for r in image_refs]))
    refs = [list(islice(flat, len(image_refs))) for image_refs in references]  # the flat list cut back per image
    return coco_tokenize_file(predictions), refs


def _words(tokens: Tokens) -> Tokens:
    """The tokens as BLEU and CIDEr-D count them: the joined caption split at any whitespace."""
    return [word for token in tokens for word in token.split()]


def _words_corpus(hyps: list[Tokens], refs: list[list[Tokens]]) -> tuple[list[Tokens], list[list[Tokens]]]:
    return [_words(h) for h in hyps], [[_words(r) for r in image_refs] for image_refs in refs]


def _ngram_counts(tokens: Tokens, max_n: int) -> Counter[Ngram]:
    """Counts of every n-gram of order 1..max_n."""
    return Counter(tuple(tokens[i : i + k]) for k in range(1, max_n + 1) for i in range(len(tokens) - k + 1))


def _bleu(hyps: list[Tokens], refs: list[list[Tokens]], max_n: int) -> list[float]:
    hyp_len = ref_len = 0
    correct = [0] * max_n  # clipped matches per order, summed over the corpus
    guess = [0] * max_n  # prediction n-grams per order
    for hyp, image_refs in zip(hyps, refs):
        hyp_len += len(hyp)
        # the reference length nearest the prediction's; a tie goes to the shorter one
        ref_len += min((len(r) for r in image_refs), key=lambda n: (abs(n - len(hyp)), n))
        max_ref_counts: Counter[Ngram] = Counter()
        for ref in image_refs:
            max_ref_counts |= _ngram_counts(ref, max_n)  # | keeps the max count of each n-gram
        for gram, count in _ngram_counts(hyp, max_n).items():
            correct[len(gram) - 1] += min(count, max_ref_counts[gram])
        for k in range(max_n):
            guess[k] += max(0, len(hyp) - k)

    # The brevity penalty compares corpus totals, so short and long predictions offset each other.
    ratio = (hyp_len + _TINY) / (ref_len + _SMALL)
    brevity = math.exp(1 - 1 / ratio) if ratio < 1 else 1.0
    scores, precision_product = [], 1.0
    for k in range(max_n):
        precision_product *= (correct[k] + _TINY) / (guess[k] + _SMALL)
        scores.append(precision_product ** (1 / (k + 1)) * brevity)  # geometric mean of p_1..p_k
    return scores


def corpus_bleu(predictions: Sequence[str], references: Sequence[Sequence[str]], max_n: int = 4) -> list[float]:
    """Corpus BLEU-1..BLEU-``max_n`` of I ``predictions`` against I sets of ``references``, as ``Bleu(max_n)``.

    Raises:
        ValueError: an empty corpus, lengths that differ, an image without references, ``max_n < 1``.
    """
    if max_n < 1:
        raise ValueError(f"max_n={max_n} must be at least 1")
    return _bleu(*_words_corpus(*_tokenize_corpus(predictions, references)), max_n=max_n)


def _lcs_length(a: Tokens, b: Tokens) -> int:
    """Length of the longest common subsequence, one DP row at a time."""
    row = [0] * (len(b) + 1)
    for token in a:
        diag = 0  # row[j - 1] before this token's update
        for j, other in enumerate(b, start=1):
            up = row[j]
            row[j] = diag + 1 if token == other else max(up, row[j - 1])
            diag = up
    return row[-1]


def _rouge_l_image(hyp: Tokens, image_refs: list[Tokens], beta: float) -> float:
    # pycocoevalcap splits the space-joined caption on " ", so an empty caption is one empty token.
    hyp = hyp or [""]
    lcs = [(_lcs_length(ref or [""], hyp), len(ref or [""])) for ref in image_refs]
    precision = max(common / len(hyp) for common, _ in lcs)
    recall = max(common / ref_len for common, ref_len in lcs)
    if precision == 0 or recall == 0:
        return 0.0
    return (1 + beta**2) * precision * recall / (recall + beta**2 * precision)


def _rouge_l(hyps: list[Tokens], refs: list[list[Tokens]], beta: float) -> float:
    return math.fsum(_rouge_l_image(h, r, beta) for h, r in zip(hyps, refs)) / len(hyps)


def rouge_l(predictions: Sequence[str], references: Sequence[Sequence[str]], beta: float = 1.2) -> float:
    """ROUGE-L (F-measure weighted by ``beta``), the mean over images, as the toolkit's ``Rouge``."""
    return _rouge_l(*_tokenize_corpus(predictions, references), beta=beta)


def _document_frequency(ref_counts: list[list[Counter[Ngram]]]) -> Counter[Ngram]:
    """In how many images' reference sets each n-gram occurs."""
    return Counter(gram for image in ref_counts for gram in set().union(*image))


def _tfidf(
    counts: Counter[Ngram], doc_freq: Counter[Ngram], log_num_images: float, n: int
) -> tuple[dict[Ngram, float], list[float]]:
    """tf-idf weight of each n-gram and the vector norm of each order."""
    # An n-gram in every image weighs 0; one in no reference counts as if it were in one.
    vec = {gram: tf * (log_num_images - math.log(max(1.0, doc_freq[gram]))) for gram, tf in counts.items()}
    squares = [0.0] * n
    for gram, weight in vec.items():
        squares[len(gram) - 1] += weight**2
    return vec, [math.sqrt(s) for s in squares]


def _cider_d_sim(
    hyp: tuple[dict[Ngram, float], list[float]],
    ref: tuple[dict[Ngram, float], list[float]],
    length_delta: int,
    n: int,
    sigma: float,
) -> list[float]:
    """Clipped cosine similarity per n-gram order, times the gaussian length penalty."""
    (hyp_vec, hyp_norm), (ref_vec, ref_norm) = hyp, ref
    dots = [0.0] * n
    for gram, weight in hyp_vec.items():
        ref_weight = ref_vec.get(gram, 0.0)
        # Clipping: repeating an n-gram more often than the reference does earns nothing.
        dots[len(gram) - 1] += min(weight, ref_weight) * ref_weight
    penalty = math.exp(-(length_delta**2) / (2 * sigma**2))
    # An order with an all-zero vector (too short, or only n-grams found in every image) gives 0.
    return [dot / (hn * rn) * penalty if hn and rn else 0.0 for dot, hn, rn in zip(dots, hyp_norm, ref_norm)]


def _cider_d_image(
    hyp: Tokens,
    refs: list[tuple[tuple[dict[Ngram, float], list[float]], int]],
    doc_freq: Counter[Ngram],
    log_num_images: float,
    sigma: float,
    n: int,
) -> float:
    """One prediction's CIDEr-D against its references' tf-idf vectors and lengths."""
    hyp_tfidf = _tfidf(_ngram_counts(hyp, n), doc_freq, log_num_images, n)
    total = 0.0
    for ref_tfidf, ref_len in refs:
        # pycocoevalcap measures length in bigrams, which gives the same difference as tokens
        # whenever both captions are non-empty (an empty one scores 0 anyway).
        total += sum(_cider_d_sim(hyp_tfidf, ref_tfidf, len(hyp) - ref_len, n, sigma)) / n  # mean over orders
    return 10.0 * total / len(refs)  # mean over references, times 10


def _cider_d(hyps: list[Tokens], refs: list[list[Tokens]], sigma: float, n: int) -> float:
    ref_counts = [[_ngram_counts(r, n) for r in image_refs] for image_refs in refs]
    doc_freq = _document_frequency(ref_counts)
    log_num_images = math.log(len(refs))
    scores = []
    for hyp, image_refs, image_ref_counts in zip(hyps, refs, ref_counts):
        ref_vectors = [(_tfidf(c, doc_freq, log_num_images, n), len(r)) for r, c in zip(image_refs, image_ref_counts)]
        scores.append(_cider_d_image(hyp, ref_vectors, doc_freq, log_num_images, sigma, n))
    return math.fsum(scores) / len(scores)


class CiderD:
    """CIDEr-D of a few captions at a time with document frequencies fixed by ``corpus`` (the training
    references): the reward of self-critical training.

    With ``eos_word`` (the reward's rule, as self-critical.pytorch scores), every reference and every prediction
    that ``ended`` gets the word ``<eos>`` after its last token, in the document frequencies too: a caption cut
    short by a length limit no longer scores as one that ended.
    """

    cache_size = 65536  # images whose reference vectors are kept

    def __init__(self, corpus: Sequence[Sequence[str]], sigma: float = 6.0, n: int = 4, eos_word: bool = False) -> None:
        if not corpus:
            raise ValueError("the corpus is empty: CIDEr-D's document frequencies need at least one image")
        self.eos_word = eos_word
        _, refs = _words_corpus(*_tokenize_corpus([""] * len(corpus), corpus))
        doc_freq = _document_frequency([[_ngram_counts(self._ended(r), n) for r in image_refs] for image_refs in refs])
        self._keep(doc_freq, len(corpus), sigma, n)

    @classmethod
    def from_statistics(
        cls, doc_freq: Counter[Ngram], num_images: int, sigma: float = 6.0, n: int = 4, eos_word: bool = False
    ) -> CiderD:
        """A scorer with document frequencies computed elsewhere (``doc_freq``, ``num_images`` of a scorer)."""
        scorer = cls.__new__(cls)
        scorer.eos_word = eos_word
        scorer._keep(Counter(doc_freq), num_images, sigma, n)
        return scorer

    def _keep(self, doc_freq: Counter[Ngram], num_images: int, sigma: float, n: int) -> None:
        self.doc_freq, self.num_images, self.sigma, self.n = doc_freq, num_images, sigma, n
        self._refs: dict[tuple[str, ...], list] = {}

    def _ended(self, words: Tokens, ended: bool = True) -> Tokens:
        return [*words, EOS_WORD] if self.eos_word and ended else words

    def __call__(
        self, predictions: Sequence[str], references: Sequence[Sequence[str]], ended: Sequence[bool] | None = None
    ) -> list[float]:
        """Each prediction's CIDEr-D against its own references (I predictions, I reference lists); with
        ``eos_word``, ``ended`` (I,) says which predictions ended (all when None)."""
        check_corpus(predictions, references)
        if ended is not None and len(ended) != len(predictions):
            raise ValueError(f"ended has {len(ended)} items but predictions has {len(predictions)}")
        log_num_images = math.log(self.num_images)
        hyps = [_words(t) for t in coco_tokenize_file(predictions)]
        hyps = [self._ended(h, e) for h, e in zip(hyps, ended if ended is not None else [True] * len(hyps))]
        return [
            _cider_d_image(
                h, self._reference_vectors(r, log_num_images), self.doc_freq, log_num_images, self.sigma, self.n
            )
            for h, r in zip(hyps, references)
        ]

    def _reference_vectors(self, references: Sequence[str], log_num_images: float) -> list:
        key = tuple(references)
        found = self._refs.get(key)
        if found is None:
            tokens = [self._ended(_words(t)) for t in coco_tokenize_file(key)]
            found = [(_tfidf(_ngram_counts(t, self.n), self.doc_freq, log_num_images, self.n), len(t)) for t in tokens]
            if len(self._refs) >= self.cache_size:
                self._refs.pop(next(iter(self._refs)))  # the oldest
            self._refs[key] = found
        return found


def cider_d(
    predictions: Sequence[str],
    references: Sequence[Sequence[str]],
    sigma: float = 6.0,
    n: int = 4,
) -> float:
    """CIDEr-D, the mean over images in [0, 10], as the toolkit's ``Cider``.

    Document frequencies come from ``references``: score the whole set in one call (a lone image scores 0).
    """
    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    return _cider_d(*_words_corpus(*_tokenize_corpus(predictions, references)), sigma=sigma, n=n)


def compute_caption_metrics(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """``{"bleu1".."bleu4", "rouge_l", "cider_d"}`` of a corpus, tokenised once (errors as ``corpus_bleu``)."""
    hyps, refs = _tokenize_corpus(predictions, references)
    hyp_words, ref_words = _words_corpus(hyps, refs)
    bleu = _bleu(hyp_words, ref_words, max_n=4)
    return {
        **{f"bleu{k}": score for k, score in enumerate(bleu, start=1)},
        "rouge_l": _rouge_l(hyps, refs, beta=1.2),
        "cider_d": _cider_d(hyp_words, ref_words, sigma=6.0, n=4),
    }


def exact_match(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Fraction of predictions equal, token for token (``coco_tokenize``), to one of their references."""
    hyps, refs = _tokenize_corpus(predictions, references)
    return sum(hyp in image_refs for hyp, image_refs in zip(hyps, refs)) / len(hyps)


def distinct_share(predictions: Sequence[str]) -> float:
    """Distinct captions / captions: near 0 when the model says the same thing for every image."""
    if not predictions:
        raise ValueError("predictions is empty")
    return len(set(predictions)) / len(predictions)


# vitattn-eval's scorer=: the built-in metrics alone, or the COCO caption toolkit's beside them (toolkit.py).
SCORERS = ("builtin", "coco")

Item = tuple[Any, str, list[str]]  # (image id, caption, references)


def first_per_image(items: Iterable[Item]) -> list[Item]:
    """The first ``(image_id, caption, references)`` of each image id, sorted by id (ints before strings)."""
    first: dict[Any, Item] = {}
    for item in items:
        first.setdefault(item[0], item)
    return [first[k] for k in sorted(first, key=lambda k: (str(type(k)), k))]


def score_captions(items: Iterable[Item], synthetic: bool = True) -> dict[str, float]:
    """BLEU, ROUGE-L, CIDEr-D, ``distinct`` and ``num_images`` of ``(image_id, caption, references)`` items,
    each image once (its first item); ``synthetic`` references list every correct caption: ``exact_match`` too."""
    items = first_per_image(items)
    captions = [caption for _, caption, _ in items]
    references = [refs for _, _, refs in items]
    metrics = compute_caption_metrics(captions, references)
    if synthetic:  # one right answer up to the reading direction: exact match is meaningful
        metrics["exact_match"] = exact_match(captions, references)
    metrics["distinct"] = distinct_share(captions)  # collapse alarm: near 0 = one caption for all
    metrics["num_images"] = len(items)
    return metrics
