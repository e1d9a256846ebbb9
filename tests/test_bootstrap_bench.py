"""The bootstrap bench's pseudo-label scores, from a run's logged pairs against the pool's folders, by hand."""

import json

import pytest

from benchmarks.bootstrap_bench import pseudo_label_stats


def test_pseudo_labels_are_scored_against_each_images_folder_overall_and_in_the_last_quarter(tmp_path):
    records = [  # (step, the image's folder, the label, kept)
        (1, "cat", "cat", True),
        (1, "dog", "cat", False),
        (2, "dog", "cat", True),
        (4, "cat", "cat", True),  # the last quarter: steps >= 3
        (4, "dog", "dog", False),
    ]
    folder = tmp_path / "semi"
    folder.mkdir()
    lines = [{"step": s, "key": f"/pool/{c}/{i}.png", "label": y, "kept": k} for i, (s, c, y, k) in enumerate(records)]
    (folder / "pseudo_labels.rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[:3]))
    (folder / "pseudo_labels.rank1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[3:]))
    stats = pseudo_label_stats(tmp_path)
    assert stats == pytest.approx(
        {
            "pseudo_kept": 3 / 5,
            "pseudo_kept_accuracy": 2 / 3,
            "pseudo_accuracy": 3 / 5,
            "pseudo_kept_last_quarter": 1 / 2,
            "pseudo_kept_accuracy_last_quarter": 1.0,
            "pseudo_accuracy_last_quarter": 1.0,
        }
    )
    assert pseudo_label_stats(tmp_path / "no-run") == {}
