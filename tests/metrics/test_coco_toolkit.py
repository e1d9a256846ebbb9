"""The COCO caption toolkit itself (pycocoevalcap + Java) against the built-in metrics, and scorer=coco's
one-line refusals when the toolkit or Java is missing."""

from __future__ import annotations

import re
import shutil
import sys

import pytest

from benchmarks.metric_parity import compare, parity_corpus
from vitattn.cli.evaluate import main as eval_main
from vitattn.errors import MissingDependencyError
from vitattn.metrics import compute_caption_metrics
from vitattn.metrics.tokenize import coco_tokenize_file
from vitattn.metrics.toolkit import TOOLKIT_METRICS, check_toolkit, toolkit_scores, toolkit_tokenize


def _need_toolkit() -> None:
    pytest.importorskip("pycocoevalcap", reason="pip install -e '.[coco]'")
    if shutil.which("java") is None:
        pytest.skip("needs Java: apt-get install default-jre-headless")


@pytest.fixture
def no_java(monkeypatch, tmp_path):
    """PATH without java (python stays reachable through sys.executable)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("java") is None


def test_check_toolkit_without_pycocoevalcap_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "pycocoevalcap", None)
    with pytest.raises(MissingDependencyError, match=r"pycocoevalcap is not installed: pip install 'vitattn\[coco\]'"):
        check_toolkit()


def test_check_toolkit_without_java_names_the_fix(no_java):
    pytest.importorskip("pycocoevalcap", reason="pip install -e '.[coco]'")
    with pytest.raises(MissingDependencyError, match="no `java` is on PATH: .*apt-get install default-jre-headless"):
        check_toolkit()


@pytest.mark.parametrize("missing", ["java", "pycocoevalcap"])
def test_eval_scorer_coco_without_the_toolkit_is_one_line(missing, monkeypatch, tmp_path, capsys):
    # Refused before the model loads: model= need not exist, nothing is written.
    if missing == "java":
        pytest.importorskip("pycocoevalcap", reason="pip install -e '.[coco]'")
        monkeypatch.setenv("PATH", str(tmp_path))
    else:
        monkeypatch.setitem(sys.modules, "pycocoevalcap", None)
    out = tmp_path / "out"
    assert eval_main(["model=nowhere", "scorer=coco", f"out={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: scorer=coco runs the COCO"), err
    assert ("default-jre-headless" if missing == "java" else "pip install 'vitattn[coco]'") in err[0]
    assert not out.exists()


def test_eval_unknown_scorer_is_a_usage_error(capsys):
    assert eval_main(["model=nowhere", "scorer=pycoco"]) == 2
    assert "scorer='pycoco' is unknown; choose builtin or coco" in capsys.readouterr().err


def test_toolkit_tokenizer_losing_a_line_is_an_error_not_a_shifted_corpus(monkeypatch):
    pytest.importorskip("pycocoevalcap", reason="pip install -e '.[coco]'")
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    from vitattn.metrics import toolkit

    monkeypatch.setattr(PTBTokenizer, "tokenize", lambda self, captions: {0: ["a dog"]})  # Java gave one line
    with pytest.raises(RuntimeError, match=r"returned 1 captions for 2; check that `java -version` runs"):
        toolkit._tokenize({0: ["A dog.", "A cat."]})


def test_toolkit_tokenizer_keeps_captions_with_line_breaks_on_their_own_lines():
    # CoreNLP ends a line at \r, U+2028, \v, \f too: unguarded, every later caption would be read as the one
    # before it. Both tokenizers read them as spaces.
    _need_toolkit()
    captions = ["A dog\r\non grass.", "A cat\u2028on a mat.", "Two\x0bbirds\x0c(red).", "A fox."]
    assert toolkit_tokenize(captions) == coco_tokenize_file(captions)
    assert coco_tokenize_file(captions)[3] == ["a", "fox"]


@pytest.mark.slow
def test_toolkit_scores_are_coco_eval_caps_and_equal_the_builtin_metrics():
    # toolkit_scores against the toolkit's classes called as COCOEvalCap.evaluate calls them (SPICE aside),
    # on a corpus whose captions need the PTB tokenizer; METEOR is asymmetric, so swapping predictions and
    # references would show.
    _need_toolkit()
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    predictions, references = parity_corpus(40, seed=1)
    scores = toolkit_scores(predictions, references)
    assert tuple(scores) == TOOLKIT_METRICS
    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({i: [{"caption": r} for r in refs] for i, refs in enumerate(references)})
    res = tokenizer.tokenize({i: [{"caption": p}] for i, p in enumerate(predictions)})
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    expected = {f"bleu{k}": b for k, b in enumerate(bleu, start=1)}
    expected["meteor"] = Meteor().compute_score(gts, res)[0]
    expected["rouge_l"] = Rouge().compute_score(gts, res)[0]
    expected["cider_d"] = Cider().compute_score(gts, res)[0]
    assert scores == pytest.approx(expected, rel=1e-12)
    assert 0.05 < scores["meteor"] < 0.95
    builtin = compute_caption_metrics(predictions, references)
    assert builtin == pytest.approx({k: v for k, v in scores.items() if k != "meteor"}, abs=1e-6)


# One phenomenon per pattern that the parity corpus must hold (issue 30: clitics, hyphens, abbreviations
# with periods, & $ % #, quotes, brackets, slashes, numbers, accents, emoji).
PHENOMENA = {
    "clitic": r"\w(?:'s|n't|'re|'ve|'ll|'m|'d)\b",
    "assimilation": r"\b(?:cannot|gonna|wanna)\b",
    "hyphen": r"\w-\w",
    "abbreviation": r"\b(?:Dr|Mr|Mrs|St|Jan|Inc|etc|Ave|Mt)\.|\b(?:[A-Z]\.){2,}",
    "ampersand": "&",
    "dollar": r"\$",
    "percent": "%",
    "hash": "#",
    "quotes": "[\"'\u201c\u201d\u2018\u2019]",
    "brackets": r"[()\[\]{}]",
    "slash": "/",
    "number": r"\d[.,:]\d",
    "accent": "[\u00c0-\u017f]",
    "emoji beyond the BMP": "[\U00010000-\U0010ffff]",
    "symbol in the BMP": "[\u2600-\u27bf]",
    "one-letter abbreviation ending a caption": r"\b[A-Z]\.$",
}


@pytest.mark.slow
def test_builtin_metrics_equal_the_toolkit_on_5000_images_that_exercise_the_ptb_tokenizer():
    # 5,000 predictions x 5 references (docs/captioning.md#metric-parity): every caption tokenised as the
    # toolkit's Java tokenizer does, token for token, and BLEU-1..4, ROUGE-L, CIDEr-D within 1e-6.
    _need_toolkit()
    predictions, references = parity_corpus(5000, seed=0)
    captions = [*predictions, *(r for refs in references for r in refs)]
    for name, pattern in PHENOMENA.items():
        found = sum(bool(re.search(pattern, c)) for c in captions)
        assert found >= 50, f"only {found} captions have a {name}"
    result = compare(predictions, references)
    assert result["captions"] == 30000
    assert result["token_mismatches"] == 0, result["examples"]
    assert set(result["toolkit"]) == set(TOOLKIT_METRICS) - {"meteor"}
    assert result["max_abs_diff"] <= 1e-6, (result["builtin"], result["toolkit"])
