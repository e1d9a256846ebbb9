"""``python -m benchmarks padding`` on a handful of images: both arms run, each batch by patches holds at most
``batch_size x max_patches`` patches, and packing (``packed_rows``, first-fit decreasing) never pads more."""

import argparse

from benchmarks import padding


def test_packed_rows_fit_images_first_fit_decreasing():
    assert padding.packed_rows([8, 4, 4, 6, 2], 8) == 3  # 8 | 6 2 | 4 4
    assert padding.packed_rows([5, 5, 5], 8) == 3 and padding.packed_rows([3, 3, 2], 8) == 1
    assert padding.first_fit([8, 4, 4, 6, 2], 8) == [(0, 0), (2, 0), (2, 4), (1, 0), (1, 6)]  # (row, offset) each


def test_the_padding_section_measures_both_arms(tmp_path):
    parser = argparse.ArgumentParser()
    padding.add_arguments(parser)
    args = parser.parse_args(["--images", "24", "--max-patches", "16", "--patch-size", "8", "--batch-size", "4"])
    results = padding.run(args)
    by_images, by_patches = results["max_patches=16 batch_size"], results["max_patches=16 batch_patches"]
    assert by_images["images_per_batch_mean"] == 4 and by_images["batches"] == 6
    assert by_patches["patches_per_batch_max"] <= 4 * 16 and by_patches["buckets"] == [4, 9, 12, 16]
    for found in (by_images, by_patches):
        assert 0 <= found["packed_share_mean"] <= found["padded_share_mean"] < 1
