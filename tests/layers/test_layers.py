import contextlib
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

from tests.layers import seed_reference as seed
from vitattn.layers import (
    DecoderLayer,
    EncoderLayer,
    LayerCache,
    Memory,
    MultiHeadAttention,
    point_wise_feed_forward_network,
    record_attention,
    scaled_dot_product_attention,
)

B, L, D, H = 2, 7, 32, 4


def _keras(linear: nn.Linear) -> tuple[np.ndarray, np.ndarray]:
    """A torch Linear as a Keras Dense (kernel is the transposed weight)."""
    return linear.weight.detach().numpy().T.copy(), linear.bias.detach().numpy().copy()


def _mha_weights(mha: MultiHeadAttention) -> dict:
    return {name: _keras(getattr(mha, name)) for name in ("wq", "wk", "wv", "dense")}


def _padding_mask(lk: int) -> torch.Tensor:
    """Float mask (B, 1, 1, Lk), 1 = masked out: the last two keys of the second item."""
    mask = torch.zeros(B, 1, 1, lk)
    mask[1, ..., -2:] = 1.0
    return mask


def test_scaled_dot_product_attention_matches_document():
    q, k, v = torch.randn(B, H, L, 8), torch.randn(B, H, 5, 8), torch.randn(B, H, 5, 6)
    mask = _padding_mask(5)
    out, w = scaled_dot_product_attention(q, k, v, mask)
    ref_out, ref_w = seed.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), mask.numpy())
    torch.testing.assert_close(out, torch.from_numpy(ref_out), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, torch.from_numpy(ref_w), atol=1e-5, rtol=1e-5)
    assert w[1, ..., -2:].abs().max() < 1e-6  # masked keys get no weight


def test_scaled_dot_product_attention_bool_mask_equals_float_mask():
    q, k, v = torch.randn(3, B, H, L, 8).unbind(0)
    mask = _padding_mask(L)
    out_f, w_f = scaled_dot_product_attention(q, k, v, mask)
    out_b, w_b = scaled_dot_product_attention(q, k, v, mask.bool())
    torch.testing.assert_close(out_f, out_b)
    torch.testing.assert_close(w_f, w_b)


@pytest.mark.parametrize("self_attention", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_multi_head_attention_matches_document(self_attention, need_weights):
    mha = MultiHeadAttention(D, H).eval()
    x = torch.randn(B, L, D)
    k = x if self_attention else torch.randn(B, 5, D)
    mask = _padding_mask(k.shape[1])
    out, w = mha(q=x, k=k, v=k, mask=mask, need_weights=need_weights)
    ref = seed.MultiHeadAttention(D, H, _mha_weights(mha))
    ref_out, ref_w = ref.call(k.numpy(), k.numpy(), x.numpy(), mask.numpy())  # document's (v, k, q) order
    torch.testing.assert_close(out, torch.from_numpy(ref_out), atol=1e-5, rtol=1e-5)
    if need_weights:
        assert w.shape == (B, H, L, k.shape[1])
        torch.testing.assert_close(w, torch.from_numpy(ref_w), atol=1e-5, rtol=1e-5)
    else:
        assert w is None


def test_multi_head_attention_split_heads_shape():
    mha = MultiHeadAttention(D, H)
    x = torch.randn(B, L, D)
    heads = mha.split_heads(x, B)
    assert heads.shape == (B, H, L, D // H)
    torch.testing.assert_close(heads[:, 1], x[..., D // H : 2 * D // H])  # head 1 = channels 8..15


def test_multi_head_attention_fused_equals_explicit_with_mask():
    mha = MultiHeadAttention(D, H).eval()
    x, mask = torch.randn(B, L, D), _padding_mask(L)
    fused, _ = mha(x, x, x, mask)
    explicit, w = mha(x, x, x, mask, need_weights=True)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    mha.fused_attn = False
    torch.testing.assert_close(mha(x, x, x, mask)[0], explicit, atol=1e-5, rtol=1e-5)


def test_explicit_attention_under_bf16_autocast_keeps_scores_mask_and_softmax_fp32():
    """The weights are the fp32 softmax(q kᵀ / √d + mask · -1e9) of the bf16 heads, as the fused kernels keep them;
    in bf16 (3 significant digits) they would be off by about 1e-2."""
    mha = MultiHeadAttention(D, H).eval()
    x, mask = torch.randn(B, L, D) * 4, _padding_mask(L)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, _ = mha.project_qkv(x)  # (B, H, L, d) each, bf16
        out, weights = mha(x, x, x, mask, need_weights=True)
    assert q.dtype == torch.bfloat16 and weights.dtype == torch.float32 and out.dtype == torch.bfloat16
    scores = q.double() @ k.double().transpose(-2, -1) / q.shape[-1] ** 0.5 + mask.double() * -1e9
    torch.testing.assert_close(weights.double(), scores.softmax(-1), rtol=0, atol=1e-6)
    assert torch.all(weights[1, ..., -2:] == 0)


def test_multi_head_attention_causal_masks_future():
    mha = MultiHeadAttention(D, H).eval()
    x = torch.randn(B, L, D)
    _, w = mha(x, x, x, need_weights=True, is_causal=True)
    assert torch.all(w.triu(diagonal=1) == 0)
    y = x.clone()
    y[:, -1] += 1.0  # changing the last position must not change earlier outputs
    torch.testing.assert_close(mha(x, x, x, is_causal=True)[0][:, :-1], mha(y, y, y, is_causal=True)[0][:, :-1])


def test_multi_head_attention_rejects_bad_heads():
    with pytest.raises(ValueError, match="num_heads=5 must divide d_model=32"):
        MultiHeadAttention(32, 5)


def test_point_wise_feed_forward_network_structure_and_values():
    ffn = point_wise_feed_forward_network(D, 64)
    assert [type(m) for m in ffn] == [nn.Linear, nn.ReLU, nn.Linear]
    assert ffn[0].out_features == 64 and ffn[2].out_features == D
    x = torch.randn(B, L, D)
    w = {"ffn1": _keras(ffn[0]), "ffn2": _keras(ffn[2])}
    torch.testing.assert_close(
        ffn(x), torch.from_numpy(seed.point_wise_feed_forward_network(x.numpy(), w)), atol=1e-5, rtol=1e-5
    )
    with pytest.raises(ValueError, match="activation='swish' is unknown"):
        point_wise_feed_forward_network(D, 64, "swish")


def _norm_weights(m: nn.LayerNorm) -> tuple:
    return m.weight.detach().numpy(), m.bias.detach().numpy()


def _encoder_seed_weights(layer: EncoderLayer) -> dict:
    return {
        "mha": _mha_weights(layer.mha),
        "ffn1": _keras(layer.ffn[0]),
        "ffn2": _keras(layer.ffn[2]),
        "layernorm1": _norm_weights(layer.layernorm1),
        "layernorm2": _norm_weights(layer.layernorm2),
    }


def _randomize_norms(layer: nn.Module) -> None:
    for m in layer.modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, 1.0, 0.3)
            nn.init.normal_(m.bias, 0.0, 0.3)


@pytest.mark.parametrize("masked", [False, True])
def test_encoder_layer_matches_document(masked):
    layer = EncoderLayer(D, H, 64, rate=0.1).eval()
    _randomize_norms(layer)
    assert layer.layernorm1.eps == 1e-6 and layer.dropout1.p == 0.1
    x = torch.randn(B, L, D)
    mask = _padding_mask(L) if masked else None
    ref = seed.encoder_layer(x.numpy(), None if mask is None else mask.numpy(), D, H, _encoder_seed_weights(layer))
    torch.testing.assert_close(layer(x, mask), torch.from_numpy(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_encoder_layer_masks_a_memorys_padding_as_the_documents_mask(fused):
    layer = EncoderLayer(D, H, 64, rate=0.1, fused_attn=fused).eval()
    _randomize_norms(layer)
    x = torch.randn(B, L, D)
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[1, -3:] = False  # the second row's last three tokens are padding
    mask = (~valid)[:, None, None, :].float().numpy()  # the document's mask: 1 where a key is masked out
    ref = seed.encoder_layer(x.numpy(), mask, D, H, _encoder_seed_weights(layer))
    out = layer(Memory(x, valid=valid))
    assert torch.equal(out.valid, valid)
    torch.testing.assert_close(out.tokens, torch.from_numpy(ref), atol=1e-5, rtol=1e-5)


def test_encoder_layer_dropout_only_in_training():
    layer = EncoderLayer(D, H, 64, rate=0.5)
    x = torch.randn(B, L, D)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    assert not torch.allclose(layer(x), layer(x))


def _torch_encoder_layer_from(layer: EncoderLayer, norm_first: bool, activation: str) -> nn.TransformerEncoderLayer:
    ref = nn.TransformerEncoderLayer(
        D, H, 64, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first, layer_norm_eps=1e-6
    ).eval()
    m = layer.mha
    with torch.no_grad():
        ref.self_attn.in_proj_weight.copy_(torch.cat([m.wq.weight, m.wk.weight, m.wv.weight]))
        ref.self_attn.in_proj_bias.copy_(torch.cat([m.wq.bias, m.wk.bias, m.wv.bias]))
        ref.self_attn.out_proj.load_state_dict(m.dense.state_dict())
        ref.linear1.load_state_dict(layer.ffn[0].state_dict())
        ref.linear2.load_state_dict(layer.ffn[2].state_dict())
        ref.norm1.load_state_dict(layer.layernorm1.state_dict())
        ref.norm2.load_state_dict(layer.layernorm2.state_dict())
    return ref


@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
def test_encoder_layer_matches_torch_transformer_encoder_layer(norm_first, activation):
    layer = EncoderLayer(D, H, 64, norm_first=norm_first, activation=activation).eval()
    _randomize_norms(layer)
    ref = _torch_encoder_layer_from(layer, norm_first, activation)
    x = torch.randn(B, L, D)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, -2:] = True
    torch.testing.assert_close(layer(x), ref(x), atol=1e-5, rtol=1e-5)
    # torch's key padding mask is True = ignore, like ours; ours broadcasts as (B, 1, 1, L)
    torch.testing.assert_close(layer(x, pad[:, None, None, :]), ref(x, src_key_padding_mask=pad), atol=1e-5, rtol=1e-5)


def test_encoder_layer_gradient_reaches_every_parameter():
    layer = EncoderLayer(D, H, 64, norm_first=True, activation="gelu", drop_path=0.1)
    layer(torch.randn(B, L, D)).square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_record_attention_records_without_changing_outputs():
    layer = EncoderLayer(D, H, 64).eval()
    x = torch.randn(B, L, D)
    fused = layer(x)
    with record_attention(layer) as maps:
        recorded = layer(x)
    torch.testing.assert_close(fused, recorded, atol=1e-5, rtol=1e-5)
    (w,) = maps["mha"]
    assert w.shape == (B, H, L, L)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, L))
    assert layer.mha._record is None  # recording ends with the block


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("capacity", [None, 3, L])  # grown per call; preallocated, then grown; preallocated
def test_decoder_layer_cached_steps_equal_full_pass(norm_first, capacity):
    layer = DecoderLayer(D, H, 64, norm_first=norm_first).eval()
    x, memory = torch.randn(B, L, D), Memory(torch.randn(B, 9, D))
    full = layer(x, memory)
    cache = LayerCache(capacity)
    steps = [layer(x[:, t : t + 1], memory, cache) for t in range(L)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.k.shape == (B, H, L, D // H) and cache.cross_k.shape == (B, H, 9, D // H)


@pytest.mark.parametrize("cached", [False, True])
def test_decoder_layer_memory_once_per_image_equals_memory_per_beam(cached):
    K = 3  # beams per image: memory holds each image once, x holds its K beams in consecutive rows
    layer = DecoderLayer(D, H, 64).eval()
    x, memory = torch.randn(B * K, L, D), torch.randn(B, 9, D)

    def run(mem: torch.Tensor) -> torch.Tensor:
        if not cached:
            return layer(x, Memory(mem))
        cache = LayerCache(L)
        out = torch.cat([layer(x[:, t : t + 1], Memory(mem), cache) for t in range(L)], dim=1)
        assert cache.cross_k.shape == (mem.shape[0], H, 9, D // H)  # one copy per image, not one per beam
        return out

    torch.testing.assert_close(run(memory), run(memory.repeat_interleave(K, dim=0)), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="memory batch 4 must divide the caption batch 6"):
        layer(x, Memory(torch.randn(4, 9, D)))


def test_layer_cache_appends_in_place_and_reorders_rows():
    cache = LayerCache(capacity=4)
    k1, v1 = torch.randn(B, H, 1, 8), torch.randn(B, H, 1, 8)
    cache.append(k1, v1)
    buffer = cache.k.data_ptr()
    k2, v2 = torch.randn(B, H, 2, 8), torch.randn(B, H, 2, 8)
    k, v = cache.append(k2, v2)
    assert cache.k.data_ptr() == buffer  # written into the buffer of the first call, not copied
    torch.testing.assert_close(k, torch.cat([k1, k2], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(v, torch.cat([v1, v2], dim=2), rtol=0, atol=0)
    index = torch.tensor([1, 1])
    cache.reorder(index)
    torch.testing.assert_close(cache.v, torch.cat([v1, v2], dim=2)[index], rtol=0, atol=0)
    k3, v3 = torch.randn(B, H, 2, 8), torch.randn(B, H, 2, 8)  # past the capacity: the buffers grow
    k, _ = cache.append(k3, v3)
    torch.testing.assert_close(k, torch.cat([torch.cat([k1, k2], dim=2)[index], k3], dim=2), rtol=0, atol=0)


def test_decoder_layer_is_causal_and_reads_memory():
    layer = DecoderLayer(D, H, 64).eval()
    x, memory = torch.randn(B, L, D), torch.randn(B, 9, D)
    y = x.clone()
    y[:, 3:] = torch.randn(B, L - 3, D)
    torch.testing.assert_close(layer(x, Memory(memory))[:, :3], layer(y, Memory(memory))[:, :3])
    assert not torch.allclose(layer(x, Memory(memory)), layer(x, Memory(memory + 1.0)))


def test_multi_head_attention_fused_causal_equals_explicit_causal():
    mha = MultiHeadAttention(D, H).eval()
    x = torch.randn(B, L, D)
    fused, _ = mha(x, x, x, is_causal=True)  # SDPA's is_causal
    explicit, w = mha(x, x, x, is_causal=True, need_weights=True)  # the document's mask * -1e9
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    assert torch.all(w.triu(diagonal=1) == 0)


# --- which attention path runs ---------------------------------------------------------------------


def _spy_attention():
    """Call-counting wrappers of the fused kernel and of the document's function, as the attention module calls them.

    ``vitattn/layers/attention.py`` calls ``F.scaled_dot_product_attention`` (``F`` = ``torch.nn.functional``)
    on the fused path and its own module-level ``scaled_dot_product_attention`` on the explicit path.
    """
    import torch.nn.functional as F

    import vitattn.layers.attention as attention

    assert attention.F is F  # patching F's attribute is patching what the module calls
    fused = mock.patch.object(F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention)
    explicit = mock.patch.object(
        attention, "scaled_dot_product_attention", wraps=attention.scaled_dot_product_attention
    )
    return fused, explicit


def test_fused_path_calls_torch_sdpa_and_not_the_document_function():
    mha = MultiHeadAttention(D, H).eval()
    x, mask = torch.randn(B, L, D), _padding_mask(L)
    fused_patch, explicit_patch = _spy_attention()
    with fused_patch as fused, explicit_patch as explicit:
        out, w = mha(x, x, x, mask)
        assert fused.call_count == 1 and explicit.call_count == 0 and w is None
        assert fused.call_args.kwargs["attn_mask"].shape == mask.shape  # the mask goes to the kernel, additive
        assert fused.call_args.kwargs["attn_mask"][1, ..., -1].item() <= -1e9
        mha(x, x, x, is_causal=True)  # a square look-ahead goes to the kernel as is_causal, without a mask
        assert fused.call_count == 2 and explicit.call_count == 0
        assert fused.call_args.kwargs["is_causal"] is True and fused.call_args.kwargs["attn_mask"] is None
    torch.testing.assert_close(out, mha(x, x, x, mask, need_weights=True)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("how", ["need_weights", "fused_attn=False", "record_attention"])
def test_explicit_path_does_not_call_torch_sdpa(how):
    mha = MultiHeadAttention(D, H, fused_attn=how != "fused_attn=False").eval()
    x, mask = torch.randn(B, L, D), _padding_mask(L)
    need_weights = how == "need_weights"
    recording = record_attention(mha) if how == "record_attention" else contextlib.nullcontext({"": []})
    fused_patch, explicit_patch = _spy_attention()
    with fused_patch as fused, explicit_patch as explicit, recording as maps:
        _, w = mha(x, x, x, mask, need_weights=need_weights)
        mha(x, x, x, need_weights=need_weights, is_causal=True)
    assert fused.call_count == 0, f"{how}: F.scaled_dot_product_attention was called"
    assert explicit.call_count == 2  # the document's softmax(q kᵀ / √d + mask · -1e9) v, each time
    assert (w is not None) == need_weights and len(maps[""]) == (2 if how == "record_attention" else 0)


def test_vit_and_decoder_layers_take_the_path_they_are_built_with():
    from vitattn.models import VisionTransformer

    x, memory = torch.randn(B, 3, 32, 32), Memory(torch.randn(B, 9, D))
    for fused_attn in (True, False):
        vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=D, depth=2, num_heads=H, fused_attn=fused_attn)
        decoder = DecoderLayer(D, H, 64, fused_attn=fused_attn).eval()
        fused_patch, explicit_patch = _spy_attention()
        with fused_patch as fused, explicit_patch as explicit:
            vit.eval()(x)
            decoder(torch.randn(B, L, D), memory)  # self-attention, then cross-attention
        assert (fused.call_count, explicit.call_count) == ((4, 0) if fused_attn else (0, 4)), fused_attn


@pytest.fixture(scope="module")
def threads_in_a_module_fixture() -> int:
    return torch.get_num_threads()


def test_tests_run_on_one_torch_thread(threads_in_a_module_fixture):
    # tests/conftest.py pins one thread, module fixtures (trained runs) included: exact float
    # comparisons then do not depend on the core count
    assert torch.get_num_threads() == 1 and threads_in_a_module_fixture == 1


def _softmax_attention(q, k, v, masked=None, size=None) -> torch.Tensor:
    """softmax(q kᵀ / √d) v in float64, ``masked`` (bool, True = left out) keys at -inf, log ``size`` (B, Lk) added:
    (B, H, Lq, dv)."""
    logits = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    if masked is not None:
        logits = logits.masked_fill(masked, -torch.inf)
    if size is not None:
        logits = logits + size.double().log()[:, None, None, :]
    return logits.softmax(-1) @ v.double()


def _heads(lq: int, lk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, n, D // H, generator=generator) for n in (lq, lk, lk))


def _dense(mha: MultiHeadAttention, heads: torch.Tensor) -> torch.Tensor:
    return mha.dense(heads.float().transpose(1, 2).reshape(heads.shape[0], heads.shape[2], -1))


@pytest.mark.parametrize("lq", [2, 3])
@pytest.mark.parametrize("need_weights", [False, True])
def test_a_causal_attention_with_a_mask_leaves_out_both(lq, need_weights):
    """A padding mask and the look-ahead together leave out a key masked by either, on the fused and the explicit
    path, for 2 queries as for more: against the softmax written out."""
    q, k, v = _heads(lq, lq)
    pad = torch.zeros(B, 1, 1, lq)
    pad[0, ..., -1] = 1  # image 0's last key is padding
    look_ahead = torch.ones(lq, lq, dtype=torch.bool).triu(1)
    mha = MultiHeadAttention(D, H).eval()
    with torch.no_grad():
        got, _ = mha.attend(q, k, v, pad, need_weights=need_weights, is_causal=True)
        expected = _dense(mha, _softmax_attention(q, k, v, pad.bool() | look_ahead))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_merged_sizes_and_a_mask_together_are_the_softmax_written_out(need_weights):
    """Proportional attention (log size added) and a padding mask at once, fused and explicit."""
    q, k, v = _heads(5, 4)
    pad = torch.zeros(B, 1, 1, 4)
    pad[1, ..., 0] = 1
    size = torch.tensor([[1.0, 3, 1, 2], [2, 1, 4, 1]])
    mha = MultiHeadAttention(D, H).eval()
    with torch.no_grad():
        got, _ = mha.attend(q, k, v, pad, need_weights=need_weights, size=size)
        expected = _dense(mha, _softmax_attention(q, k, v, pad.bool(), size))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_attention_dropout_drops_weights_in_training_only():
    """``dropout_p`` 1 drops every weight, 0.5 zeroes some and doubles the rest; a module's ``attn_drop`` applies
    in training only: in eval the output is the softmax written out."""
    q, k, v = _heads(3, 3)
    expected = (q.double() @ k.double().transpose(-1, -2) / (D // H) ** 0.5).softmax(-1)
    out, weights = scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    assert not out.any() and not weights.any()
    torch.manual_seed(0)
    _, weights = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    kept = weights != 0
    assert 0 < kept.sum() < kept.numel()
    torch.testing.assert_close(weights[kept].double(), 2 * expected[kept], rtol=1e-5, atol=1e-6)
    mha = MultiHeadAttention(D, H, attn_drop=0.5).eval()
    with torch.no_grad():
        got, _ = mha.attend(q, k, v)
        torch.testing.assert_close(got, _dense(mha, _softmax_attention(q, k, v)), rtol=1e-5, atol=1e-5)
