from pathlib import Path

import pytest

from tests.helpers.bundles import make_caption_bundle


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    """The tiny caption bundle of ``make_caption_bundle``, once per test module."""
    return make_caption_bundle(tmp_path_factory.mktemp("model") / "bundle")
