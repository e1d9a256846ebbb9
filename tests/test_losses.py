"""``CaptionLoss`` against the cross-entropy written out by hand: the next token of each position, the padding
left out of the sum and the count, and label smoothing spread over all V classes (``<pad>`` included, as PyTorch
spreads it), none by default; the classification and soft-target cross-entropies and SCST's loss, each by hand in
float64; the temperatures as the papers give them. The contrastive losses have their own file
(tests/training/test_contrastive.py)."""

import math

import pytest
import torch

from vitattn.losses import (
    INIT_LOGIT_SCALE,
    MAX_LOGIT_SCALE,
    CaptionLoss,
    classification_loss,
    scst_loss,
    soft_target_cross_entropy,
)

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


def _log_softmax(z: list[float]) -> list[float]:
    top = max(z)
    log_norm = top + math.log(sum(math.exp(v - top) for v in z))
    return [v - log_norm for v in z]


@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
@pytest.mark.parametrize("soft", [False, True], ids=["indices", "probabilities"])
def test_the_classification_loss_is_the_hand_written_smoothed_cross_entropy(label_smoothing, soft):
    """The mean over B of -sum_k q_k log p_k, q the label (one-hot, or the given probabilities) smoothed toward the
    uniform: (1 - eps) * q + eps / K; fp32 from bf16 logits."""
    torch.manual_seed(0)
    B, K = 5, 4
    logits = torch.randn(B, K) * 3  # (B, K)
    indices = torch.tensor([0, 3, 1, 1, 2])
    labels = torch.randn(B, K).softmax(-1) if soft else indices  # (B, K) or (B,)
    targets = labels.double().tolist() if soft else [[float(k == i) for k in range(K)] for i in indices.tolist()]
    by_hand = 0.0
    for z, q in zip(logits.double().tolist(), targets):
        by_hand += -sum(((1 - label_smoothing) * q_k + label_smoothing / K) * lp for q_k, lp in zip(q, _log_softmax(z)))
    got = classification_loss(logits, labels, label_smoothing)
    assert got.item() == pytest.approx(by_hand / B, rel=1e-6)
    assert classification_loss(logits.bfloat16(), labels, label_smoothing).dtype == torch.float32
    if label_smoothing == 0.0:  # the default: no smoothing
        assert classification_loss(logits, labels).item() == pytest.approx(by_hand / B, rel=1e-6)


def test_the_soft_target_cross_entropy_is_each_rows_hand_written_cross_entropy():
    """(B,) -sum_k t_k log p_k per row, the targets taken as given (not renormalised, not smoothed), in fp32."""
    torch.manual_seed(1)
    logits = torch.randn(3, 5) * 2  # (B, K)
    targets = torch.tensor([[0.7, 0.3, 0, 0, 0], [0, 0, 0, 0, 1.0], [0.1, 0.2, 0.3, 0.2, 0.1]])  # the last sums to 0.9
    by_hand = [
        -sum(t * lp for t, lp in zip(row, _log_softmax(z)))
        for z, row in zip(logits.double().tolist(), targets.double().tolist())
    ]
    got = soft_target_cross_entropy(logits, targets)
    assert got.shape == (3,)
    assert got.tolist() == pytest.approx(by_hand, rel=1e-6)
    assert soft_target_cross_entropy(logits.bfloat16(), targets).dtype == torch.float32


def test_the_scst_loss_and_its_gradient_are_the_reference_reward_criterion_by_hand():
    # One-step "decoder": each sample's log-probabilities are log softmax(theta_s) over V tokens; by hand,
    # d loss / d theta_s = -(advantage_s / tokens) * (onehot(y_s) - softmax(theta_s)) at each generated token.
    torch.manual_seed(0)
    theta = torch.randn(3, 2, 5, requires_grad=True)  # (S, T, V)
    tokens = torch.tensor([[1, 2], [4, 0], [2, 3]])  # the second sample is one token long (then padding)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    advantage = torch.tensor([0.5, -2.0, 1.5])
    log_probs = theta.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    loss = scst_loss(log_probs, mask, advantage)
    loss.backward()

    p = theta.detach().softmax(-1)
    expected = (
        -sum(
            float(advantage[s]) * math.log(float(p[s, t, tokens[s, t]]))
            for s in range(3)
            for t in range(2)
            if mask[s, t]
        )
        / 5
    )
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    hand = torch.zeros_like(theta)
    for s in range(3):
        for t in range(2):
            if mask[s, t]:
                onehot = torch.nn.functional.one_hot(tokens[s, t], 5).float()
                hand[s, t] = -(advantage[s] / 5) * (onehot - p[s, t])
    torch.testing.assert_close(theta.grad, hand, rtol=1e-5, atol=1e-7)


def test_the_temperatures_are_the_papers():
    """CLIP's initial temperature 1 / 0.07 and its cap 100 (Radford et al. 2021), SigLIP's initial 10 (Zhai et al.
    2023), written as numbers: the log temperatures are what the code keeps."""
    assert math.exp(INIT_LOGIT_SCALE["clip"]) == pytest.approx(14.2857142857, rel=1e-9)
    assert math.exp(INIT_LOGIT_SCALE["siglip"]) == pytest.approx(10.0, rel=1e-12)
    assert math.exp(MAX_LOGIT_SCALE) == pytest.approx(100.0, rel=1e-12)


def test_the_scst_loss_of_one_generated_token_is_its_own_and_of_none_is_zero():
    """The mean over generated tokens: one token is divided by 1, and a batch that generated nothing (every sample
    ended at once) gives 0 and no gradient, never 0 / 0."""
    log_probs = torch.tensor([[-0.5, -2.0], [-1.0, -3.0]], requires_grad=True)
    advantage = torch.tensor([2.0, -1.0])
    one = scst_loss(log_probs, torch.tensor([[1, 0], [0, 0]]), advantage)
    assert one.item() == pytest.approx(-(2.0 * -0.5))
    none = scst_loss(log_probs, torch.zeros(2, 2), advantage)
    none.backward()
    assert none.item() == 0.0 and torch.equal(log_probs.grad, torch.zeros(2, 2))
