"""Token merging (ToMe) in the document's layers: the matching, size-weighted merges, proportional attention, and
the exact case: merging tokens that are identical changes nothing, in the encoder, the caption decoder's
cross-attention, the pooled features and the attention maps. By the definition, in PyTorch alone: a memory with
sizes is its tokens repeated ``size`` times, unmerged, in the encoder layer, the decoder's cross-attention and its
cache; gradient checkpointing merges as without it."""

import pytest
import torch

from vitattn.inference.attention_maps import attention_from_tokens, attention_rollout
from vitattn.layers import DecoderLayer, EncoderLayer, Memory, MultiHeadAttention, merge_schedule
from vitattn.layers.merge import bipartite_soft_matching, most_merged, spread
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer
from vitattn.models.caption import DecoderStep
from vitattn.models.generate import token_log_probs

TINY = dict(img_size=32, patch_size=4, embed_dim=32, depth=3, num_heads=2, mlp_ratio=2.0)


def test_matching_merges_the_most_similar_pairs_never_the_class_token_and_weights_by_size():
    # 7 tokens: A = 0 (class), 2, 4, 6; B = 1, 3, 5. Token 4 is 3's twin, 6 nearly 5's, 2 unlike all.
    metric = torch.tensor([[[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0], [1, 1, 0.01], [0, 1, 1], [0, 1, 0.9]]])
    metric[0, 0] = metric[0, 3]  # the class token is 3's twin too, and still never merged
    match = bipartite_soft_matching(metric.float(), 2)
    assert match.kept.tolist() == [[0, 1]]  # A positions 0 (class) and 1 (token 2), in order
    assert match.src.tolist() == [[2, 3]] and match.dst.tolist() == [[1, 2]]  # 4 -> 3, 6 -> 5
    x = torch.arange(7.0).view(1, 7, 1) * 10  # token i's value 10 i
    size = torch.tensor([[1.0, 1, 1, 3, 1, 1, 1]])  # token 3 already holds 3 tokens
    merged, sizes, _, _ = match.merge_tokens(Memory(x, size))
    assert sizes.tolist() == [[1, 1, 1, 4, 2]]  # class, 2, then B: 1, 3 (+4), 5 (+6)
    assert merged[0, :, 0].tolist() == pytest.approx([0, 20, 10, (3 * 30 + 40) / 4, 55])


def test_proportional_attention_is_attention_over_each_tokens_copies():
    """A key of size s weighs as s copies of it, on the document's explicit path and the fused one."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)
    size = torch.tensor([[1.0, 3, 1, 2], [2, 1, 1, 1]])
    copies = [torch.cat([t[b].repeat_interleave(size[b].long(), dim=1)[None]]) for b in range(2) for t in (k, v)]
    mha = MultiHeadAttention(16, 2).eval()
    for explicit in (True, False):
        got = mha.attend(q, k, v, need_weights=explicit, size=size)[0]
        for b in range(2):
            expected = mha.attend(q[b : b + 1], copies[2 * b], copies[2 * b + 1])[0]
            torch.testing.assert_close(got[b : b + 1], expected, atol=1e-5, rtol=1e-5)


def test_the_fused_path_adds_the_explicit_paths_log_size_rounded_once(monkeypatch):
    """In bf16 the fused kernel takes its bias in q's dtype: the fp32 log of the explicit path (and ONNX), rounded
    once, not the log of a size first rounded to bf16 (above 256 not every count is a bf16 number)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, length, 8, dtype=torch.bfloat16) for length in (3, 256, 256))
    size = torch.arange(1.0, 1025).view(4, 256)  # (B, Lk)
    biases, kernel = [], torch.nn.functional.scaled_dot_product_attention
    spy = lambda *a, attn_mask, **kw: biases.append(attn_mask) or kernel(*a, attn_mask=attn_mask, **kw)  # noqa: E731
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    mha = MultiHeadAttention(16, 2).bfloat16().eval()
    fused = mha.attend(q, k, v, size=size)[0]
    torch.testing.assert_close(biases[0], size.log().bfloat16()[:, None, None, :], rtol=0, atol=0)
    explicit = mha.attend(q, k, v, need_weights=True, size=size)[0]
    torch.testing.assert_close(fused.float(), explicit.float(), rtol=0, atol=1e-2)


def test_the_merging_path_at_r_0_is_the_document_layer_bit_for_bit():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 16)
    for norm_first in (False, True):
        layer = EncoderLayer(16, 2, 32, norm_first=norm_first).eval()
        assert torch.equal(layer(Memory(x), r=0).tokens, layer(x))
        assert torch.equal(layer(Memory(x, torch.ones(2, 9)), r=0).tokens, layer(x))  # proportional, unit sizes


@pytest.mark.parametrize("sizes", [False, True])
def test_a_layer_merging_one_pair_leaves_one_token_fewer_holding_them_all(sizes):
    """r = 1 (a schedule's first layer, unmerged, or a later one) merges exactly one pair: 9 tokens in, 8 out,
    sizes summing to the 9 inputs, one of them 2."""
    torch.manual_seed(0)
    layer = EncoderLayer(16, 2, 32).eval()
    out = layer(Memory(torch.randn(2, 9, 16), torch.ones(2, 9) if sizes else None), r=1)
    assert out.tokens.shape == (2, 8, 16)
    assert sorted(out.sizes[0].tolist()) == [1.0] * 7 + [2.0] and out.sizes.sum().item() == 18


def test_merge_tokens_0_is_the_unmerged_encoder_bit_for_bit():
    torch.manual_seed(0)
    images = torch.randn(2, 3, 32, 32)
    off = VisionTransformer(**TINY, num_classes=4, global_pool="mean").eval()
    merged = VisionTransformer(**TINY, num_classes=4, global_pool="mean", merge_tokens=5).eval()
    merged.load_state_dict(off.state_dict())
    expected = off.norm(
        off.blocks(torch.cat([off.cls_token.expand(2, -1, -1), off.patch_embed(images)], 1) + off.pos_embed)
    )
    assert torch.equal(off.forward_features(images), expected)
    assert merged.forward_features(images).shape == (2, 65 - 15, 32)
    merged.set_merge_tokens(0)
    assert torch.equal(merged(images), off(images)) and merged.config["merge_tokens"] == 0


def test_a_schedule_too_large_for_the_tokens_is_refused_naming_the_largest():
    assert merge_schedule(16, 197, 12) == [16] * 11 + [10]  # ToMe's constant R: the last layer merges what it can
    with pytest.raises(ValueError, match=r"^merge_tokens=99 is too large for 197 tokens: at most 98$"):
        merge_schedule(99, 197, 12)
    with pytest.raises(ValueError, match=r"merge_tokens\[1\]=40 is out of range .* 0 to 39$"):
        merge_schedule([20, 40, 0], 99, 3)
    with pytest.raises(ValueError, match="has 2 entries; the encoder has 3 layers"):
        merge_schedule([1, 1], 99, 3)
    with pytest.raises(ValueError, match="at most 32"):
        VisionTransformer(**TINY, merge_tokens=33)


def test_the_schedule_bounds_are_inclusive_and_the_class_token_never_counts():
    """A layer merges at most its A tokens (every even one) less the class token: 8 of 17 tokens, 24 of 50; both
    bounds are allowed, one past either is refused in one line."""
    for tokens in (17, 50, 197):
        assert most_merged(tokens) == len(range(0, tokens, 2)) - 1
    assert merge_schedule(8, 17, 3) == [8, 4, 2]  # capped deep in the stack: 17 -> 9 -> 5 tokens
    assert merge_schedule(8, 17, 1) == [8] and merge_schedule(0, 17, 2) == [0, 0]
    assert merge_schedule([0, 2], 17, 2) == [0, 2] and merge_schedule([8, 4], 17, 2) == [8, 4]
    with pytest.raises(ValueError, match=r"^merge_tokens=25 is too large for 50 tokens: at most 24$"):
        merge_schedule(25, 50, 1)
    with pytest.raises(ValueError, match=r"^merge_tokens=-1 must be at least 0"):
        merge_schedule(-1, 17, 2)
    with pytest.raises(ValueError, match=r"^merge_tokens\[0\]=-1 is out of range"):
        merge_schedule([-1, 0], 17, 2)
    with pytest.raises(ValueError, match=r"^merge_tokens\[1\]=5 is out of range .* 0 to 4$"):
        merge_schedule([8, 5], 17, 2)


def test_matching_is_by_cosine_over_channels_whatever_the_norms():
    """Each A token's match is its B token of the highest cosine (over the channels, not the raw product), and the
    r A tokens of the highest such cosines merge, by a hand-written loop in float64 on keys of very unequal norms."""
    generator = torch.Generator().manual_seed(0)
    metric = torch.randn(2, 11, 4, generator=generator, dtype=torch.float64)
    metric = metric * torch.randn(2, 11, 1, generator=generator, dtype=torch.float64).mul(2).exp()  # norms 1e-2..1e2
    r = 3
    match = bipartite_soft_matching(metric, r)

    def cos(u: list[float], v: list[float]) -> float:
        return sum(p * q for p, q in zip(u, v)) / (sum(p * p for p in u) * sum(q * q for q in v)) ** 0.5

    for b, x in enumerate(metric.tolist()):
        best = {i: max(range(5), key=lambda j: cos(x[2 * i], x[2 * j + 1])) for i in range(1, 6)}
        score = {i: cos(x[2 * i], x[2 * best[i] + 1]) for i in best}
        merged = sorted(best, key=score.get, reverse=True)[:r]
        assert match.src[b].tolist() == merged
        assert match.dst[b].tolist() == [best[i] for i in merged]
        assert match.kept[b].tolist() == [0, *sorted(set(best) - set(merged))]


def test_tied_tokens_merge_in_their_order():
    """Identical patches tie every A token's best score: the first r A tokens (after the class token) merge, on a
    stack of 65 tokens (33 A tokens: CPU's unstable sort reorders ties of 17 or more)."""
    metric = torch.ones(1, 65, 8)
    metric[0, 0] = -1  # the class token, unlike the rest
    match = bipartite_soft_matching(metric, 20)
    assert match.src.tolist() == [list(range(1, 21))]
    assert match.kept.tolist() == [[0, *range(21, 33)]]


def test_a_memory_detached_or_indexed_keeps_each_part_and_none():
    """``detach`` keeps every part's values, without a gradient; ``index_select`` picks rows (beam search over a
    merged memory) of tokens, sizes and sources alike; a part that is None stays None."""
    tokens = torch.arange(24.0).view(3, 2, 4).requires_grad_()
    sizes, sources = torch.tensor([[1.0, 2], [3, 1], [1, 1]]), torch.arange(18).view(3, 2, 3)
    detached = Memory(tokens * 1, sizes).detach()
    assert not detached.tokens.requires_grad and detached.sources is None
    assert detached.tokens.tolist() == tokens.tolist() and detached.sizes.tolist() == sizes.tolist()
    rows = [2, 0, 0]
    picked = Memory(tokens.detach(), sizes, sources).index_select(torch.tensor(rows))
    for got, part in zip(picked, (tokens, sizes, sources)):
        assert got.tolist() == [part.tolist()[i] for i in rows]
    assert Memory(tokens.detach()).index_select(torch.tensor(rows)).sizes is None


def _twin_captioner(merge_tokens: int) -> ImageCaptioner:
    torch.manual_seed(0)
    encoder = VisionTransformer(**TINY, global_pool="mean", merge_tokens=merge_tokens)
    with torch.no_grad():
        encoder.pos_embed.zero_()  # no positions: patches of one colour are identical tokens throughout
    decoder = CaptionDecoder(13, embed_dim=24, depth=2, num_heads=2, max_len=8, memory_dim=32)
    return ImageCaptioner(encoder, decoder).eval()


def _twin_images() -> torch.Tensor:
    """Two images of 8 x 8 patches in two colours each: every token has identical twins."""
    images = torch.zeros(2, 3, 32, 32)
    images[0, 0, :16], images[0, 1, 16:] = 1.0, -1.0
    images[1, 2, :, :12], images[1, 0, :, 12:] = 2.0, 0.5
    return images


def test_merging_identical_tokens_changes_neither_logits_pooled_features_nor_attention_maps():
    """The exact case: with proportional attention a merged token is its parts, in the encoder and in the
    decoder's cross-attention; maps spread back over the patches equal the unmerged model's (remove the log
    size from either attention, or the spreading, and this fails)."""
    plain, merged = _twin_captioner(0), _twin_captioner(6)
    merged.load_state_dict(plain.state_dict())
    images, tokens = _twin_images(), torch.randint(4, 13, (2, 5))
    memory = merged.encode(images)
    assert memory.tokens.shape[1] == 65 - 18 and memory.sizes.sum(1).tolist() == [65, 65]
    torch.testing.assert_close(merged(images, tokens), plain(images, tokens), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(merged.encoder(images), plain.encoder(images), atol=1e-4, rtol=1e-4)
    maps = zip(attention_from_tokens(merged, images, tokens), attention_from_tokens(plain, images, tokens))
    for got, expected in maps:  # per-word cross-attention, rollout
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    cached = merged.generate(images, max_new_tokens=6, num_beams=3)
    torch.testing.assert_close(cached, plain.generate(images, max_new_tokens=6, num_beams=3))
    torch.testing.assert_close(merged.generate(images, max_new_tokens=6, num_beams=3, use_cache=False), cached)


def test_merged_tokens_hold_every_patch_once_and_the_class_token_stays_first():
    model = _twin_captioner(0).encoder
    model.set_merge_tokens([10, 8, 6])
    with torch.no_grad():
        model.pos_embed.normal_()  # distinct tokens: real matching
    trace: list[Memory] = []
    x, sizes, sources, _ = model.forward_tokens(torch.randn(3, 3, 32, 32), trace)
    assert [t.sources.shape[1] for t in trace] == [65, 55, 47, 41] and x.shape[1] == 41
    assert torch.equal(sources.sum(1), torch.ones(3, 65))  # a partition of the input tokens
    assert torch.equal(sources.sum(2), sizes)
    assert sources[:, 0, 0].tolist() == [1, 1, 1] and sizes[:, 0].tolist() == [1, 1, 1]


def test_spread_and_rollout_follow_a_hand_built_merge():
    """Class token, patches p1..p3; layer 0 merges p2 into p3 (token m of size 2), layer 1 merges nothing."""
    source0 = torch.eye(4)[None]
    source1 = torch.tensor([[[1.0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 1]]])
    size1 = torch.tensor([[1.0, 1, 2]])
    tokens0, tokens1 = torch.zeros(1, 4, 2), torch.zeros(1, 3, 2)  # not read: the rollout follows sizes and sources
    merged = Memory(tokens1, size1, source1)
    trace = [Memory(tokens0, torch.ones(1, 4), source0), merged, merged]
    # cross-attention of one word over (class, p1, m): m's 0.6 shared by p2 and p3
    assert spread(torch.tensor([[[0.1, 0.3, 0.6]]]), trace[-1])[0, 0].tolist() == pytest.approx([0.1, 0.3, 0.3, 0.3])
    w0 = torch.softmax(torch.randn(1, 1, 4, 4), -1)
    w1 = torch.softmax(torch.randn(1, 1, 3, 3), -1)
    a0 = (w0[0, 0] + torch.eye(4)) / 2
    a1 = (w1[0, 0] + torch.eye(3)) / 2
    rows = torch.stack([a0[0], a0[1], (a0[2] + a0[3]) / 2])  # m's row: the mean of its parts' rows
    cls = (a1 @ rows)[0, 1:]
    expected = cls / cls.sum()
    torch.testing.assert_close(attention_rollout([w0, w1], 1, trace)[0], expected)


SIZES = torch.tensor([[1.0, 3, 1, 2, 4], [2, 1, 5, 1, 1]])  # (B, N): each row holds 11 and 10 input tokens


def _repeated(tokens: torch.Tensor, b: int) -> torch.Tensor:
    """Row ``b`` of (B, N, D) ``tokens`` unmerged: each token ``SIZES[b, n]`` times, (1, sizes, D)."""
    return tokens[b].repeat_interleave(SIZES[b].long(), dim=0)[None]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_an_encoder_layer_over_sized_tokens_is_the_layer_over_their_copies(norm_first, fused):
    torch.manual_seed(0)
    layer = EncoderLayer(16, 2, 32, norm_first=norm_first, fused_attn=fused).eval()
    x = torch.randn(2, 5, 16)
    got = layer(Memory(x, SIZES), r=0)
    first = SIZES.long().cumsum(1) - SIZES.long()  # (B, N): each token's first copy
    for b in range(2):
        copies = layer(_repeated(x, b))  # (1, sizes, D): every copy of a token gives the same output
        torch.testing.assert_close(got.tokens[b], copies[0, first[b]], atol=1e-5, rtol=1e-5)
    assert torch.equal(got.sizes, SIZES)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_a_decoder_layers_cross_attention_over_sized_tokens_is_over_their_copies(norm_first, fused):
    """One caption per image, and three per image reading the image's one row of memory (the beams' path)."""
    torch.manual_seed(0)
    layer = DecoderLayer(16, 2, 32, norm_first=norm_first, fused_attn=fused).eval()
    memory, x = torch.randn(2, 5, 16), torch.randn(6, 4, 16)
    for captions in (x[:2], x):  # (B, T, D), B = 2 images x K captions each, K = 1 and 3
        K = len(captions) // 2
        got = layer(captions, Memory(memory, SIZES))
        for b in range(2):
            rows = slice(b * K, (b + 1) * K)
            expected = layer(captions[rows], Memory(_repeated(memory, b)))
            torch.testing.assert_close(got[rows], expected, atol=1e-5, rtol=1e-5)


def _step_log_probs(decoder: CaptionDecoder, memory: Memory, tokens: torch.Tensor, cache: bool) -> torch.Tensor:
    """(R, T - 1) log-probabilities of each caption token, one decoding step at a time (a fresh cache or none)."""
    return token_log_probs(
        DecoderStep(decoder, memory, decoder.new_cache(tokens.shape[1]) if cache else None), tokens, 0
    )


@pytest.mark.parametrize("K", [1, 3])
def test_cached_decoding_over_sized_tokens_gives_the_step_log_probabilities_over_their_copies(K):
    """Every step's log-probabilities, not only the tokens a search would pick: a cache that kept no sizes after
    its first step, or a cross-attention without them, changes them. K captions per image read its one row."""
    torch.manual_seed(0)
    decoder = CaptionDecoder(13, embed_dim=16, depth=2, num_heads=2, max_len=8, drop_rate=0.0).eval()
    memory = torch.randn(2, 5, 16)
    tokens = torch.cat([torch.ones(2 * K, 1, dtype=torch.long), torch.randint(4, 13, (2 * K, 6))], 1)  # <bos> ...
    with torch.no_grad():
        got = _step_log_probs(decoder, Memory(memory, SIZES), tokens, cache=True)  # (2K, 6)
        for b in range(2):
            rows = slice(b * K, (b + 1) * K)
            expected = _step_log_probs(decoder, Memory(_repeated(memory, b)), tokens[rows], cache=False)
            torch.testing.assert_close(got[rows], expected, atol=1e-5, rtol=1e-5)
        unsized = _step_log_probs(decoder, Memory(memory), tokens, cache=True)
    assert (got - unsized).abs().max() > 1e-2  # the sizes matter here


def test_grad_checkpointing_merges_as_without_it_outputs_and_gradients():
    """A captioner whose encoder merges tokens, in training mode: with checkpointing, each recomputed layer
    merges the same tokens and the decoder reads their sizes, so logits and every gradient are the same."""
    torch.manual_seed(0)
    encoder = VisionTransformer(**TINY, global_pool="mean", merge_tokens=8)
    plain = ImageCaptioner(encoder, CaptionDecoder(13, embed_dim=24, depth=2, num_heads=2, max_len=8, memory_dim=32))
    checkpointed = ImageCaptioner.from_config(plain.config)
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.set_grad_checkpointing()
    images, tokens = torch.randn(2, 3, 32, 32), torch.randint(4, 13, (2, 6))
    grads = []
    for model in (plain.train(), checkpointed.train()):
        for module in model.modules():  # no dropout: the two passes must agree without replaying random masks
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        logits = model(images, tokens)
        logits.square().mean().backward()
        grads.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (expected, expected_grads), (got, got_grads) = grads
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
