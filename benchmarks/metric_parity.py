"""The built-in caption metrics against the COCO caption toolkit itself (docs/captioning.md#metric-parity).

    python -m benchmarks metric-parity                  # 5,000 images x 5 references, seed 0
    python -m benchmarks metric-parity --images 500 --seed 3

Needs ``pip install -e '.[coco]'`` and Java. Builds a caption corpus from word lists and templates
that exercise the PTB tokenizer (clitics, hyphens, abbreviations with periods, ``& $ % #``, quotes,
brackets, slashes, numbers, accents, emoji, line ends that the next caption decides), then
prints how many captions ``vitattn.metrics.coco_tokenize_file`` tokenises otherwise than the
toolkit's Java tokenizer, and each metric built-in and from the toolkit (METEOR has no built-in).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from typing import Any

from benchmarks.report import markdown_table
from benchmarks.timing import stopwatch
from vitattn.metrics import compute_caption_metrics
from vitattn.metrics.tokenize import coco_tokenize_file
from vitattn.metrics.toolkit import toolkit_scores, toolkit_tokenize

__all__ = ["add_arguments", "compare", "parity_corpus", "run"]


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.replace("\n", " | ").split(" | ") if item.strip()]


# Each image is a scene (who, doing what, to what, where); its captions are rewordings of it.
SUBJECTS = _split(
    """
a man | a woman | two kids | three dogs | Dr. Smith | Mr. O'Neil | Mrs. Jones | St. Mary's choir
the U.S. Navy band | a 5-year-old boy | a well-dressed man | Zoë | a café owner | the São Paulo team
a rock 'n' roll band | a chef (in white) | an Ångström Inc. worker | a boy wearing #23 | AT&T's mascot
a naïve tourist | the crème brûlée chef | a 2nd-grade class | my friend's dog | the dogs' owner | a señor
a T-shirt-wearing teen | the Smiths' cat | an 80-year-old woman | a DJ | the N.Y.P.D. officer | a girl 👧
a guy w/ a hat | a 'cool' skater | a "happy" child | a man/woman | 5 cyclists | 1,000 runners
the Jan. 5 crowd | a co-op worker | an e-bike rider | a mother-in-law | y'all | a Ph.D. student
the R&B singer | a fiancée | Björk | a piñata maker | the über-fan
"""
)
ACTIONS = _split(
    """
is riding | isn't riding | can't reach | won't eat | 's holding | are gonna play with | cannot see
doesn't like | has got | 'll paint | 'd rather eat | rides | is sitting on | wanna buy | is gonna throw
didn't find | they're carrying | we've seen | I'm pointing at | you'd love | holds | looks at | is pushing
shouldn't touch | 's jumping over | is selling | lets go of
"""
)
OBJECTS = _split(
    """
a red-and-white bus | a $5 bill | a $5.99 pizza | 50% of a pizza | the #1 jersey | a 1/2-inch pipe
3.5 lbs. of fish | a "STOP" sign | his 'lucky' hat | a bike and/or a car | 1,000 balloons | a 🐶 emoji
❤️ stickers | R&B records | a sign that says (closed) | a U.S. flag | a crème brûlée | a jalapeño
the 10:30 train | a 3/4 cup of milk | an e-mail | a T-shirt | AT&T phones | a #beach hashtag | 90's music
the '90s posters | a 2x4 board | a 100% cotton shirt | a £10 note | a €20 bill | ½ a sandwich | a résumé
a piñata | an über-cool car | the letters A & B | a 12-year-old's bike | the vitamin C | a pack of M&M's
[a red box] | {curly braces} | a 5km sign | an 18-wheeler | a thumbs👍up sign | a cat-and-mouse toy
the dog's bone | a ten-dollar bill | a blue/green kite | a #2 pencil | a 45° ramp | a sign that reads “open”
the ‘best’ cake | a 1998 Ford | a phone, etc. | a Wi-Fi sign | twenty-one candles | a half-eaten apple
"""
)
PLACES = _split(
    """
on the street | in São Paulo | at 5 p.m. | at 10 a.m. | near St. Paul's | in the U.S. | on Jan. 5
(outside) | [indoors] | at the café | on 5th Ave. | in Washington, D.C. | in the 1990s
at the Smith & Co. store | with friends, etc. | at #42 Main St. | on 3/4 of the lawn | near the 7-Eleven
in the rain ☔ | at the naïve art show | on a sunny day 😀 | at the o'clock tower | in the U.K.
by the Eiffel Tower | at Mt. Fuji | in Zürich | at the 50/50 raffle | in Québec | -- in a park --
at 3:45pm | vs. the wind | at the Dr. Pepper stand | in Calif. | in room no. 5 | on the beach...
in the park!!! | on the lawn ?! | at the corner - downtown
"""
)
# Endings that the next caption decides: a one-letter abbreviation, then a caption that starts with a word
# PTB takes as a sentence's start; "no." then a number.
LINE_ENDS = _split(
    """
with the letter A. | with vitamin C. | with plan B. | near gate D. | in room no. | on fig.
"""
)
OPENINGS = ["", "", "", "", "", "There's ", "Here's ", "(Photo) ", "An image of: ", '"', "The picture shows "]
ENDINGS = [".", ".", ".", "", "", "!", "...", " .", "?", " :)", ". ", "!!"]
SYNONYMS = {
    "a man": ["a guy", "a gentleman", "A MAN"],
    "is riding": ["rides", "is on"],
    "on the street": ["on the road", "in the street"],
    "a red-and-white bus": ["a red bus", "a white-and-red bus"],
}


def _caption(rng: random.Random, subject: str, action: str, obj: str, place: str) -> str:
    subject = rng.choice([subject, *SYNONYMS.get(subject, [])])
    action = rng.choice([action, *SYNONYMS.get(action, [])])
    words = [rng.choice(OPENINGS) + subject, action, obj]
    if rng.random() < 0.7:
        words.append(place)
    text = " ".join(words)
    roll = rng.random()
    if roll < 0.08:
        text += " " + rng.choice(LINE_ENDS)
    else:
        text += rng.choice(ENDINGS)
    if roll > 0.97:
        text = text.upper()
    elif roll > 0.5:
        text = text[0].upper() + text[1:]
    return text


def parity_corpus(num_images: int = 5000, seed: int = 0) -> tuple[list[str], list[list[str]]]:
    """``(predictions, references)``: one prediction and 5 references per image, the same for a seed.

    References reword the image's scene; the prediction rewords it too, with its action or object swapped
    for another image's one time in three, so that the metrics are neither 0 nor 1.
    """
    rng = random.Random(seed)
    predictions, references = [], []
    for _ in range(num_images):
        scene = [rng.choice(SUBJECTS), rng.choice(ACTIONS), rng.choice(OBJECTS), rng.choice(PLACES)]
        refs = [_caption(rng, *scene) for _ in range(5)]
        if rng.random() < 0.2:  # a reference that starts with a number, after one that may end in "no."
            refs[rng.randrange(1, 5)] = f"{rng.randint(2, 12)} " + _caption(rng, *scene)
        guess = list(scene)
        if rng.random() < 1 / 3:
            slot = rng.randrange(1, 3)
            guess[slot] = rng.choice([ACTIONS, OBJECTS][slot - 1])
        predictions.append(_caption(rng, *guess))
        references.append(refs)
    return predictions, references


def compare(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Tokens and metrics, built-in against the toolkit's (its Java tokenizer and scorers, no METEOR).

    Returns:
        ``captions`` (how many), ``token_mismatches`` (captions whose tokens differ), ``examples`` (up to 10
        ``(caption, ours, toolkit's)``), ``builtin`` and ``toolkit`` (the metrics), ``max_abs_diff``, and
        the seconds each took.
    """
    captions = [*predictions, *(r for refs in references for r in refs)]
    with stopwatch() as ours_s:
        ours = [*coco_tokenize_file(predictions), *coco_tokenize_file([r for refs in references for r in refs])]
    with stopwatch() as java_s:
        theirs = [*toolkit_tokenize(predictions), *toolkit_tokenize([r for refs in references for r in refs])]
    mismatches = [(c, o, t) for c, o, t in zip(captions, ours, theirs) if o != t]
    with stopwatch() as builtin_s:
        builtin = compute_caption_metrics(predictions, references)
    with stopwatch() as toolkit_s:
        toolkit = toolkit_scores(predictions, references, meteor=False)
    took = {"tokenize": ours_s, "java_tokenize": java_s, "builtin": builtin_s, "toolkit": toolkit_s}
    return {
        "captions": len(captions),
        "token_mismatches": len(mismatches),
        "examples": mismatches[:10],
        "builtin": builtin,
        "toolkit": toolkit,
        "max_abs_diff": max(abs(builtin[k] - toolkit[k]) for k in toolkit),
        "seconds": {k: v.seconds for k, v in took.items()},
    }


def report(result: dict[str, Any]) -> str:
    """The comparison as a Markdown table, with the token count above it."""
    lines = [
        f"{result['captions']:,} captions; tokenised otherwise than the toolkit's Java PTB tokenizer: "
        f"{result['token_mismatches']}",
        "",
    ]
    metrics = [
        [key, f"{result['builtin'][key]:.10f}", f"{theirs:.10f}", f"{result['builtin'][key] - theirs:.1e}"]
        for key, theirs in result["toolkit"].items()
    ]
    lines.append(markdown_table(["metric", "built-in", "COCO toolkit", "difference"], metrics))
    for caption, ours, theirs in result["examples"]:
        lines.append(f"\n{caption!r}\n  built-in {ours}\n  toolkit  {theirs}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=5000, help="images in the corpus, 5 references each")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = compare(*parity_corpus(args.images, args.seed))
    print(report(result))
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in result["seconds"].items()))
    return result
