"""Section ``caption``: caption tokens/s, ours cached and recomputed against Hugging Face ``generate``.

Hugging Face ``transformers`` (the ``bench`` extra) is imported by the functions that use it,
not by this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks import workloads
from benchmarks.report import compare
from benchmarks.timing import Env, per_second
from benchmarks.workloads import forced_length


def build_captioners(
    device: str, max_len: int | None = None, encoder: str = "vit_192d6_32px"
) -> tuple[nn.Module, nn.Module]:
    """Our ``ImageCaptioner`` and a Hugging Face ``VisionEncoderDecoderModel`` (ViT + GPT-2 with
    cross-attention) of matching sizes, both randomly initialised from configs (nothing downloaded).

    Args:
        device: where both models go.
        max_len: the decoder's longest sequence (default ``CAPTION_DECODER["max_len"]``).
        encoder: the encoder's size, a key of ``workloads.ENCODERS``.

    Returns:
        ``(ours, hf)``, both in eval mode.
    """
    from transformers import (
        GenerationConfig,
        GPT2Config,
        VisionEncoderDecoderConfig,
        VisionEncoderDecoderModel,
        ViTConfig,
    )

    enc, dec = workloads.ENCODERS[encoder], dict(workloads.CAPTION_DECODER)
    if max_len is not None:
        dec["max_len"] = max_len
    ours = workloads.build_ours(device, max_len, encoder)
    vit = ViTConfig(
        image_size=enc["img_size"],
        patch_size=enc["patch_size"],
        hidden_size=enc["embed_dim"],
        num_hidden_layers=enc["depth"],
        num_attention_heads=enc["num_heads"],
        intermediate_size=int(enc["embed_dim"] * enc["mlp_ratio"]),
        hidden_act="gelu",
        layer_norm_eps=1e-6,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        qkv_bias=True,
    )
    gpt2 = GPT2Config(
        vocab_size=dec["vocab_size"],
        n_positions=dec["max_len"],
        n_embd=dec["embed_dim"],
        n_layer=dec["depth"],
        n_head=dec["num_heads"],
        n_inner=int(dec["embed_dim"] * dec["mlp_ratio"]),
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-6,
        add_cross_attention=True,
        is_decoder=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(vit, gpt2)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 1, 0, 2
    hf = VisionEncoderDecoderModel(config=config)
    hf.generation_config = GenerationConfig(decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return ours, hf.to(device).eval()


@contextlib.contextmanager
def given_memory(captioner: nn.Module, memory: Tensor) -> Iterator[None]:
    """Decode-only timing: ``captioner.generate`` skips the encoder and uses ``memory`` (B, N, D).

    ``generate`` encodes the images once through ``self.encode``; an instance attribute shadows it.
    """
    captioner.encode = lambda images: memory
    try:
        yield
    finally:
        del captioner.encode


def caption_fns(
    ours: nn.Module, hf: nn.Module, images: Tensor, tokens: int, beams: int, env: Env, decode_only: bool
) -> dict[str, Callable[[], Tensor]]:
    """Generation of exactly ``tokens`` new tokens per image: ours cached, ours recomputed, Hugging Face.

    Ours: ``<eos>`` made unreachable (``forced_length``). Hugging Face: ``min_new_tokens =
    max_new_tokens`` (its logits processor masks ``<eos>`` until then). With ``decode_only`` both get
    the encoder's output precomputed, so that only the decoding loop is timed.

    Returns:
        ``ours_cached``, ``ours_recompute`` and ``hf``, each checking the shape of what it generated.
    """
    from transformers.modeling_outputs import BaseModelOutput

    with torch.inference_mode(), env.autocast():
        memory = ours.encode(images) if decode_only else None
        hf_memory = hf.encoder(pixel_values=images).last_hidden_state if decode_only else None

    def ours_gen(use_cache: bool) -> Callable[[], Tensor]:
        def gen() -> Tensor:
            given = given_memory(ours, memory) if decode_only else contextlib.nullcontext()
            # inference mode as on the Hugging Face side and in ``vitattn.inference`` (generate alone: no_grad)
            with torch.inference_mode(), given, forced_length(ours.decoder), env.autocast():
                return ours.generate(images, max_new_tokens=tokens, num_beams=beams, use_cache=use_cache)

        return gen

    def hf_gen() -> Tensor:
        # A new BaseModelOutput each call: beam search expands the one it is given in place.
        inputs = (
            dict(encoder_outputs=BaseModelOutput(last_hidden_state=hf_memory))
            if decode_only
            else dict(pixel_values=images)
        )
        with torch.inference_mode(), env.autocast():
            out = hf.generate(
                **inputs,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                num_beams=beams,
                do_sample=False,
                use_cache=True,
                early_stopping=False,
            )
        return out[:, 1:]  # drop the decoder start token

    def checked(fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
        def call() -> Tensor:  # every timed call must emit exactly `tokens` tokens per image
            out = fn()
            if tuple(out.shape) != (images.shape[0], tokens):
                raise RuntimeError(
                    f"generation length not forced: got {tuple(out.shape)}, want {(images.shape[0], tokens)}"
                )
            return out

        return call

    return {"ours_cached": checked(ours_gen(True)), "ours_recompute": checked(ours_gen(False)), "hf": checked(hf_gen)}


def bench_caption(
    env: Env, batch: int | None = None, tokens: int | None = None, beams_list: Sequence[int] = (1, 3)
) -> tuple[list[dict], dict[str, Any]]:
    """Row (d): caption tokens/s, ours cached vs ours recompute vs Hugging Face ``generate``.

    The decode-only rows time the decoding loop alone (the encoder's output given; the encoders are
    the same network on both sides); the others time ``generate`` from images, encoder included.
    Both are target rows against Hugging Face.

    Args:
        env: the run's device and timing knobs.
        batch: images per call (default ``CAPTION_BATCH``).
        tokens: new tokens per image (default ``CAPTION_TOKENS``).
        beams_list: beam widths to run (1: greedy).

    Returns:
        ``(rows, details)``: three rows per beam width, and per mode every sample and rate.
    """
    batch, tokens = batch or workloads.CAPTION_BATCH, tokens or workloads.CAPTION_TOKENS
    ours, hf = build_captioners(env.device)
    img = workloads.ENCODERS["vit_192d6_32px"]["img_size"]
    images = torch.randn(batch, 3, img, img, device=env.device)
    rows, details = [], {}
    for decode_only in (True, False):
        for beams in beams_list:
            fns = caption_fns(ours, hf, images, tokens, beams, env, decode_only)
            if not decode_only:  # the cache's effect is shown decode-only; here: ours vs HF as a user sees it
                del fns["ours_recompute"]
            t = env.time(fns, repeats=max(3, env.repeats - 2))  # each call checks its output's shape
            mode = "greedy" if beams == 1 else f"beam {beams}"
            part = "decode only" if decode_only else "generate incl. encoder"
            details[f"{part}, {mode}"] = dict(
                batch=batch, new_tokens=tokens, num_beams=beams, seconds=t, tokens_per_s=per_second(t, batch * tokens)
            )
            tag = f"caption {part} {mode} b{batch}"
            if decode_only:
                rows.append(
                    compare(
                        f"{tag}: cached vs recompute",
                        t["ours_cached"],
                        t["ours_recompute"],
                        batch * tokens,
                        "tok/s",
                        "cache_vs_recompute",
                        "ours, no cache",
                    )
                )
            rows.append(
                compare(
                    f"{tag}: cached vs HF",
                    t["ours_cached"],
                    t["hf"],
                    batch * tokens,
                    "tok/s",
                    "cache_vs_hf" if decode_only else "generate_vs_hf",
                    "HF generate",
                )
            )
    details["models"] = dict(
        encoder=workloads.ENCODERS["vit_192d6_32px"],
        decoder=workloads.CAPTION_DECODER,
        new_tokens=tokens,
        hf="VisionEncoderDecoderModel(ViTModel, GPT2LMHeadModel with cross-attention)",
    )
    return rows, details
