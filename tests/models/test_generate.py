"""The shared caption search (``vitattn.models.generate``) against its oracles (exhaustive search, a
Hugging Face-style beam search written out image by image, ``transformers``' own ``generate``), and the
tokens it never generates.

Dimension letters: B images (one random toy decoder each), K beams, R = B * K caption rows, t positions
so far, T' generated tokens, V vocabulary, P caption prefixes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from vitattn.models.generate import (
    Controls,
    SpecialIds,
    beam_search,
    check_early_stopping,
    greedy_search,
    sequence_log_prob,
)

IDS = SpecialIds(pad_id=0, bos_id=1, eos_id=2, unk_id=3)
WORDS = 4  # ordinary tokens, after the 4 special ones
V = 4 + WORDS
B = 300  # toy decoders, searched in one batch
EARLY_STOPPING = [False, True, "never"]


class ToyDecoders:
    """B random decoders over V tokens: image b's logits after a caption prefix are a row of a random table
    (``<eos>`` favoured by ``eos_bias``, so captions end at every length). Banned tokens get finite logits:
    the search must ban them itself.

    As a ``DecodeStep`` over R = B * K rows (the K beams of an image consecutive) it also checks the
    bookkeeping a key/value cache relies on: each call's rows are the previous call's, as ``reorder``
    left them, plus one token, and no row moves to another image.
    """

    def __init__(self, T: int, seed: int, num_beams: int = 1, eos_bias: float = 1.0, scale: float = 2.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.T, self.K = T, num_beams
        P = (V**T - 1) // (V - 1)  # prefixes of 0 .. T' - 1 generated tokens
        self.table = torch.randn(B, P, V, generator=g, dtype=torch.float64) * scale  # (B, P, V)
        self.table[:, :, IDS.eos_id] += eos_bias
        self.rows: torch.Tensor | None = None  # (R, t) the rows the next call must extend
        self._log_probs: list | None = None

    def logits(self, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (R, V) of images (R,) after ``tokens`` (R, t) (``<bos>`` first)."""
        generated = tokens[:, 1:]  # (R, t - 1)
        t = generated.shape[1]
        code = (V**t - 1) // (V - 1) + (generated * V ** torch.arange(t)).sum(1)  # (R,) prefix index
        return self.table[image, code]

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        R, t = tokens.shape
        if self.rows is not None:
            assert torch.equal(tokens[:, :-1], self.rows), "the rows are not the reordered rows of the last call"
        self.rows = tokens
        return self.logits(torch.arange(R) // self.K, tokens).float()

    def reorder(self, index: torch.Tensor) -> None:
        assert torch.equal(index // self.K, torch.arange(len(index)) // self.K), "a beam moved to another image"
        self.rows = self.rows.index_select(0, index)

    def log_probs(self, b: int, prefix: tuple[int, ...]) -> list[float]:
        """Image b's next-token log-probabilities (V,) after ``prefix`` (generated tokens); ``<pad>``, ``<bos>``
        and ``<unk>`` banned (-inf) before normalising, as the search bans them."""
        if self._log_probs is None:  # plain lists: the oracles below loop in Python
            masked = self.table.clone()
            masked[:, :, [IDS.pad_id, IDS.bos_id, IDS.unk_id]] = float("-inf")
            self._log_probs = masked.log_softmax(-1).tolist()  # (B, P, V)
        code = (V ** len(prefix) - 1) // (V - 1) + sum(token * V**j for j, token in enumerate(prefix))
        return self._log_probs[b][code]

    def score(self, b: int, caption: tuple[int, ...], length_penalty: float) -> float:
        """``log p / length ** length_penalty`` of a caption (``<eos>`` included, unless cut at T')."""
        total = sum(self.log_probs(b, caption[:i])[token] for i, token in enumerate(caption))
        return total / len(caption) ** length_penalty


def _caption(row: torch.Tensor) -> tuple[int, ...]:
    """A generated row without its padding (``<eos>`` kept)."""
    tokens = row.tolist()
    return tuple(tokens[: tokens.index(IDS.eos_id) + 1] if IDS.eos_id in tokens else tokens)


def _search(decoders: ToyDecoders, K: int, length_penalty: float, early_stopping) -> list[tuple[int, ...]]:
    decoders.K, decoders.rows = K, None
    out = beam_search(decoders, B, decoders.T, K, IDS, length_penalty, early_stopping)  # (B, T')
    assert out.shape[0] == B and out.shape[1] <= decoders.T
    return [_caption(row) for row in out]


def _exhaustive(decoders: ToyDecoders, b: int, length_penalty: float) -> tuple[float, tuple[int, ...]]:
    """Image b's best caption among all of them: words then ``<eos>``, or T' words (cut at the limit)."""
    words = [i for i in range(V) if i not in IDS]
    captions = [
        (*prefix, IDS.eos_id) for t in range(decoders.T) for prefix in itertools.product(words, repeat=t)
    ] + list(itertools.product(words, repeat=decoders.T))
    return max((decoders.score(b, c, length_penalty), c) for c in captions)


def _hf_style_beam_search(
    decoders: ToyDecoders, b: int, K: int, length_penalty: float, early_stopping
) -> list[tuple[float, tuple[int, ...]]]:
    """Image b's K finished hypotheses (score, caption), best first, of a beam search as Hugging Face's
    ``_beam_search`` (transformers 4.50+; the ``BeamHypotheses`` rules), written out with lists: the 2K best
    extensions of the K live beams; of the first K of them, those ending in ``<eos>`` (all of them at the last
    step) join the finished hypotheses, scored
    ``log p / length ** length_penalty`` with length the tokens generated, of which the K best are kept;
    the K best that do not end live on. Once K have finished, the image is done when ``early_stopping`` is
    True, or when the best live beam scored at its current length (False) or at the longest length
    (``"never"``, length_penalty > 0) does not beat the worst finished one."""
    T = decoders.T
    live: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]  # (log p, generated tokens)
    finished: list[tuple[float, tuple[int, ...]]] = []  # (score, generated tokens), best first
    for i in range(T):
        extensions = [
            (s + lp, p + (token,))
            for s, p in live
            for token, lp in enumerate(decoders.log_probs(b, p))
            if lp > float("-inf")
        ]
        candidates = sorted(extensions, key=lambda c: -c[0])[: 2 * K]
        for s, p in candidates[:K]:
            if p[-1] == IDS.eos_id or i == T - 1:
                finished.append((s / len(p) ** length_penalty, p))
        finished = sorted(finished, key=lambda h: -h[0])[:K]
        live = [c for c in candidates if c[1][-1] != IDS.eos_id][:K]
        if len(finished) == K:
            if early_stopping is True:
                break
            longest = T if early_stopping == "never" and length_penalty > 0 else i + 1
            if live[0][0] / longest**length_penalty <= finished[-1][0]:
                break
    return finished


@pytest.mark.parametrize("early_stopping", EARLY_STOPPING)
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0, -1.0])
def test_a_beam_wider_than_every_caption_equals_exhaustive_search(length_penalty, early_stopping):
    """T' = 3 over 4 words: 1 + 4 + 16 + 64 = 85 captions, so 86 beams can never drop one."""
    decoders = ToyDecoders(T=3, seed=0)
    got = _search(decoders, 86, length_penalty, early_stopping)
    lengths = set()
    for b in range(B):
        best_score, best = _exhaustive(decoders, b, length_penalty)
        assert got[b] == best, (b, got[b], best)
        lengths.add(len(best))
    assert lengths == {1, 2, 3}  # the best captions end at every step, and some are cut at T'


@pytest.mark.parametrize("early_stopping", EARLY_STOPPING)
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_three_beams_score_as_a_hugging_face_style_search(length_penalty, early_stopping):
    """On 300 toy decoders of T' = 4, K = 3: never a worse caption than the reference (the issue's
    claim), and in fact the reference's own caption every time."""
    decoders = ToyDecoders(T=4, seed=1)
    got = _search(decoders, 3, length_penalty, early_stopping)
    for b in range(B):
        ref_score, ref = _hf_style_beam_search(decoders, b, 3, length_penalty, early_stopping)[0]
        assert decoders.score(b, got[b], length_penalty) >= ref_score - 1e-9, (b, got[b], ref)
        assert got[b] == ref, (b, got[b], ref)


@pytest.mark.parametrize("early_stopping", EARLY_STOPPING)
@pytest.mark.parametrize("R", [1, 2, 4])
def test_num_return_sequences_are_the_best_finished_hypotheses_in_order(R, early_stopping):
    """K = 4 beams return each image's R best finished captions, best first, an image's R consecutive."""
    decoders = ToyDecoders(T=4, seed=2)
    decoders.K = 4
    out = beam_search(decoders, B, 4, 4, IDS, 1.0, early_stopping, num_return_sequences=R)  # (B * R, T')
    assert out.shape[0] == B * R
    got = [_caption(row) for row in out]
    for b in range(B):
        expected = [caption for _, caption in _hf_style_beam_search(decoders, b, 4, 1.0, early_stopping)[:R]]
        assert got[b * R : (b + 1) * R] == expected, b


def test_num_return_sequences_give_transformers_generate_captions():
    decoders = ToyDecoders(T=4, seed=4)
    model = _hf_toy_model(decoders, 4)
    with torch.no_grad():
        hf = model.generate(
            torch.full((B, 1), IDS.bos_id),
            num_beams=4,
            num_return_sequences=3,
            max_new_tokens=4,
            do_sample=False,
            use_cache=False,
        )
    decoders.K = 4
    got = beam_search(decoders, B, 4, 4, IDS, num_return_sequences=3)
    assert [_caption(row) for row in got] == [_caption(row) for row in hf[:, 1:]]
    assert len({_caption(row) for row in got[:3]}) == 3  # an image's three are three captions


@pytest.mark.parametrize("R", [0, 5])
def test_num_return_sequences_beyond_the_beams_are_refused_in_one_line(R):
    with pytest.raises(ValueError, match=f"^num_return_sequences={R} must be between 1 and num_beams=4$"):
        beam_search(ToyDecoders(T=2, seed=0, num_beams=4), B, 2, 4, IDS, num_return_sequences=R)


def test_early_stopping_settings_change_captions_as_they_should():
    """The three settings are not one: on these decoders some captions differ between them, and ``never``
    (the last to stop taking finished captions; the live beams are the same) never scores below the others."""
    decoders = ToyDecoders(T=4, seed=2, eos_bias=0.0)
    got = {mode: _search(decoders, 2, 2.0, mode) for mode in EARLY_STOPPING}
    scores = {mode: [decoders.score(b, c, 2.0) for b, c in enumerate(caps)] for mode, caps in got.items()}
    assert got[True] != got[False] != got["never"]
    for mode in (True, False):
        assert all(n >= s - 1e-9 for n, s in zip(scores["never"], scores[mode]))


def test_early_stopping_reads_hugging_faces_values_and_a_command_lines():
    assert [check_early_stopping(v) for v in (True, False, "never", "true", "False", "NEVER")] == [
        True,
        False,
        "never",
        True,
        False,
        "never",
    ]
    for bad in ("sometimes", 1, None, 0.5):
        with pytest.raises(ValueError, match="must be true, false or never"):
            check_early_stopping(bad)


@pytest.mark.parametrize("early_stopping", EARLY_STOPPING)
def test_beam_search_reads_the_device_once_a_step_for_the_stop_decision(early_stopping):
    """No ``.item()``, ``bool()`` or ``nonzero`` per step (each a host sync on a GPU) but the stop decision:
    T' - 1 of them when no caption can end, and three for the final trim (``_trim``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    syncing = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.equal.default}

    class CountSyncs(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in syncing
            return func(*args, **(kwargs or {}))

    logits = torch.randn(2 * 3, V)

    class Step:
        def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
            return logits.clone()

        def reorder(self, index: torch.Tensor) -> None:
            pass

    never_ends = SpecialIds(IDS.pad_id, IDS.bos_id, V, IDS.unk_id)  # an <eos> id no logit has
    with CountSyncs() as mode:
        out = beam_search(Step(), 2, 6, 3, never_ends, early_stopping=early_stopping)
    assert out.shape == (2, 6) and mode.count == (6 - 1) + 3


def _hf_toy_model(decoders: ToyDecoders, K: int):
    """``decoders`` as a ``transformers`` decoder-only model: rows b * K .. b * K + K - 1 are image b's (as
    ``generate`` expands its inputs), the banned tokens' logits -inf (Hugging Face's ``suppress_tokens``
    masks log-probabilities after normalising, our search logits before)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutput

    class ToyConfig(transformers.PretrainedConfig):
        model_type = "vitattn_toy_decoders"

    class ToyLM(transformers.PreTrainedModel, transformers.GenerationMixin):
        config_class = ToyConfig

        def __init__(self, config: ToyConfig) -> None:
            super().__init__(config)
            self.unused = torch.nn.Parameter(torch.zeros(1))  # a model needs a parameter (device, dtype)

        def forward(self, input_ids: torch.Tensor, **kwargs) -> CausalLMOutput:
            logits = decoders.logits(torch.arange(len(input_ids)) // K, input_ids).float()  # (R, V)
            logits[:, [IDS.pad_id, IDS.bos_id, IDS.unk_id]] = float("-inf")
            return CausalLMOutput(logits=logits[:, None].expand(-1, input_ids.shape[1], -1))

    ids = dict(bos_token_id=IDS.bos_id, eos_token_id=IDS.eos_id, pad_token_id=IDS.pad_id)
    model = ToyLM(ToyConfig(vocab_size=V, **ids)).eval()
    model.generation_config = transformers.GenerationConfig(**ids)
    return model


@pytest.mark.parametrize("early_stopping", EARLY_STOPPING)
@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
def test_three_beams_give_transformers_generate_captions(length_penalty, early_stopping):
    decoders = ToyDecoders(T=4, seed=3)
    model = _hf_toy_model(decoders, 3)
    bos = torch.full((B, 1), IDS.bos_id)
    with torch.no_grad():
        hf = model.generate(
            bos,
            num_beams=3,
            max_new_tokens=4,
            do_sample=False,
            use_cache=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
    expected = [_caption(row) for row in hf[:, 1:]]  # Hugging Face pads with <eos> when pad_token_id is 0
    assert _search(decoders, 3, length_penalty, early_stopping) == expected


CONTROLS = {
    "min-new-tokens": Controls(min_new_tokens=3),
    "no-repeat-bigrams": Controls(no_repeat_ngram_size=2),
    "repetition-penalty": Controls(repetition_penalty=1.8),
    "repetition-bonus": Controls(repetition_penalty=0.6),
    "all-three": Controls(2, 2, 1.3),
}


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("name", list(CONTROLS))
def test_decoding_controls_give_transformers_generate_captions_and_scores(name, num_beams):
    controls, K = CONTROLS[name], num_beams
    decoders = ToyDecoders(T=4, seed=5, num_beams=K, eos_bias=2.0)
    model = _hf_toy_model(decoders, K)
    with torch.no_grad():
        hf = model.generate(
            torch.full((B, 1), IDS.bos_id),
            num_beams=K,
            max_new_tokens=4,
            do_sample=False,
            use_cache=False,
            **controls._asdict(),
            output_scores=True,
            return_dict_in_generate=True,
        )

    def search(controls: Controls) -> list[tuple[int, ...]]:
        decoders.rows = None
        if K > 1:
            return [_caption(row) for row in beam_search(decoders, B, 4, K, IDS, controls=controls)]
        return [_caption(row) for row in greedy_search(decoders, B, 4, IDS, controls=controls)]

    expected = [_caption(row) for row in hf.sequences[:, 1:]]
    assert search(controls) == expected
    assert search(Controls()) != expected  # the controls change captions
    if K > 1:  # the score of each returned caption is the one the search ranked it by (length penalty 1)
        decoders.K, decoders.rows = 1, None
        rows = torch.nn.utils.rnn.pad_sequence([torch.tensor(c) for c in expected], batch_first=True)
        scored = sequence_log_prob(decoders, rows, IDS, controls) / torch.tensor([len(c) for c in expected])
        torch.testing.assert_close(scored, hf.sequences_scores, rtol=0, atol=1e-5)


def test_three_beams_give_transformers_generate_captions_on_a_tiny_gpt2():
    """A randomly initialised 2-layer GPT-2 (``<pad>``, ``<bos>`` and ``<unk>`` logits masked in its forward,
    ``<eos>`` favoured): ``generate(num_beams=3)`` with its own key/value cache, and our search recomputing
    each step. 16 prompts of ``<bos>`` and a word stand for 16 images."""
    transformers = pytest.importorskip("transformers")

    class MaskedGPT2(transformers.GPT2LMHeadModel):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits[..., [IDS.pad_id, IDS.bos_id, IDS.unk_id]] = float("-inf")
            out.logits[..., IDS.eos_id] += 2.0  # captions of several lengths
            return out

    ids = dict(bos_token_id=IDS.bos_id, eos_token_id=IDS.eos_id, pad_token_id=IDS.pad_id)
    sizes = dict(vocab_size=40, n_positions=16, n_embd=32, n_layer=2, n_head=2, initializer_range=0.2)
    model = MaskedGPT2(transformers.GPT2Config(**sizes, **ids)).eval()
    prompts = torch.cat([torch.full((16, 1), IDS.bos_id), torch.randint(4, 40, (16, 1))], dim=1)  # (B, 2)
    rows = prompts.repeat_interleave(3, dim=0)  # (R, 2) each image's prompt for its K = 3 beams

    class Step:  # (R, t) -> (R, V): the image's prompt in place of <bos>, the whole caption recomputed
        def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
            return model(torch.cat([rows, tokens[:, 1:]], dim=1)).logits[:, -1]

        def reorder(self, index: torch.Tensor) -> None:  # a beam never leaves its image: rows stay right
            pass

    with torch.no_grad():
        ours = beam_search(Step(), 16, 8, 3, IDS, length_penalty=1.0)
        hf = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), num_beams=3, max_new_tokens=8, do_sample=False
        )
    expected = [_caption(row) for row in hf[:, 2:]]
    assert [_caption(row) for row in ours] == expected
    assert len({len(c) for c in expected}) > 2  # captions of several lengths


def test_no_caption_holds_unk_even_when_the_decoder_prefers_it():
    decoders = ToyDecoders(T=4, seed=4)
    decoders.table[:, :, IDS.unk_id] += 10.0  # <unk> is by far the likeliest token everywhere
    for K in (1, 3):
        assert not any(IDS.unk_id in c for c in _search(decoders, K, 1.0, False))
    no_unk = SpecialIds(IDS.pad_id, IDS.bos_id, IDS.eos_id)  # a vocabulary without one: id 3 is a word
    decoders.K, decoders.rows = 1, None
    assert (beam_search(decoders, B, 4, 1, no_unk) == IDS.unk_id).any()


def _unk_loving_bundle(folder):
    """A tiny random captioner whose output layer favours ``<unk>`` by far, saved as a bundle."""
    from tests.helpers.bundles import CAPTION_PREPROCESS, CAPTION_WORDS
    from vitattn.bundle import save_bundle
    from vitattn.data.tokenizer import Vocabulary
    from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer

    vocab = Vocabulary(CAPTION_WORDS)
    decoder = CaptionDecoder(len(vocab), embed_dim=32, depth=1, num_heads=2, max_len=8, tie_embeddings=False)
    with torch.no_grad():
        decoder.head.bias[vocab.unk_id] = 20.0
        decoder.head.bias[vocab.eos_id] = 1.0  # after <unk>, <eos> is likely: beams finish at several steps
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    model = ImageCaptioner(encoder, decoder).eval()
    return save_bundle(folder, model, task="caption", preprocess=CAPTION_PREPROCESS, vocab=vocab)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_decoder_that_prefers_unk_never_generates_it_eager_or_onnx(tmp_path, num_beams):
    """The ban is in the one shared search: PyTorch and ONNX Runtime give the same captions, without
    ``<unk>``; an ONNX folder without ``unk_id`` in ``onnx.json`` is refused in one line."""
    pytest.importorskip("onnxruntime", reason="the onnx extra: pip install -e '.[onnx]'")
    import json

    from vitattn.bundle import load_bundle, load_model
    from vitattn.bundle.onnx_export import export_onnx

    bundle = load_bundle(_unk_loving_bundle(tmp_path / "bundle"))
    unk = bundle.vocab.unk_id
    images = torch.randn(6, 3, 32, 32)
    with torch.no_grad():
        eager = bundle.model.generate(images, num_beams=num_beams)
        bundle.model.decoder.unk_id = None  # the ban lifted: <unk> is what this decoder says
        assert (bundle.model.generate(images, num_beams=num_beams) == unk).any()
        bundle.model.decoder.unk_id = unk
    assert not (eager == unk).any()
    onnx_dir = export_onnx(bundle, tmp_path / "onnx")
    config = json.loads((onnx_dir / "onnx.json").read_text())
    assert config["decoder"]["unk_id"] == unk
    torch.testing.assert_close(load_model(onnx_dir).model.generate(images, num_beams=num_beams), eager)
    del config["decoder"]["unk_id"]  # as an ONNX folder of an earlier vitattn: refused, not guessed
    (onnx_dir / "onnx.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="decoder has no unk_id; export it again"):
        load_model(onnx_dir)


def test_a_bundle_saved_before_unk_id_bans_its_vocabularys_unk(tmp_path):
    """A decoder config without ``unk_id`` (bundles of an earlier vitattn, all word-level) gets
    ``Vocabulary``'s, as its ``pad_id``, ``bos_id`` and ``eos_id`` defaults are."""
    import json

    from vitattn.bundle import load_bundle

    folder = _unk_loving_bundle(tmp_path / "bundle")
    config = json.loads((folder / "config.json").read_text())
    del config["model"]["decoder"]["unk_id"]
    (folder / "config.json").write_text(json.dumps(config))
    bundle = load_bundle(folder)
    assert bundle.model.special_ids.unk_id == bundle.vocab.unk_id
    with torch.no_grad():
        assert not (bundle.model.generate(torch.randn(4, 3, 32, 32), num_beams=2) == bundle.vocab.unk_id).any()
