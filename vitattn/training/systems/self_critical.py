"""Self-critical sequence training (Rennie et al., 2017) on CIDEr-D: the reference implementation's loss, sampling
and reward (``<eos>`` a word), the decoder's dropout off in the pass that samples and the pass that scores
(docs/training.md#a-second-stage-self-critical-training-on-cider-d).

Dimension letters: B images, K samples per image, T generated positions, V vocabulary, N image tokens, D width.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from vitattn.layers import Memory
from vitattn.losses import scst_loss
from vitattn.metrics import CiderD
from vitattn.models import ImageCaptioner
from vitattn.models.generate import greedy_search, sampling_logits

__all__ = ["BASELINES", "ScstConfig", "SelfCritical"]

BASELINES = ("mean", "greedy")


@dataclass(frozen=True)
class ScstConfig:
    """``finetune.scst``: K ``samples`` per image, the ``baseline`` (``mean`` of the image's other samples'
    rewards, Luo 2020, or its ``greedy`` caption's), ``generate``'s sampling filters, the cross-entropy's weight,
    the longest sample (None: the generation length, ``head.generate.max_new_tokens``, which ``CaptionSystem``
    checks and puts in its place before ``SelfCritical`` samples)."""

    samples: int = 5
    baseline: str = "mean"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    xe_weight: float = 0.0
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.baseline not in BASELINES:
            raise ValueError(f"scst.baseline={self.baseline!r} is unknown; choose mean or greedy")
        if self.samples < 1:
            raise ValueError(f"scst.samples={self.samples} must be at least 1")
        if self.samples == 1 and self.baseline == "mean":
            raise ValueError(
                "scst.samples=1 with scst.baseline=mean leaves no other sample to average; "
                "use scst.samples=2 or more, or scst.baseline=greedy"
            )
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.xe_weight < 0:
            raise ValueError(
                f"scst.temperature={self.temperature} must be positive, scst.top_p={self.top_p} in (0, 1], "
                f"scst.top_k={self.top_k} and scst.xe_weight={self.xe_weight} at least 0"
            )


def mean_of_others(rewards: Tensor, samples: int) -> Tensor:
    """(B * K,) rewards, the K of an image consecutive -> (B * K,) means of the image's other K - 1 rewards."""
    grouped = rewards.view(-1, samples)  # (B, K)
    return ((grouped.sum(1, keepdim=True) - grouped) / (samples - 1)).reshape(-1)


class SelfCritical:
    """A ``CaptionSystem``'s self-critical loss of a batch, and what to log; ``scorer``: CIDEr-D with the training
    set's document frequencies, ``decode``: the tokenizer's ``decode_batch``."""

    def __init__(self, config: ScstConfig, scorer: CiderD, decode: Any) -> None:
        self.config, self.scorer, self.decode = config, scorer, decode

    def __call__(
        self,
        model: ImageCaptioner,
        images: Tensor,
        references: list[list[str]],
        generator: torch.Generator | None,
        memory: Memory | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of images (B, C, height, width) with their references, and ``reward``, ``baseline``,
        ``eos_share`` (of the samples that end with ``<eos>``) as tensors on the images' device; ``memory``: the
        images' (B, N, D) ``encode``, with gradients, when the caller has it (None: encoded here)."""
        cfg, K = self.config, self.config.samples
        ids = model.special_ids
        max_new = cfg.max_new_tokens
        assert max_new is not None, "CaptionSystem resolves scst.max_new_tokens to the generation length"
        if memory is None:
            with record_function("scst/encode"):
                memory = model.encode(images)  # (B, N, D), with gradients
        B, device = memory.tokens.shape[0], memory.tokens.device
        with decoder_dropout_off(model):  # one policy: the pass that samples and the pass that scores agree
            with torch.no_grad(), record_function("scst/sample"):
                step = model.decode_step(memory.detach(), max_new)  # B * K rows over B images' tokens
                sample = dict(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, generator=generator)
                sampled = greedy_search(step, B * K, max_new, ids, device, sample)  # (B * K, T)
            with record_function("scst/reward"):
                image_refs = [refs for refs in references for _ in range(K)]
                rewards = torch.tensor(self._rewards(model, sampled, image_refs), device=device)
            if cfg.baseline == "mean":
                baseline = mean_of_others(rewards, K)
            else:
                with record_function("scst/greedy_baseline"):
                    greedy = self._greedy_rewards(model, images, references, max_new)
                baseline = torch.tensor(greedy, device=device).repeat_interleave(K)
            with record_function("scst/log_probs"):
                log_probs, mask = sample_log_probs(model, memory, sampled, cfg)
        loss = scst_loss(log_probs, mask, rewards - baseline)
        ended = (sampled == ids.eos_id).any(dim=1).float().mean()
        return loss, {"reward": rewards.mean(), "baseline": baseline.mean(), "eos_share": ended}

    def _rewards(self, model: ImageCaptioner, generated: Tensor, references: list[list[str]]) -> list[float]:
        """CIDEr-D of each row of ``generated`` (S, T); a row cut without ``<eos>`` matches no reference ending."""
        ended = (generated == model.special_ids.eos_id).any(dim=1).tolist()
        return self.scorer(self.decode(generated), references, ended)

    def _greedy_rewards(
        self, model: ImageCaptioner, images: Tensor, references: list[list[str]], max_new: int
    ) -> list[float]:
        """The reward of each image's greedy caption, decoded as evaluation decodes (dropout off)."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                greedy = model.generate(images, max_new_tokens=max_new)
        finally:
            model.train(was_training)
        return self._rewards(model, greedy, references)


@contextmanager
def decoder_dropout_off(model: ImageCaptioner) -> Iterator[None]:
    """The decoder in eval mode inside: a gradient under another dropout mask than the sampling's would score the
    samples with a policy that did not draw them."""
    was_training = model.decoder.training
    model.decoder.eval()
    try:
        yield
    finally:
        model.decoder.train(was_training)


def sample_log_probs(
    model: ImageCaptioner, memory: Memory, sampled: Tensor, config: ScstConfig = ScstConfig()
) -> tuple[Tensor, Tensor]:
    """(B * K, T) log-probabilities, with gradients, of ``sampled`` (B * K, T: ids without ``<bos>``, padded after
    ``<eos>``, K rows per image of ``memory`` (B, N, D)) under the policy that drew them: the search's bans, then
    ``config``'s temperature, top-k and top-p (``sampling_logits``, the sampled token kept should the scoring pass's
    rounding move it out); and the mask of generated tokens."""
    ids = model.special_ids
    bos = sampled.new_full((sampled.shape[0], 1), ids.bos_id)
    inputs = torch.cat([bos, sampled[:, :-1]], dim=1)
    logits = model.decoder(inputs, memory).float()  # (B * K, T, V)
    logits = logits.index_fill(-1, torch.tensor(ids.banned, device=logits.device), float("-inf"))
    drawn = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, sampled.unsqueeze(-1), True)  # (B * K, T, V)
    logits = sampling_logits(logits, config.temperature, config.top_k, config.top_p, keep=drawn)
    log_probs = logits.log_softmax(-1).gather(-1, sampled.unsqueeze(-1)).squeeze(-1)  # (B * K, T)
    mask = sampled != ids.pad_id
    return log_probs.masked_fill(~mask, 0.0), mask
