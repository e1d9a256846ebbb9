"""Caption tokenisation shared by the vocabulary and the metrics.

Follows the COCO caption scorer's PTB tokenizer (Stanford CoreNLP 3.4.1, then punctuation tokens
dropped) closely enough for scoring and vocabularies: lower-case, punctuation removed, clitics split
off (``dog's`` -> ``dog 's``, ``don't`` -> ``do n't``), hyphenated words and numbers kept whole
(``well-dressed``, ``3.5``), whitespace split. Known differences from PTB: symbols such as ``&``,
``$``, ``%`` are dropped (PTB keeps them) and ``o'clock`` becomes ``o clock``.
"""

from __future__ import annotations

import re

_WORD = r"[^\W_]"  # a Unicode letter or digit
_TOKEN = re.compile(
    r"\d+(?:[.,]\d+)+"  # 3.5, 1,000: PTB keeps numbers with separators whole
    rf"|{_WORD}+(?=n't\b)"  # the stem before n't: "do" of "don't", "ca" of "can't", as PTB splits
    r"|n't\b"
    rf"|(?<={_WORD})'(?:s|re|ve|ll|m|d)\b"  # clitics only right after a word, not opening quotes
    rf"|{_WORD}+(?:-{_WORD}+)*"  # words; PTB 3.4.1 keeps hyphenated words whole
)


def coco_tokenize(text: str) -> list[str]:
    """Split a caption into lower-case word tokens with punctuation removed.

    Args:
        text: a raw caption, e.g. ``"A Dog's toy, on grass."``.

    Returns:
        The tokens, e.g. ``["a", "dog", "'s", "toy", "on", "grass"]``.
    """
    return _TOKEN.findall(text.lower())
