"""The zero-shot scorers measured on the built-in shapes (docs/captioning.md#zero-shot-classification-and-retrieval):
top-1 of each scorer, and of caption likelihood with its prompt scores totalled or averaged per token, of one or
more trained shapes bundles (``vitattn-train head=caption`` or ``head=coca``).

    python -m benchmarks.zero_shot_scorers RUN/bundle [RUN/bundle ...] [--images 500] [--out DIR]

Two tasks on the test split (seed 0, 64 px, as ``data=shapes`` makes it): the 15 classes of the left-most shape
(the classification layout, written under ``--out`` for ``vitattn-eval task=zero_shot data_root=DIR``), all images
and the single-shape ones; and each of the first 100 test images among their canonical captions as classes (one
to three shapes: 4 to 14 tokens), where a prompt's length varies and its normalisation matters.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from vitattn.bundle import load_model
from vitattn.data.shapes import CLASS_NAMES, generate_scene, render_scene, scene_caption, scene_label
from vitattn.inference.zero_shot import SCORERS, zero_shot_classifier


def write_test_folder(out: Path, images: int) -> list:
    """The first ``images`` test scenes, written as ``out/test/<class>/<index>.png`` (once); returns the scenes."""
    scenes = [generate_scene(0, "test", i) for i in range(images)]
    for i, scene in enumerate(scenes):
        path = out / "test" / CLASS_NAMES[scene_label(scene)] / f"{i}.png"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            render_scene(scene, 64).save(path)
    return scenes


def top1(classifier, pixels: torch.Tensor, targets: torch.Tensor, batch_size: int = 50) -> float:
    with torch.no_grad():
        logits = torch.cat([classifier(pixels[i : i + batch_size]) for i in range(0, len(pixels), batch_size)])
    return float((logits.argmax(1) == targets).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--out", type=Path, default=Path("bench_data/shapes-zero-shot"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    scenes = write_test_folder(args.out, args.images)
    single = torch.tensor([len(s) == 1 for s in scenes])
    targets = torch.tensor([scene_label(s) for s in scenes])
    captions = list(dict.fromkeys(scene_caption(s) for s in scenes[:100]))
    caption_targets = torch.tensor([captions.index(scene_caption(s)) for s in scenes[:100]])
    print(f"{args.images} test images ({int(single.sum())} single-shape); {len(captions)} distinct captions")
    print("| model | task | templates | scorer | length | top-1 all | top-1 single |")
    print("|---|---|---|---|---|---|---|")
    for path in args.models:
        bundle = load_model(path)
        pixels = torch.stack([bundle.transform(render_scene(s, 64)) for s in scenes])
        for templates in (None, ["a small {}", "a large {}"]):
            for scorer in SCORERS[1:]:
                try:
                    classifier = zero_shot_classifier(bundle.model, bundle.vocab, CLASS_NAMES, templates, scorer)
                except ValueError:
                    continue  # contrastive and both on a head=caption model
                for norm in ("total", "mean") if scorer != "contrastive" else ("-",):
                    classifier.length_norm = norm if norm != "-" else "total"
                    whole, one = top1(classifier, pixels, targets), top1(classifier, pixels[single], targets[single])
                    shown = "|".join(classifier.templates)
                    print(f"| {path} | left-most shape | {shown} | {scorer} | {norm} | {whole:.3f} | {one:.3f} |")
        classifier = zero_shot_classifier(bundle.model, bundle.vocab, captions, ["{}"], "likelihood")
        for norm in ("total", "mean"):
            classifier.length_norm = norm
            score = top1(classifier, pixels[:100], caption_targets)
            print(f"| {path} | own caption of {len(captions)} | {{}} | likelihood | {norm} | {score:.3f} | |")


if __name__ == "__main__":
    main()
