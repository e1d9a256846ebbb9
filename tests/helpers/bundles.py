"""Tiny random bundles whose answers follow the image (captioner, classifier), the oracles the inference tests
score them with, and a Hugging Face cache laid out as huggingface_hub's download lays it."""

from __future__ import annotations

from pathlib import Path

# A tiny untrained captioner for inference tests: 32 px images, 8 px patches, width 32, 2 layers.
CAPTION_WORDS = "a red blue green circle square on the left right".split()


CAPTION_PREPROCESS = dict(
    img_size=32, crop_pct=1.0, crop_mode="squash", mean=[0.5] * 3, std=[0.5] * 3, interpolation="bicubic"
)


# Gains that make a random tiny model's answers depend on the image (see _follow_the_image).
PATCH_GAIN, ATTENTION_GAIN = 4.0, 3.0


def _follow_the_image(model) -> None:
    """Make a random model's outputs depend on the image, deterministically: fresh, its patch tokens
    differ little between images and its attention outputs are small next to the residual stream, so
    every photo got the same caption ("a a a a a a a") and the same top-2 labels. The patch embedding
    x PATCH_GAIN and every attention layer's values and output x ATTENTION_GAIN let the image steer
    the answer (captions and labels that differ between images; tests assert how many before any
    ordering or routing assertion, see ``distinct``)."""
    import torch

    from vitattn.layers import MultiHeadAttention

    encoder = model.encoder if hasattr(model, "encoder") else model
    with torch.no_grad():
        encoder.patch_embed.proj.weight.mul_(PATCH_GAIN)
        for layer in model.modules():
            if isinstance(layer, MultiHeadAttention):
                layer.wv.weight.mul_(ATTENTION_GAIN)
                layer.dense.weight.mul_(ATTENTION_GAIN)


def distinct(answers, at_least: int = 3) -> int:
    """The number of distinct ``answers`` (captions, label lists), asserted to be at least ``at_least``:
    an ordering or routing assertion on answers that are all alike cannot see images swapped."""
    count = len({tuple(a) if isinstance(a, list) else a for a in answers})
    assert count >= at_least, f"only {count} distinct answers among {len(answers)}: {answers}"
    return count


def teacher_forced_log_prob(model, images, generated, banned: bool = True):
    """(B,) total log-probability of an ``ImageCaptioner``'s generated captions (B, T') in one teacher-forced pass
    (``<bos>`` and the padding after ``<eos>`` excluded), the banned tokens masked before ``log_softmax`` as the
    search masks them (``banned``; False: the model's plain probabilities): an oracle for step-by-step scores."""
    import torch

    bos = generated.new_full((generated.shape[0], 1), model.decoder.bos_id)
    logits = model(images, torch.cat([bos, generated[:, :-1]], dim=1)).float()  # (B, T', V)
    if banned:
        logits[..., model.special_ids.banned] = float("-inf")
    logp = logits.log_softmax(-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)  # (B, T')
    return logp.masked_fill(generated == model.decoder.pad_id, 0.0).sum(dim=1)


def make_caption_bundle(folder: Path, preprocess: dict | None = None) -> Path:
    """Write a bundle of a tiny random captioner (seed 0) whose captions are a few words, not empty, and
    depend on the image (``_follow_the_image``)."""
    import torch

    from vitattn.bundle import save_bundle
    from vitattn.data.tokenizer import Vocabulary
    from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer

    torch.manual_seed(0)
    vocab = Vocabulary(CAPTION_WORDS)
    decoder = CaptionDecoder(len(vocab), embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, max_len=8)
    with torch.no_grad():
        decoder.token_embed.weight[vocab.eos_id].zero_()  # captions of a few words, not empty ones
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
    model = ImageCaptioner(encoder, decoder).eval()
    _follow_the_image(model)
    return save_bundle(folder, model, task="caption", preprocess=preprocess or CAPTION_PREPROCESS, vocab=vocab)


def make_classifier_bundle(folder: Path, class_names=("cat", "dog", "bird"), preprocess: dict | None = None) -> Path:
    """Write a bundle of a tiny random classifier (seed 0): 32 px images, 8 px patches, width 32, 2 layers,
    whose labels depend on the image (``_follow_the_image``)."""
    import torch

    from vitattn.bundle import save_bundle
    from vitattn.models import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=len(class_names)
    ).eval()
    _follow_the_image(model)
    return save_bundle(
        folder, model, task="classification", preprocess=preprocess or CAPTION_PREPROCESS, class_names=list(class_names)
    )


def put_in_hub_cache(cache: Path, repo_id: str, files, revision: str = "main") -> Path:
    """Lay ``files`` (paths, or a folder's files) out in the Hugging Face ``cache`` as huggingface_hub's
    download does, for the model repository ``repo_id`` at ``revision`` (a branch or tag, else a commit hash):
    ``models--ORG--NAME/blobs/<sha256>``, ``snapshots/<commit>/<name>`` linking to its blob, and
    ``refs/<revision>`` holding the commit. Returns the snapshot folder."""
    import hashlib
    import os
    import shutil

    files = sorted(Path(files).iterdir()) if isinstance(files, (str, Path)) else [Path(f) for f in files]
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    is_commit = len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)
    commit = revision if is_commit else hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in files:
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).unlink(missing_ok=True)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    if not is_commit:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
    return snapshot
