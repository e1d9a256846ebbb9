"""Caption tokenizers: words (Vocabulary) and subword (byte-level BPE, a tokenizer.json file), one interface,
saved in the run, the bundle and the ONNX folder and decoded the same everywhere."""

import json
import logging
import random
import unicodedata

import pytest
import torch

from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn.bundle.checkpoint import load_checkpoint
from vitattn.data.tokenizer import (
    SubwordTokenizer,
    Tokenizer,
    Vocabulary,
    auto_bpe_size,
    load_tokenizer,
    tokenizer_from_labels,
    tokenizer_labels,
    train_bpe,
    unknown_share,
)
from vitattn.errors import ConfigError
from vitattn.metrics.tokenize import coco_tokenize
from vitattn.run_dir import RunDir
from vitattn.training import train

WORDS = "a dog cat man woman sits on the grass near red blue café naïve Zoë jalapeño über straße".split()
PUNCT = list(",.!?;:'\"()-—…&%$#@/")
EMOJI = ["🐶", "🚲", "👩‍🍳", "🇫🇷", "❤️", "🍕"]
SPACES = [" ", "  ", "\t", "\n", " \u00a0"]


def _captions(n: int, seed: int = 0) -> list[str]:
    """Captions with capitals, punctuation, numbers, accents (composed and decomposed), emoji, odd spacing."""
    rng = random.Random(seed)
    captions = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            kind = rng.random()
            if kind < 0.6:
                word = rng.choice(WORDS)
                word = word.upper() if rng.random() < 0.1 else word.capitalize() if rng.random() < 0.2 else word
                parts.append(unicodedata.normalize("NFD", word) if rng.random() < 0.1 else word)
            elif kind < 0.75:
                parts.append(rng.choice(PUNCT))
            elif kind < 0.9:
                parts.append(rng.choice([str(rng.randint(0, 2024)), f"{rng.random() * 10:.2f}", "1,000", "3rd"]))
            else:
                parts.append(rng.choice(EMOJI))
            parts.append(rng.choice(SPACES) if rng.random() < 0.2 else " " if rng.random() < 0.8 else "")
        captions.append(rng.choice(["", " ", "\n"]) + "".join(parts))
    return captions


def normalize_caption(text: str) -> str:
    """What ``tokenizer=bpe`` should make of a caption: NFC, lower case, single spaces, no ends."""
    return " ".join(unicodedata.normalize("NFC", text).lower().split())


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(_captions(2000, seed=1), vocab_size=512)


def test_bpe_round_trip_is_the_normalised_text_on_10000_captions(bpe):
    """decode(encode(text)) == normalize_caption(text): NFC, lower case, single spaces, no spaces at the ends;
    on captions the BPE never saw (other seed) and on characters it never saw (CJK, Cyrillic)."""
    captions = [*_captions(9996, seed=2), *["猫が草の上に座っている", "Кошка на траве", "ǅ ǈ ß ẞ ﬁ", "x" * 300]]
    assert len(captions) >= 10_000 and bpe.unk_id is None and bpe.hf.model.unk_token is None
    wrong = []
    for caption in captions:
        ids = bpe.encode(caption)
        assert all(0 <= i < len(bpe) for i in ids)
        assert ids[0] == bpe.bos_id and ids[-1] == bpe.eos_id and bpe.bos_id not in ids[1:-1]
        expected = normalize_caption(caption)
        if bpe.decode(ids) != expected or bpe.hf.normalizer.normalize_str(caption) != expected:
            wrong.append(caption)
    assert wrong == [], f"{len(wrong)} captions do not round-trip, e.g. {wrong[0]!r}"


def test_bpe_keeps_punctuation_numbers_accents_emoji_and_metrics_read_its_words(bpe):
    text = "  Zoë's  CAFÉ, 3.5 km — 🐶!\n"
    caption = bpe.decode(bpe.encode(text))
    assert caption == "zoë's café, 3.5 km — 🐶!"
    assert coco_tokenize(caption) == coco_tokenize(text)  # the metrics' words are today's


def test_words_round_trip_is_the_coco_tokens():
    captions = _captions(500, seed=3)
    vocab = Vocabulary.build(captions)
    for caption in captions:
        assert vocab.decode(vocab.encode(caption)) == " ".join(coco_tokenize(caption))
    assert isinstance(vocab, Tokenizer) and isinstance(train_bpe(captions[:50]), Tokenizer)


def test_max_len_cuts_subwords_and_keeps_eos(bpe):
    ids = bpe.encode("a dog sits on the grass near a red café", max_len=5)
    assert len(ids) == 5 and ids[0] == bpe.bos_id and ids[-1] == bpe.eos_id


def test_tokens_show_one_piece_per_position(bpe):
    ids = bpe.encode("a naïve dog 🐶")[1:]  # generated tokens carry no bos
    pieces = bpe.tokens(ids + [bpe.pad_id, 7])
    assert len(pieces) == len(ids) - 1  # up to eos
    assert "".join(pieces).replace(" ", "") == "anaïvedog🐶" or "�" in "".join(pieces)


def test_auto_bpe_size_follows_the_data():
    few = auto_bpe_size(["a dog", "a dog", "a cat"])
    assert few == 320  # 256 bytes + 3 specials + 2 frequent words, rounded up to 64
    many = auto_bpe_size([f"w{i} w{i}" for i in range(5000)])
    assert many == -(-(259 + 5000) // 64) * 64


def test_save_load_and_checkpoint_labels_round_trip(bpe, tmp_path):
    bpe.save(tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(loaded, SubwordTokenizer) and loaded == bpe and len(loaded) == len(bpe)
    vocab = Vocabulary(["a", "dog"])
    vocab.save(tmp_path / "vocab.json")
    assert load_tokenizer(tmp_path / "vocab.json") == vocab
    for tokenizer in (bpe, vocab):
        labels = tokenizer_labels(tokenizer)
        torch.save({"hyper_parameters": {"vocab": labels}}, tmp_path / "x.ckpt")
        kept = torch.load(tmp_path / "x.ckpt", weights_only=True)["hyper_parameters"]["vocab"]
        assert tokenizer_from_labels(kept) == tokenizer


def _word_level_json(tmp_path, specials=False):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "a": 1, "dog": 2, "on": 3, "grass": 4}
    if specials:
        vocab.update({"<pad>": 5, "<bos>": 6, "<eos>": 7})
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.enable_padding(length=16)  # a pretrained file may pad: captions must not be
    hf.save(str(tmp_path / "pretrained.json"))
    return tmp_path / "pretrained.json"


def test_a_pretrained_tokenizer_json_gets_the_specials_it_lacks(tmp_path):
    path = _word_level_json(tmp_path)
    with pytest.raises(ValueError, match="has no <pad> <bos> <eos> token; use a tokenizer.json written by vitattn"):
        SubwordTokenizer.from_file(path)
    tokenizer = SubwordTokenizer.from_file(path, add_specials=True)
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id, len(tokenizer)) == (5, 6, 7, 0, 8)
    ids = tokenizer.encode("a dog on the grass")
    assert ids == [6, 1, 2, 3, 0, 4, 7]  # "the" is unknown to this file; no padding to 16
    assert tokenizer.decode(ids) == "a dog on [UNK] grass"  # the file's own unknown token, not marked special
    assert unknown_share(tokenizer, ["a dog on the grass"]) == pytest.approx(0.2)


def _trained_json(kind: str, tmp_path) -> tuple:
    """A tokenizer.json of each ``tokenizers`` model type, trained offline, with its unknown and other specials."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers, trainers

    if kind == "wordpiece":
        model, unk, others = models.WordPiece(unk_token="[UNK]"), "[UNK]", ["[CLS]", "[SEP]", "[PAD]"]
        trainer = trainers.WordPieceTrainer(vocab_size=80, special_tokens=[unk, *others])
    elif kind == "bpe":
        model, unk, others = models.BPE(unk_token="<unk>"), "<unk>", ["<|endoftext|>"]
        trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=[unk, *others])
    else:  # SentencePiece's Unigram: the model names its unknown by id, not by token
        model, unk, others = models.Unigram(), "<unk>", ["<s>", "</s>"]
        trainer = trainers.UnigramTrainer(vocab_size=40, special_tokens=[unk, *others], unk_token=unk)
    hf = HF(model)
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(["a red circle on the left", "two blue squares above a green triangle"] * 8, trainer)
    hf.save(str(tmp_path / f"{kind}.json"))
    return tmp_path / f"{kind}.json", hf.token_to_id(unk), sorted(hf.token_to_id(t) for t in others)


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_a_tokenizer_files_unknown_id_and_other_specials_are_found(kind, tmp_path):
    path, unk_id, others = _trained_json(kind, tmp_path)
    tokenizer = SubwordTokenizer.from_file(path, add_specials=True)
    assert tokenizer.unk_id == unk_id is not None
    assert list(tokenizer.other_special_ids) == others and others
    assert unknown_share(tokenizer, ["a red zebra"]) > 0  # "z" was never seen: its unknown is counted


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_no_special_token_but_eos_is_ever_generated(kind, num_beams, tmp_path):
    from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer

    tokenizer = SubwordTokenizer.from_file(_trained_json(kind, tmp_path)[0], add_specials=True)
    ids = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id
    torch.manual_seed(0)
    encoder = VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2)
    decoder = CaptionDecoder(
        len(tokenizer), embed_dim=16, depth=1, num_heads=2, max_len=8, memory_dim=16, tie_embeddings=False,
        **dict(zip(("pad_id", "bos_id", "eos_id", "unk_id"), ids)), other_special_ids=tokenizer.other_special_ids,
    )  # fmt: skip
    banned = [*ids[:2], ids[3], *tokenizer.other_special_ids]
    with torch.no_grad():  # the banned tokens are the likeliest by far, <eos> next
        decoder.head.bias.zero_()
        decoder.head.bias[banned] = 50.0
        decoder.head.bias[tokenizer.eos_id] = 5.0
    model = ImageCaptioner(encoder, decoder).eval()
    generated = model.generate(torch.randn(4, 3, 16, 16), num_beams=num_beams, max_new_tokens=6)
    assert not set(generated.flatten().tolist()) & set(banned)
    assert (generated[:, 0] == tokenizer.eos_id).all()  # the likeliest allowed token


def test_a_tokenizer_json_that_does_not_load_is_one_line(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    with pytest.raises(ValueError) as err:
        load_tokenizer(bad)
    message = str(err.value)
    assert "\n" not in message and f"{bad} cannot be loaded as a Hugging Face tokenizer.json" in message
    assert "give a file written by tokenizers' Tokenizer.save" in message
    cfg = compose_train(["head=caption", "tokenizer=file", f"tokenizer.path={bad}", *TINY, *TINY_SHAPES], tmp_path)
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"tokenizer.path={bad}: {bad} cannot be loaded")
    missing = compose_train(["head=caption", "tokenizer=file", *TINY, *TINY_SHAPES], tmp_path)
    with pytest.raises(ConfigError, match="tokenizer=file needs tokenizer.path=FILE"):
        train(missing)


FAST_RUN = ["head=caption", *TINY, *TINY_SHAPES, "head.decoder.depth=1", "trainer.fast_dev_run=true"]


@pytest.fixture
def bpe_run(bpe_caption_run):
    """The shared bpe captioner (tests/conftest.py: 40 steps) and its steps and final metrics (``result.json``)."""
    return bpe_caption_run, RunDir(bpe_caption_run).load_result()


@pytest.mark.parametrize("kind", ["words", "bpe"])
def test_words_and_bpe_train_end_to_end_and_save_their_tokenizer(kind, bpe_run, tmp_path, caplog):
    from vitattn.bundle import load_bundle

    if kind == "bpe":
        run, result = bpe_run
        model = load_checkpoint(run / "checkpoints" / "last.ckpt", "cpu")  # the trained model, as saved
        steps, metrics = result["global_step"], result["metrics"]
    else:
        run = tmp_path
        with caplog.at_level(logging.INFO, logger="vitattn.training.build"):
            result = train(compose_train([*FAST_RUN, f"tokenizer={kind}"], run))
        lines = [r.getMessage() for r in caplog.records if "caption words" in r.getMessage()]
        assert lines == [
            "0.0 % of caption words are outside the 15-word vocabulary (min_word_freq=1); tokenizer=bpe has none"
        ]
        steps, metrics, model = result.global_step, result.metrics, result.system
    name = "tokenizer.json" if kind == "bpe" else "vocab.json"
    other = "vocab.json" if kind == "bpe" else "tokenizer.json"
    assert steps == (40 if kind == "bpe" else 1) and torch.isfinite(torch.tensor(metrics["val/loss"]))
    assert (run / name).is_file() and not (run / other).exists()
    assert (run / "bundle" / name).is_file() and json.loads((run / "bundle" / "config.json").read_text())[
        "vocab_file"
    ] == name
    saved = load_tokenizer(run / name)
    assert saved == model.vocab == load_bundle(run / "bundle").vocab  # the trained system's, or its checkpoint's
    assert len(saved) == model.model.decoder.vocab_size
    if kind == "bpe":
        assert isinstance(saved, SubwordTokenizer) and saved.unk_id is None
        assert (
            saved.decode(saved.encode("A red circle left of a blue square.")) == "a red circle left of a blue square."
        )


def test_the_bpe_run_says_it_has_no_unknown_words(tmp_path, caplog):
    from vitattn.training.build import check_fit
    from vitattn.training.datamodules import ShapesDataModule
    from vitattn.training.plan import resolve

    cfg = compose_train([*FAST_RUN, "tokenizer=bpe"], tmp_path)
    dm = ShapesDataModule(task="caption", img_size=32, num_train=64, num_val=16, num_test=16, batch_size=8)
    dm.tokenizer_config = {"kind": "bpe", "vocab_size": "auto"}
    dm.setup("fit")
    with caplog.at_level(logging.INFO, logger="vitattn.training.build"):
        assert not [w for w in check_fit(resolve(cfg), dm) if "caption" in w]
    line = next(r.getMessage() for r in caplog.records if "caption word" in r.getMessage())
    assert line == (
        f"tokenizer=bpe: no caption word is outside the {len(dm.vocab):,}-token subword tokenizer "
        "(it has no unknown token)"
    )


def test_a_restart_reads_the_runs_bpe_and_other_ranks_wait_for_it(bpe_run, monkeypatch):
    from lightning.pytorch.utilities import rank_zero_only

    from vitattn.training.plan import run_tokenizer

    run, result = bpe_run
    assert run_tokenizer("bpe", run, resuming=False) is None  # a first start in a folder that holds one builds its own
    trained = load_checkpoint(run / "checkpoints" / "last.ckpt", "cpu").vocab
    assert run_tokenizer("bpe", run, resuming=True) == trained  # read from the run, not trained again
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with pytest.raises(TimeoutError, match="rank 0 wrote no .*tokenizer.json in 0 s"):
        run_tokenizer("bpe", run / "elsewhere", resuming=False, wait=0.0)


def test_resuming_with_another_tokenizer_is_one_line(bpe_run, tmp_path):
    run, _ = bpe_run
    ckpt = run / "checkpoints" / "last.ckpt"
    cfg = compose_train([*FAST_RUN, "tokenizer=words", f"ckpt_path={ckpt}"], tmp_path / "words")
    with pytest.raises(ConfigError) as err:
        train(cfg)
    message = str(err.value)
    assert "\n" not in message and message.startswith("tokenizer=words: the tokenizer (Vocabulary, 19 tokens)")
    assert "differs from the checkpoint's (SubwordTokenizer" in message
    assert "use the tokenizer the model was trained with: data.vocab_path=" in message


def test_a_bundle_whose_tokenizer_disagrees_with_the_model_is_one_line(bpe_run, tmp_path):
    import shutil

    from vitattn.bundle import load_bundle

    run, _ = bpe_run
    bundle = shutil.copytree(run / "bundle", tmp_path / "bundle")
    other = train_bpe(["a dog on the grass"] * 10, vocab_size=300)  # stops merging early: fewer tokens
    other.save(bundle / "tokenizer.json")
    with pytest.raises(ValueError) as err:
        load_bundle(bundle)
    message = str(err.value)
    assert "\n" not in message and f"the tokenizer has {len(other)} tokens but the decoder's vocab_size=" in message
    assert "use the tokenizer the model was trained with (its run's tokenizer.json)" in message


@pytest.mark.slow
def test_the_bpe_runs_bundle_and_onnx_folder_caption_as_the_run(bpe_caption_run, tmp_path):
    """A bpe captioner trained a little (the shared run): the run (its checkpoint), its bundle and its ONNX folder
    give the same captions, each decoded by the tokenizer it loaded from its own folder."""
    pytest.importorskip("onnxruntime")
    from vitattn import Captioner
    from vitattn.bundle import load_bundle
    from vitattn.bundle.onnx_export import export_onnx
    from vitattn.data.preprocess import normalize
    from vitattn.data.shapes import ShapesDataset

    run = bpe_caption_run
    onnx_dir = export_onnx(load_bundle(run / "bundle"), tmp_path / "onnx")
    assert (onnx_dir / "tokenizer.json").is_file() and load_tokenizer(onnx_dir / "tokenizer.json") == load_tokenizer(
        run / "tokenizer.json"
    )
    data = ShapesDataset("test", 16, img_size=32, seed=0, task="caption", transform=normalize())
    images = torch.stack([data[i]["image"] for i in range(len(data))])
    trained = load_checkpoint(run / "checkpoints" / "last.ckpt", "cpu")  # the last weights, the run's checkpoint
    with torch.inference_mode():
        expected = trained.vocab.decode_batch(trained.model.generate(images))
    assert any(expected)
    for source in (run, run / "bundle", onnx_dir):
        captioner = Captioner.load(source)
        assert isinstance(captioner.bundle.vocab, SubwordTokenizer)
        with torch.inference_mode():
            tokens = captioner.model.generate(images)
        assert captioner.bundle.vocab.decode_batch(tokens) == expected, source
