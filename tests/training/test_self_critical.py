"""Self-critical training (``finetune=scst``) and starting a run from a whole trained model (``finetune.init``)."""

import csv
import json
import math
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.helpers.bundles import make_caption_bundle, make_classifier_bundle
from tests.helpers.datasets import make_coco, make_karpathy
from tests.helpers.runs import TINY, TINY_SHAPES, compose_train, console_script
from tests.training.test_preemption import DDP_CPU, ENV
from vitattn.cli.export import main as export_main
from vitattn.data.shards.writer import shapes_samples, write_shards
from vitattn.errors import ConfigError
from vitattn.inference.api import Captioner
from vitattn.losses import scst_loss
from vitattn.metrics import CiderD, cider_d
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer
from vitattn.run_dir import RunDir
from vitattn.training import train
from vitattn.training.build import prepare_reward, read_statistics
from vitattn.training.systems.self_critical import ScstConfig, SelfCritical, mean_of_others, sample_log_probs

# A captioner on the built-in shapes that logs every step; SCST and cross-entropy second stages start from it.
BASE = [*TINY, *TINY_SHAPES, "trainer.max_epochs=-1", "trainer.log_every_n_steps=1", "export_bundle=true"]


def _toy_captioner(seed: int = 0, vocab_size: int = 7, unk_id: int | None = 3) -> ImageCaptioner:
    torch.manual_seed(seed)
    encoder = VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=0)
    decoder = CaptionDecoder(
        vocab_size, embed_dim=16, depth=1, num_heads=2, max_len=6, drop_rate=0.0, unk_id=unk_id, memory_dim=16
    )
    return ImageCaptioner(encoder, decoder)


def test_the_mean_baseline_is_the_mean_of_the_images_other_samples():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 0.0, 2.0])  # two images, three samples each
    assert mean_of_others(rewards, 3).tolist() == [2.5, 2.0, 1.5, 1.0, 6.0, 5.0]


def test_sample_log_probs_equal_the_incremental_decoder_under_the_searchs_bans():
    # One teacher-forced pass over B * K rows against K rows per image of image tokens must give what the
    # cached step-by-step decoder (the search's own path) gives, <pad>, <bos>, <unk> banned, <eos> counted.
    model = _toy_captioner().eval()
    images = torch.randn(2, 3, 16, 16)
    sampled = torch.tensor([[4, 5, 2, 0, 0], [6, 2, 0, 0, 0], [5, 5, 5, 6, 2], [2, 0, 0, 0, 0]])  # 2 per image
    memory = model.encode(images)
    log_probs, mask = sample_log_probs(model, memory, sampled)
    assert mask.sum(1).tolist() == [3, 2, 5, 1]

    step = model.decode_step(memory, 5)
    tokens = torch.cat([torch.full((4, 1), 1), sampled], dim=1)
    for t in range(5):
        logits = step(tokens[:, : t + 1]).float()
        logits[:, [0, 1, 3]] = float("-inf")
        expected = logits.log_softmax(-1).gather(1, sampled[:, t : t + 1]).squeeze(1)
        torch.testing.assert_close(log_probs[:, t][mask[:, t]], expected[mask[:, t]], rtol=1e-5, atol=1e-6)
    assert (log_probs[~mask] == 0).all()


def test_one_self_critical_step_rewards_each_sample_against_its_own_images_references():
    model = _toy_captioner(1)
    words = ["<pad>", "<bos>", "<eos>", "<unk>", "red", "blue", "circle"]
    decode = lambda ids: [" ".join(words[i] for i in row if i > 3) for row in ids.tolist()]  # noqa: E731
    references = [["red circle", "a red circle"], ["blue blue", "blue circle"]]
    scorer = CiderD([*references, ["circle"], ["red blue"]], eos_word=True)
    objective = SelfCritical(ScstConfig(samples=4, baseline="mean", max_new_tokens=5), scorer, decode)
    torch.manual_seed(3)
    loss, logged = objective(model, torch.randn(2, 3, 16, 16), references, None)
    torch.manual_seed(3)  # the same draw, by hand: sampled rows are K per image, consecutive
    memory = model.encode(torch.randn(2, 3, 16, 16))
    from vitattn.models.generate import greedy_search

    sampled = greedy_search(
        model.decode_step(memory.detach(), 5),
        8,
        5,
        model.special_ids,
        "cpu",
        dict(temperature=1.0, top_k=0, top_p=1.0, generator=None),
    )
    ended = (sampled == 2).any(1).tolist()
    assert 0 < sum(ended) < 8  # some samples end, some are cut by the length limit
    rewards = torch.tensor(scorer(decode(sampled), [references[0]] * 4 + [references[1]] * 4, ended))
    assert rewards.tolist() != scorer(decode(sampled), [references[0]] * 4 + [references[1]] * 4)  # as if all ended
    assert len(set(decode(sampled))) > 2  # the samples differ, so the rewards can
    assert float(logged["reward"]) == pytest.approx(float(rewards.mean()))
    assert float(logged["baseline"]) == pytest.approx(float(rewards.mean()))  # mean of the leave-one-out means
    assert float(logged["eos_share"]) == pytest.approx(float((sampled == 2).any(1).float().mean()))
    log_probs, mask = sample_log_probs(model, memory, sampled)
    assert loss.item() == pytest.approx(
        scst_loss(log_probs, mask, rewards - mean_of_others(rewards, 4)).item(), rel=1e-5
    )
    loss.backward()
    assert model.encoder.patch_embed.proj.weight.grad.abs().sum() > 0  # the encoder learns too


def test_cider_d_rewards_average_to_the_corpus_score_when_the_corpus_is_the_scored_set():
    # every image shares n-grams with another, so each image's references move the document frequencies
    refs = [["a red circle", "red circle left"], ["a blue square"], ["two green triangles", "a red square"]]
    preds = ["a red circle", "a blue circle", "green triangles"]
    scorer = CiderD(refs)
    per_image = scorer(preds, refs)
    assert sum(per_image) / 3 == pytest.approx(cider_d(preds, refs), rel=1e-12)
    assert per_image[0] > per_image[1] > 0  # a caption's score is its own: not the batch's
    assert scorer(preds[:1], refs[:1]) == per_image[:1]


def test_the_rewards_eos_word_is_the_toolkits_cider_d_with_eos_written_as_a_word():
    # self-critical.pytorch scores id strings with the end id written after every reference and after each
    # candidate that ended; the same corpus with a literal "<eos>" word, scored by the plain rule, is the oracle
    refs = [["a red circle", "red circle left"], ["a blue square", "one blue square"], ["two green triangles"]]
    preds, ended = ["a red circle", "a blue", "two green triangles"], [True, False, True]
    written = [[f"{r} <eos>" for r in image_refs] for image_refs in refs]
    expected = CiderD(written)([p + " <eos>" * e for p, e in zip(preds, ended)], written)
    assert CiderD(refs, eos_word=True)(preds, refs, ended) == pytest.approx(expected, rel=1e-12)
    assert CiderD(refs, eos_word=True)(preds, refs, ended) != pytest.approx(CiderD(refs)(preds, refs), rel=1e-3)


def test_a_caption_cut_by_the_length_limit_scores_below_the_whole_caption():
    references = [  # five per image, as COCO's
        ["a woman rides a horse on the beach", "a man riding a horse", "a man riding a horse on the sand"],
        ["a woman on a horse", "a woman rides a horse by the ocean", "a man riding a horse by the ocean"],
        ["a woman riding a horse on the sand", "a man rides a horse by the ocean", "a man on a horse on the sand"],
    ]
    references[0] += ["a man on a horse on a beach", "a man riding a horse"]
    references[1] += ["a man riding a horse along the shore", "a person rides a horse on the sand"]
    references[2] += ["a woman riding a horse by the ocean"] * 2
    whole, cut = "a man riding a horse on the beach", "a man riding a horse on the"
    plain = CiderD(references)([whole, cut], references[:1] * 2)
    assert plain[1] > plain[0]  # the toolkit's rule rewards the dangling ending
    reward = CiderD(references, eos_word=True)([whole, cut], references[:1] * 2, [True, False])
    assert reward[0] > reward[1]


def _policy_log_probs(logits: torch.Tensor, config: ScstConfig) -> torch.Tensor:
    """(S, V) log-probabilities of the tempered, truncated policy, row by row: the top_k, then the fewest most
    probable tokens whose mass reaches top_p, renormalised."""
    out = torch.full_like(logits, float("-inf"))
    for row, scores in enumerate(logits / config.temperature):
        order = scores.argsort(descending=True)[: config.top_k or None]
        probs = scores[order].softmax(-1)
        kept = order[: int((probs.cumsum(-1) - probs < config.top_p).sum())]
        out[row, kept] = scores[kept].log_softmax(-1)
    return out


@pytest.mark.parametrize(
    "config",
    [
        ScstConfig(samples=3, max_new_tokens=5),
        ScstConfig(samples=3, temperature=0.6, top_p=0.8, max_new_tokens=5),
        ScstConfig(samples=3, top_k=3, max_new_tokens=5),
    ],
    ids=["plain", "tempered_top_p", "top_k"],
)
def test_the_pass_that_samples_and_the_pass_that_scores_give_the_same_log_probabilities(config, monkeypatch):
    # a decoder with heavy dropout, in train mode: two passes under two dropout masks would differ; the scoring
    # pass gives the log-probabilities of the policy that drew, tempered and truncated
    torch.manual_seed(0)
    encoder = VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=0)
    decoder = CaptionDecoder(7, embed_dim=16, depth=1, num_heads=2, max_len=6, drop_rate=0.5, memory_dim=16)
    model = ImageCaptioner(encoder, decoder).train()
    import vitattn.models.generate as generation
    import vitattn.training.systems.self_critical as self_critical

    steps, scored = [], {}
    next_logits, log_probs_of = generation._next_logits, self_critical.sample_log_probs
    monkeypatch.setattr(generation, "_next_logits", lambda *a: steps.append(next_logits(*a)) or steps[-1])

    def scoring_pass(model, memory, sampled, config):
        scored["sampled"] = sampled
        scored["log_probs"], scored["mask"] = log_probs_of(model, memory, sampled, config)
        return scored["log_probs"], scored["mask"]

    monkeypatch.setattr(self_critical, "sample_log_probs", scoring_pass)
    scorer = CiderD([["red circle"], ["blue square"]], eos_word=True)
    objective = SelfCritical(config, scorer, lambda ids: ["red circle"] * len(ids))
    loss, _ = objective(model, torch.randn(2, 3, 16, 16), [["red circle"], ["blue square"]], None)

    sampled, mask = scored["sampled"], scored["mask"]
    drawn = torch.stack([_policy_log_probs(logits.float(), config) for logits in steps], dim=1)  # (B * K, T, V)
    drawn = drawn.gather(-1, sampled[..., None]).squeeze(-1)  # (B * K, T)
    assert mask.sum() >= 12  # several tokens compared
    torch.testing.assert_close(scored["log_probs"][mask], drawn[mask], rtol=1e-5, atol=1e-6)
    assert model.decoder.training and loss.requires_grad  # the decoder's mode restored, a gradient to take


class _References:
    def __init__(self, references):
        self.references, self.calls = references, 0

    def train_references(self):
        self.calls += 1
        return self.references


def test_reward_statistics_record_their_rule_and_an_older_file_is_computed_again(tmp_path):
    references = [["a red circle", "red circle left"], ["a blue square"]]
    data = _References(references)
    path = RunDir(tmp_path).cider_statistics
    older = {"format": "vitattn-cider-statistics/1", "num_images": 2, "n": 4, "document_frequency": {"red": 9}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(older))
    scorer = prepare_reward(data, tmp_path, resuming=True)  # a restart of a run whose file is of the old rule
    assert data.calls == 1 and scorer.eos_word and scorer.doc_freq == CiderD(references, eos_word=True).doc_freq
    assert ("<eos>",) in scorer.doc_freq and json.loads(path.read_text())["eos_word"] is True
    again = prepare_reward(data, tmp_path, resuming=True)  # the file of this rule is read, not recomputed
    assert data.calls == 1 and again.doc_freq == scorer.doc_freq and again.eos_word
    preds = ["a red circle", "a blue"]
    assert again(preds, references, [True, False]) == scorer(preds, references, [True, False])


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["finetune=scst"], "finetune=scst needs finetune.init=RUN_OR_BUNDLE: a captioner trained"),
        (["finetune=scst", "head=classification", "finetune.init={classifier}"], "finetune=scst trains captioners"),
        (
            ["finetune=scst", "finetune.init={captioner}", "finetune.scst.samples=1"],
            "finetune.scst.samples=1 with finetune.scst.baseline=mean leaves no other sample to average",
        ),
        (
            ["finetune=scst", "finetune.init={captioner}", "finetune.scst.baseline=best"],
            "finetune.scst.baseline='best' is unknown",
        ),
        (
            ["finetune=scst", "finetune.init={captioner}", "finetune.scst.max_new_tokens=99"],
            "finetune.scst.max_new_tokens=99 exceeds the decoder's max_len=8 - 1",
        ),
    ],
)
def test_bad_self_critical_settings_are_one_line(overrides, message, tmp_path):
    models = {"classifier": make_classifier_bundle(tmp_path / "c"), "captioner": make_caption_bundle(tmp_path / "b")}
    overrides = [o.format(**models) for o in overrides]
    with pytest.raises(ConfigError) as err:
        train(compose_train([*TINY, *TINY_SHAPES, *overrides], tmp_path / "run"))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_data_without_references_is_refused_in_one_line(tmp_path):
    class NoReferences:
        pass

    with pytest.raises(ConfigError, match=r"^finetune=scst: the data \(NoReferences\) gives no reference captions"):
        prepare_reward(NoReferences(), tmp_path, resuming=False)


# ------------------------------------------------------------------------------------------------- runs


@pytest.fixture
def base_run(small_caption_run):
    """A captioner trained with cross-entropy (the shared small run of tests/conftest.py: 40 steps): the run both
    second stages start from."""
    return small_caption_run


def _bundle_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(RunDir(run_dir).bundle / "model.safetensors")


def test_init_starts_from_every_weight_and_the_models_sizes(base_run, tmp_path):
    # Sizes composed into the config but not given on a command line give way to the model's own; with no
    # learning rate, the run exports exactly the model it started from.
    run_dir = tmp_path / "run"
    other_sizes = ["model.embed_dim=64", "model.depth=3", "data.img_size=64"]
    overrides = [*other_sizes, f"finetune.init={base_run}", "optim.lr=0.0", "trainer.max_steps=3", "weights=last"]
    result = train(compose_train([*BASE, *overrides], run_dir))
    saved = RunDir(run_dir).load_config()
    assert (saved.model.embed_dim, saved.model.depth, saved.data.img_size) == (32, 2, 32)
    ours, theirs = _bundle_weights(run_dir), _bundle_weights(base_run)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (run_dir / "vocab.json").read_text() == (base_run / "vocab.json").read_text()
    assert result.global_step == 3


@pytest.mark.parametrize(
    "given, message",
    [
        (["model.embed_dim=64"], "its model has model.embed_dim=32, not model.embed_dim=64 as given"),
        pytest.param(["tokenizer=bpe"], "brings its own tokenizer (Vocabulary", marks=pytest.mark.slow),
    ],
)
def test_init_refuses_what_the_command_line_says_otherwise(given, message, base_run, tmp_path):
    command = [
        str(console_script("vitattn-train")),
        *TINY,
        f"finetune.init={base_run}",
        *given,
        f"hydra.run.dir={tmp_path}/run",
    ]
    command = [c for c in command if c != "model.embed_dim=32"] if given[0].startswith("model.") else command
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]


def test_scst_trains_from_the_checkpoint_logs_its_reward_and_computes_statistics_once(base_run, tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["finetune=scst", f"finetune.init={base_run}", "trainer.max_steps=6", "finetune.scst.samples=3"]
    overrides += ["trainer.val_check_interval=3", "trainer.check_val_every_n_epoch=null"]
    result = train(compose_train([*BASE, *overrides], run_dir))
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/reward")]
    assert [int(r["step"]) for r in rows] == list(range(6))
    assert all(0 <= float(r["train/eos_share"]) <= 1 and float(r["train/reward"]) >= 0 for r in rows)
    assert result.weights.startswith("best (val/cider_d") and (run_dir / "bundle" / "model.safetensors").is_file()
    # The statistics are the training references' and are read, not recomputed, by a restart.
    statistics = read_statistics(RunDir(run_dir).cider_statistics)
    assert statistics.num_images == 64
    fresh = CiderD(result.system.trainer.datamodule.train_references(), eos_word=True)
    assert statistics.doc_freq == fresh.doc_freq
    # Its bundle exports to ONNX like any other, and the ONNX folder captions as the bundle does.
    onnx_dir = tmp_path / "onnx"
    assert export_main([f"model={run_dir / 'bundle'}", f"out={onnx_dir}", "format=onnx"]) == 0
    images = [Image.fromarray(np.uint8(np.random.default_rng(i).integers(0, 255, (32, 32, 3)))) for i in range(4)]
    assert Captioner.load(onnx_dir).caption(images) == Captioner.load(run_dir / "bundle", precision="fp32").caption(
        images
    )


@pytest.mark.parametrize("contrastive_weight", [1.0, 0.0])
def test_scst_on_coca_from_a_captioner_keeps_the_weighted_contrastive_term(contrastive_weight, base_run, tmp_path):
    """head=coca under finetune=scst, started from the head=caption run: loss = contrastive_weight · contrastive
    + caption_weight · (SCST + xe_weight · cross-entropy), every term logged and finite at every step."""
    run_dir = tmp_path / "run"
    overrides = ["head=coca", "finetune=scst", f"finetune.init={base_run}", "trainer.max_steps=3"]
    overrides += ["finetune.scst.samples=2", "finetune.scst.xe_weight=0.5", "head.caption_weight=2.0"]
    overrides += [f"head.contrastive_weight={contrastive_weight}", "trainer.precision=32-true"]
    train(compose_train([*BASE, *overrides], run_dir))
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/scst_loss")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for row in rows:
        loss, scst, caption, contrastive = (
            float(row[f"train/{k}"]) for k in ("loss", "scst_loss", "caption_loss", "contrastive_loss")
        )
        assert all(math.isfinite(v) for v in (loss, scst, caption, contrastive)) and contrastive > 0
        assert loss == pytest.approx(contrastive_weight * contrastive + 2.0 * (scst + 0.5 * caption), abs=1e-5)


def _scst_system(head: str, xe_weight: float, encoder: dict | None = None, scst: dict | None = None, **kwargs):
    """A tiny CaptionSystem or CocaSystem under ``scst`` with a CIDEr-D reward; ``encoder`` overrides the encoder's
    settings, ``scst`` the self-critical ones, ``kwargs`` the system's."""
    from tests.training.test_coca import WORDS
    from vitattn.training.systems import CaptionSystem, CocaSystem
    from vitattn.training.systems.coca import contrastive_model_config

    torch.manual_seed(0)
    encoder = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, **(encoder or {}))
    decoder = dict(vocab_size=len(WORDS) + 4, embed_dim=32, depth=1, num_heads=2, max_len=8)
    config, scst = {"encoder": encoder, "decoder": decoder}, {"samples": 2, "xe_weight": xe_weight, **(scst or {})}
    if head == "coca":
        contrastive = {"loss": "clip", "embed_dim": 16, "text_depth": 1, "text_num_heads": 2, "text_mlp_ratio": 2.0}
        config["contrastive"] = contrastive_model_config(contrastive, 2)
    system = (CocaSystem if head == "coca" else CaptionSystem)(config, WORDS, scst=scst, **kwargs)
    system.use_reward(CiderD([["a red circle"], ["the blue square"]], eos_word=True))
    return system


@pytest.mark.parametrize("xe_weight", [0.0, 0.5])
@pytest.mark.parametrize("head", ["caption", "coca"])
def test_an_scst_step_encodes_each_image_once_and_skips_the_cross_entropy_at_xe_weight_0(head, xe_weight, monkeypatch):
    system = _scst_system(head, xe_weight)
    encoded, cross_entropies = [], []
    forward_tokens, caption_loss = system.model.encoder.forward_tokens, system.caption_loss.forward
    monkeypatch.setattr(system.model.encoder, "forward_tokens", lambda x: encoded.append(x) or forward_tokens(x))
    monkeypatch.setattr(system.caption_loss, "forward", lambda *a: cross_entropies.append(a) or caption_loss(*a))
    tokens = torch.tensor([[1, 4, 8, 7, 2, 0], [1, 6, 9, 10, 2, 0]])  # <bos> a red circle <eos> <pad>
    batch = {"images": torch.randn(2, 3, 32, 32), "tokens": tokens, "references": [["a red circle"], ["the blue"]]}
    loss = system._self_critical_loss(batch, 2)
    loss.backward()
    assert len(encoded) == 1  # sampling, scoring, the cross-entropy and the contrastive term share it
    assert len(cross_entropies) == (xe_weight > 0)
    assert system.model.encoder.patch_embed.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("generate, own, length", [(None, None, 7), (3, None, 3), (3, 5, 5), (None, 4, 4)])
def test_scst_samples_up_to_its_own_length_else_the_generation_length(generate, own, length, monkeypatch):
    """finetune.scst.max_new_tokens; null: head.generate.max_new_tokens, the generation length; null too: the
    decoder's max_len - 1 (8 - 1)."""
    import vitattn.training.systems.self_critical as self_critical

    system = _scst_system("caption", 0.0, scst={"max_new_tokens": own}, generate={"max_new_tokens": generate})
    lengths, search = [], self_critical.greedy_search
    monkeypatch.setattr(
        self_critical, "greedy_search", lambda step, rows, n, *a: lengths.append(n) or search(step, rows, n, *a)
    )
    tokens = torch.tensor([[1, 4, 8, 7, 2, 0], [1, 6, 9, 10, 2, 0]])  # <bos> a red circle <eos> <pad>
    batch = {"images": torch.randn(2, 3, 32, 32), "tokens": tokens, "references": [["a red circle"], ["the blue"]]}
    system._self_critical_loss(batch, 2)
    assert lengths == [length]  # the samples' one search (baseline mean: no greedy pass)


@pytest.mark.parametrize("head", ["caption", "coca"])
def test_an_scst_step_on_merged_tokens_decodes_and_embeds_with_their_sizes(head, monkeypatch):
    # Merged tokens and a mean pool: without the sizes, cross-attention loses proportional attention and the
    # image embedding becomes the unweighted mean of the merged tokens.
    system = _scst_system(head, 0.5, encoder={"merge_tokens": 4, "global_pool": "avg"})
    memories, embedded = [], []
    self_critical = system.self_critical
    monkeypatch.setattr(system, "self_critical", lambda *a: memories.append(a[4]) or self_critical(*a))
    if head == "coca":
        loss = system.contrastive_loss.forward
        monkeypatch.setattr(system.contrastive_loss, "forward", lambda *a: embedded.append(a[0]) or loss(*a))
    images = torch.randn(2, 3, 32, 32)
    tokens = torch.tensor([[1, 4, 8, 7, 2, 0], [1, 6, 9, 10, 2, 0]])
    system._self_critical_loss({"images": images, "tokens": tokens, "references": [["a red circle"], ["the"]]}, 2)
    expected = system.model.encode(images)
    assert expected.sizes is not None  # the tokens were merged
    torch.testing.assert_close(memories[0].sizes, expected.sizes)
    torch.testing.assert_close(memories[0].tokens, expected.tokens)
    if head == "coca":
        torch.testing.assert_close(embedded[0], system.model.embed_images(images))


@pytest.fixture(scope="module")
def caption_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    coco, karpathy = make_coco(root / "coco"), make_karpathy(root / "karpathy")
    shards = write_shards(shapes_samples("train", 12, img_size=32), root / "shards", 6)
    return {
        "coco": [f"data.{k}={v}" for k, v in coco.items()],
        "karpathy": [f"data.{k}={v}" for k, v in karpathy.items()],
        "webdataset": [f"data.train_shards={shards[0].parent}", f"data.val_shards={shards[0]}", "data.num_workers=0"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("data", ["coco", "karpathy", "webdataset"])
def test_scst_trains_on_every_caption_data_path_with_ema(data, caption_data, base_run, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*TINY, f"data={data}", *caption_data[data], "finetune=scst", f"finetune.init={base_run}"]
    result = train(
        compose_train([*overrides, "trainer.max_steps=2", "ema.decay=0.9", "trainer.log_every_n_steps=1"], run_dir)
    )
    assert result.global_step == 2 and result.bundle_dir is not None
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        assert any(row.get("train/reward") for row in csv.DictReader(f))
    statistics = read_statistics(RunDir(run_dir).cider_statistics)
    assert statistics.doc_freq == CiderD(result.system.trainer.datamodule.train_references(), eos_word=True).doc_freq


@pytest.mark.slow
def test_a_two_process_scst_run_stopped_by_sigterm_resumes_without_repeating_a_step(base_run, tmp_path):
    run_dir = tmp_path / "run"
    command = [
        str(console_script("vitattn-train")),
        *DDP_CPU,
        *BASE,
        "finetune=scst",
        f"finetune.init={base_run}",
        "finetune.scst.samples=2",
        "trainer.max_steps=24",
        "callbacks.step_checkpoint.every_n_train_steps=24",
        "export_bundle=false",
        "test=false",
        "resume=auto",
        f"hydra.run.dir={run_dir}",
    ]
    metrics = run_dir / "csv" / "metrics.csv"

    def steps() -> list[int]:
        if not metrics.is_file():
            return []
        with open(metrics, newline="") as f:
            return [int(r["step"]) for r in csv.DictReader(f) if r.get("train/reward")]

    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and len(steps()) < 4:
            time.sleep(0.05)
        assert proc.poll() is None and len(steps()) >= 4, (tmp_path / "first.log").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75, stderr[-3000:]
    statistics = RunDir(run_dir).cider_statistics.stat().st_mtime_ns
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert steps() == list(range(24))  # each step once, the first start's kept
    assert RunDir(run_dir).cider_statistics.stat().st_mtime_ns == statistics  # read on restart, not rewritten
    saved = json.loads(RunDir(run_dir).result.read_text())
    assert saved["global_step"] == 24
