"""Token merging (ToMe) in training: ``model.merge_tokens`` trains the model merged, with every head and from timm
weights; the bundle records it and runs as the trained module ran; a ``finetune.init`` model leaves it to the run.
A count too large for the tokens: tests/training/test_config.py (OWNER_ERRORS)."""

import json

import pytest
import timm
import torch
from safetensors.torch import save_file

from tests.helpers.bundles import make_caption_bundle
from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn.bundle import load_model
from vitattn.bundle.folder import encoder_of
from vitattn.models import VisionTransformer
from vitattn.training import train
from vitattn.training.plan import resolve
from vitattn.training.start_weights import read_start

FAST = [*TINY, *TINY_SHAPES, "trainer.fast_dev_run=true"]
TOKENS = 17  # TINY's 4 x 4 patches and the class token


def _outputs(model: torch.nn.Module, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A classifier's (B, K) logits, or a captioner's (B, T - 1, V) teacher-forced logits of ``tokens``."""
    with torch.no_grad():
        return model(images) if isinstance(model, VisionTransformer) else model(images, tokens)


@pytest.mark.parametrize(
    ("head", "merge_tokens", "schedule"),
    [
        ("caption", "3", [3, 3]),
        ("caption", "[6,2]", [6, 2]),  # one count per layer, as Hydra writes a list
        ("coca", "8", [8, 4]),  # the second layer merges what its 9 tokens allow
        ("classification", "5", [5, 5]),
    ],
)
def test_a_run_with_merge_tokens_trains_merged_and_its_bundle_runs_as_it_trained(
    head, merge_tokens, schedule, tmp_path
):
    result = train(compose_train([*FAST, f"head={head}", f"model.merge_tokens={merge_tokens}"], tmp_path / "run"))
    trained = result.system.model.eval()
    assert encoder_of(trained).merge_schedule == schedule  # what every training step ran
    saved = json.loads((result.bundle_dir / "config.json").read_text())["model"]
    assert saved.get("encoder", saved)["merge_tokens"] == json.loads(merge_tokens)
    loaded = load_model(result.run_dir)
    encoder = encoder_of(loaded.model)
    assert loaded.merge_tokens == json.loads(merge_tokens) and encoder.merge_schedule == schedule
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert encoder.forward_features(images).shape[1] == TOKENS - sum(schedule) == encoder.num_tokens
    tokens = torch.randint(4, 12, (3, 6))
    torch.testing.assert_close(_outputs(loaded.model, images, tokens), _outputs(trained, images, tokens))


def test_a_run_from_timm_weights_trains_merged_on_the_weights_patch_grid(tmp_path):
    """The weights' 4 px patches (the config says 8) give 65 tokens: merge_tokens=12 fits them, not 17 tokens."""
    shape = dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=3)
    save_file(timm.create_model("vit_base_patch16_224", **shape).state_dict(), tmp_path / "vit.safetensors")
    init = [f"finetune.init={tmp_path / 'vit.safetensors'}", "finetune.init_kind=encoder", "model.mlp_ratio=2.0"]
    result = train(compose_train([*FAST, "head=caption", *init, "model.merge_tokens=12"], tmp_path / "run"))
    encoder = load_model(result.run_dir).model.encoder
    assert encoder.patch_embed.patch_size == (4, 4) and encoder.merge_schedule == [12, 12]
    assert encoder.num_tokens == 65 - 24 and result.system.model.encoder.merge_schedule == [12, 12]


def test_a_start_model_leaves_merge_tokens_to_the_run(tmp_path):
    """Whether the start model was trained merged is not what its weights are: the run merges as its config says,
    on the command line too."""
    bundle = make_caption_bundle(tmp_path / "bundle")
    config = json.loads((bundle / "config.json").read_text())
    config["model"]["encoder"]["merge_tokens"] = 6  # a model trained merged
    (bundle / "config.json").write_text(json.dumps(config))
    init = read_start(str(bundle))
    assert init.bundle.merge_tokens == 6
    cfg = compose_train([*TINY, f"finetune.init={bundle}", "model.merge_tokens=2"], tmp_path / "run")
    cfg = resolve(cfg, ["model.merge_tokens=2"]).cfg
    assert cfg.model.merge_tokens == 2
    cfg = compose_train([*TINY, f"finetune.init={bundle}"], tmp_path / "run")
    cfg = resolve(cfg).cfg
    assert cfg.model.merge_tokens == 0 and cfg.data.max_caption_len == 8  # the model's sizes still come from it
