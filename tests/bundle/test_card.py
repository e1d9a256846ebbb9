"""The model card's training section, from what a run folder's ``config.yaml`` records (``RunDir.saved``)."""

from vitattn.bundle.card import _run_datasets, _training
from vitattn.run_dir import RunDir

# A run from before semi= (no semi group) that trained on side files; its config as the run folder saves it.
SIDE_FILES_RUN = """\
data:
  _target_: vitattn.training.datamodules.ShapesDataModule
  num_train: 32
  num_val: 8
optim:
  lr: 0.002
  weight_decay: 0.05
head:
  generate:
    num_beams: 1
bootstrap:
  teacher: null
  candidates: side/
  filter: none
  samples: 3
  keep:
    top_k: null
    min_score: 0.5
"""

SEMI_RUN = """\
data:
  _target_: vitattn.training.datamodules.ImageFolderDataModule
optim:
  lr: 0.001
  weight_decay: 0.0
bootstrap:
  teacher: null
  candidates: null
semi:
  method: freematch
  images: pool/
  ratio: 3
  threshold: 0.95
  weight: 0.5
  ema_decay: 0.999
  strong: rand-m10-n2-mstd101-inc1
"""


def _saved(tmp_path, text):
    (tmp_path / "config.yaml").write_text(text)
    return RunDir(tmp_path).saved()


def test_the_card_tells_a_side_files_run_from_its_saved_config(tmp_path):
    saved = _saved(tmp_path, SIDE_FILES_RUN)
    assert _run_datasets(saved) == ["shapes"] and saved.generate == {"num_beams": 1}
    assert _training(saved, {"global_step": 7, "weights": "best"}, ["shapes"]) == [
        "- data: shapes (train 32, val 8 images)",
        "- steps: 7; weights: best",
        "- optimiser: lr 0.002, weight decay 0.05",
        "- also trained on images without captions, labelled by the side files side/ (filter none, 3 candidates per "
        "image, keep min_score 0.5; lineage: the run's bootstrap/lineage.json)",
    ]


def test_the_card_tells_a_semi_run_from_its_saved_config(tmp_path):
    saved = _saved(tmp_path, SEMI_RUN)
    assert _run_datasets(saved) == ["imagefolder"] and saved.generate is None and saved.bootstrap is None
    assert _training(saved, None, []) == [
        "- data: see config",
        "- optimiser: lr 0.001, weight decay 0.0",
        "- also learned from the images without labels of pool/, pseudo-labelled online by an EMA copy of the model "
        "(decay 0.999) (semi=freematch: 3 per labelled image a step, FreeMatch's adaptive threshold, weight 0.5, "
        "strong view rand-m10-n2-mstd101-inc1; pseudo-labels: the run's semi/ folder)",
    ]
