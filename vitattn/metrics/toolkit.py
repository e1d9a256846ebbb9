"""The COCO caption toolkit itself (pycocoevalcap and Java: ``vitattn[coco]``), for ``vitattn-eval scorer=coco``:
BLEU-1..4, METEOR 1.5, ROUGE-L and CIDEr-D as ``COCOEvalCap.evaluate`` runs them; no SPICE (it downloads models)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from vitattn.errors import MissingDependencyError
from vitattn.metrics.caption import check_corpus
from vitattn.metrics.tokenize import one_line

__all__ = ["TOOLKIT_METRICS", "check_toolkit", "toolkit_scores", "toolkit_tokenize"]

TOOLKIT_METRICS = ("bleu1", "bleu2", "bleu3", "bleu4", "meteor", "rouge_l", "cider_d")


def check_toolkit() -> None:
    """Raise ``MissingDependencyError`` with the fix unless pycocoevalcap and ``java`` are both here."""
    try:
        spec = importlib.util.find_spec("pycocoevalcap")
    except (ImportError, ValueError):  # a None entry in sys.modules, or a module without a spec
        spec = None
    if spec is None:
        raise MissingDependencyError(
            "scorer=coco runs the COCO caption toolkit and pycocoevalcap is not installed: "
            "pip install 'vitattn[coco]' (or use scorer=builtin, the same numbers without METEOR)"
        )
    if shutil.which("java") is None:
        raise MissingDependencyError(
            "scorer=coco runs the COCO toolkit's Java PTB tokenizer and METEOR and no `java` is on PATH: "
            "install a Java runtime (Debian/Ubuntu: apt-get install default-jre-headless) "
            "or use scorer=builtin, the same numbers without METEOR"
        )
    # optional: pycocoevalcap (.[coco]) is imported only when the toolkit is asked for, here and below
    from pycocoevalcap.tokenizer import ptbtokenizer

    folder = Path(ptbtokenizer.__file__).parent
    if not os.access(folder, os.W_OK):  # the tokenizer writes its input file beside its jar
        raise MissingDependencyError(
            f"scorer=coco: pycocoevalcap's PTB tokenizer writes its input beside its jar in {folder}, which is "
            "not writable here; install pycocoevalcap where you can write (a virtual environment)"
        )


def _tokenize(captions: dict[int, list[str]]) -> dict[int, list[str]]:
    """The toolkit's PTBTokenizer on ``{key: [caption, ...]}``; each result is space-joined tokens."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer  # optional (.[coco])

    # Line breaks become spaces: the toolkit replaces "\n" itself but CoreNLP would end a line at "\r",
    # U+2028... and shift every later caption by one.
    given = {key: [{"caption": one_line(c)} for c in texts] for key, texts in captions.items()}
    tokenized = PTBTokenizer().tokenize(given)
    if any(len(tokenized.get(key, [])) != len(texts) for key, texts in captions.items()):
        made = sum(len(texts) for texts in tokenized.values())
        raise RuntimeError(
            f"the COCO toolkit's Java PTB tokenizer returned {made} captions for "
            f"{sum(len(t) for t in captions.values())}; check that `java -version` runs"
        )
    return tokenized


def toolkit_tokenize(captions: Sequence[str]) -> list[list[str]]:
    """Each caption's tokens from the toolkit's Java tokenizer, all captions in one file as it runs it.

    Raises:
        MissingDependencyError: pycocoevalcap or Java is missing.
    """
    check_toolkit()
    tokenized = _tokenize({0: list(captions)}) if captions else {0: []}
    return [line.split(" ") if line else [] for line in tokenized[0]]


def toolkit_scores(
    predictions: Sequence[str], references: Sequence[Sequence[str]], meteor: bool = True
) -> dict[str, float]:
    """BLEU-1..4, METEOR (``meteor``: tens of seconds to load), ROUGE-L and CIDEr-D of I predictions against
    I reference sets, as pycocoevalcap's ``COCOEvalCap`` computes them.

    Raises:
        ValueError: an empty corpus, lengths that differ, an image without references.
        MissingDependencyError: pycocoevalcap or Java is missing.
    """
    check_corpus(predictions, references)
    check_toolkit()
    # optional (.[coco]), checked just above
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge

    # As COCOEvalCap.evaluate: references and predictions tokenised separately, each in one Java run.
    gts = _tokenize({i: list(refs) for i, refs in enumerate(references)})
    res = _tokenize({i: [caption] for i, caption in enumerate(predictions)})
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    scores = {f"bleu{k}": float(score) for k, score in enumerate(bleu, start=1)}
    if meteor:
        scorer = Meteor()
        try:
            scores["meteor"] = float(scorer.compute_score(gts, res)[0])
        finally:
            del scorer  # its __del__ ends the Java process
    scores["rouge_l"] = float(Rouge().compute_score(gts, res)[0])
    scores["cider_d"] = float(Cider().compute_score(gts, res)[0])
    return scores
