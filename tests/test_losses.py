"""``CaptionLoss`` against the cross-entropy written out by hand: the next token of each position, the padding
left out of the sum and the count, and label smoothing spread over all V classes (``<pad>`` included, as PyTorch
spreads it), none by default; the temperatures as the papers give them. The contrastive losses have their own file
(tests/training/test_contrastive.py)."""

import math

import pytest
import torch

from vitattn.losses import INIT_LOGIT_SCALE, MAX_LOGIT_SCALE, CaptionLoss

V = 7  # vocabulary


def _by_hand(logits: torch.Tensor, tokens: torch.Tensor, pad_id: int, eps: float) -> float:
    """The mean over the non-pad next tokens of (1 - eps) * -log p(next) + eps * the mean over V of -log p(v)."""
    total, count = 0.0, 0
    for n, row in enumerate(tokens.tolist()):
        for t in range(len(row) - 1):
            target = row[t + 1]  # logits[:, t] predict the token after position t
            if target == pad_id:
                continue
            z = logits[n, t].tolist()
            top = max(z)
            log_norm = top + math.log(sum(math.exp(v - top) for v in z))
            log_p = [v - log_norm for v in z]
            total += (1 - eps) * -log_p[target] + eps * -sum(log_p) / V
            count += 1
    return total / count


@pytest.mark.parametrize("pad_id", [0, 3])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_the_caption_loss_is_the_hand_written_cross_entropy_without_padding(pad_id, label_smoothing):
    torch.manual_seed(0)
    bos, eos = 1, 2
    words = [w for w in range(V) if w not in (pad_id, bos, eos)]
    # Captions of 5, 3 and 1 words: padding of 0, 2 and 4 positions after <eos>.
    rows = [[bos, *words[:4], words[0], eos], [bos, *words[1:4], eos], [bos, words[2], eos]]
    width = max(map(len, rows))
    tokens = torch.tensor([row + [pad_id] * (width - len(row)) for row in rows])  # (N, T)
    logits = torch.randn(len(rows), width - 1, V)  # (N, T-1, V)
    got = CaptionLoss(pad_id)(logits, tokens, label_smoothing=label_smoothing)
    assert got.item() == pytest.approx(_by_hand(logits.double(), tokens, pad_id, label_smoothing), rel=1e-6)
    assert got.dtype == torch.float32
    assert CaptionLoss(pad_id)(logits.bfloat16(), tokens, label_smoothing).dtype == torch.float32
    if label_smoothing == 0.0:  # the default: no smoothing
        assert CaptionLoss(pad_id)(logits, tokens).item() == pytest.approx(_by_hand(logits.double(), tokens, pad_id, 0))


def test_the_temperatures_are_the_papers():
    """CLIP's initial temperature 1 / 0.07 and its cap 100 (Radford et al. 2021), SigLIP's initial 10 (Zhai et al.
    2023), written as numbers: the log temperatures are what the code keeps."""
    assert math.exp(INIT_LOGIT_SCALE["clip"]) == pytest.approx(14.2857142857, rel=1e-9)
    assert math.exp(INIT_LOGIT_SCALE["siglip"]) == pytest.approx(10.0, rel=1e-12)
    assert math.exp(MAX_LOGIT_SCALE) == pytest.approx(100.0, rel=1e-12)
