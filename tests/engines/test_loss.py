"""The policy loss against a case worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from engines.loss import policy_loss

LN = math.log


def _case() -> dict[str, torch.Tensor]:
    # Two samples, T = 3; sample 0 has 2 valid tokens (column 2 is padding with garbage values).
    old = torch.tensor([[-1.0, -2.0, -50.0], [-1.0, -1.5, -0.5]])
    log_r = torch.tensor([[LN(1.5), LN(1.1), 100.0], [LN(0.5), 0.0, LN(1.3)]])
    # behaviour = old - log(w):  w = 3 (truncated to 2), 1.5 | 1, 0.5, 1
    log_w = torch.tensor([[LN(3.0), LN(1.5), 80.0], [0.0, LN(0.5), 0.0]])
    logp = (old + log_r).requires_grad_(True)
    ref = logp.detach().clone()
    ref[1, 1] += LN(2.0)  # one token with ref - logp = ln 2: k3 = 2 - ln 2 - 1
    return {
        "logp": logp,
        "old": old,
        "behaviour": old - log_w,
        "ref": ref,
        "adv": torch.tensor([1.0, -0.5]),
        "mask": torch.tensor([[True, True, False], [True, True, True]]),
    }


def test_policy_loss_matches_hand_computation() -> None:
    c = _case()
    out = policy_loss(
        c["logp"],
        c["behaviour"],
        c["adv"],
        c["mask"],
        old_logp=c["old"],
        clip_eps=0.2,
        is_cap=2.0,
        ref_logp=c["ref"],
        kl_coef=0.1,
        loss_scale=0.5,
    )
    # Sample 0 (A = +1):
    #   t0: r = 1.5 > 1.2, clipped: -min(1.5, 1.2) = -1.2; w = 3 -> 2      => -2.4
    #   t1: r = 1.1:                -1.1;               w = 1.5             => -1.65
    #   token mean = -2.025
    # Sample 1 (A = -0.5):
    #   t0: r = 0.5 < 0.8, clipped: -min(-0.25, -0.4) = 0.4; w = 1          => 0.4
    #   t1: r = 1: 0.5; w = 0.5 => 0.25, plus KL 0.1 * (1 - ln 2)           => 0.25 + 0.0307
    #   t2: r = 1.3 > 1.2 but A < 0, not clipped: -min(-0.65, -0.6) = 0.65 => 0.65
    #   token mean = (1.3 + 0.1 * (1 - ln 2)) / 3
    kl = 1.0 - LN(2.0)
    expected = 0.5 * (-2.025 + (1.3 + 0.1 * kl) / 3)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.num_tokens == 5
    m = out.metrics
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["clip_frac_high"] == pytest.approx(1 / 5)
    assert m["clip_frac_low"] == pytest.approx(1 / 5)
    assert m["is_truncated_frac"] == pytest.approx(1 / 5)
    assert m["is_weight_mean"] == pytest.approx((2 + 1.5 + 1 + 0.5 + 1) / 5)
    assert m["kl"] == pytest.approx(kl / 5, abs=1e-6)

    out.loss.backward()
    grad = c["logp"].grad
    assert grad is not None and torch.isfinite(grad).all()
    # d loss / d logp_t = loss_scale / n_i * (w * -A * r [if unclipped] + kl_coef * (1 - e^d)).
    expected_grad = torch.tensor(
        [
            [0.0, 0.5 / 2 * (1.5 * -1.0 * 1.1), 0.0],
            [0.0, 0.5 / 3 * (0.5 * 0.5 * 1.0 - 0.1 * (2.0 - 1.0)), 0.5 / 3 * (0.5 * 1.3)],
        ]
    )
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-5)
    # Gradient descent raises the log-prob of the positive-advantage token, lowers the others.
    assert grad[0, 1] < 0 and grad[1, 1] > 0 and grad[1, 2] > 0


def test_default_old_logp_is_on_policy() -> None:
    c = _case()
    out = policy_loss(c["logp"], c["logp"].detach(), c["adv"], c["mask"], is_cap=2.0)
    # r = 1 and w = 1 everywhere: loss = -sum_i A_i, gradient = -A_i / n_i on valid tokens.
    assert out.loss.item() == pytest.approx(-(1.0 - 0.5))
    assert out.metrics["clip_frac"] == 0.0 and out.metrics["is_weight_mean"] == 1.0
    out.loss.backward()
    expected = torch.tensor([[-0.5, -0.5, 0.0], [0.5 / 3, 0.5 / 3, 0.5 / 3]])
    torch.testing.assert_close(c["logp"].grad, expected)


def test_no_is_correction_and_asymmetric_clip() -> None:
    c = _case()
    out = policy_loss(
        c["logp"],
        c["behaviour"],
        c["adv"],
        c["mask"],
        old_logp=c["old"],
        clip_eps=0.2,
        clip_eps_high=0.6,
        is_cap=None,
    )
    # w = 1; sample 0: r = 1.5 < 1.6 is no longer clipped: (-1.5 - 1.1) / 2.
    expected = -2.6 / 2 + (0.4 + 0.5 + 0.65) / 3
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.metrics["clip_frac_high"] == 0.0


def test_constant_sequence_norm_removes_the_length_weighting() -> None:
    c = _case()
    kwargs = dict(old_logp=c["old"], clip_eps=0.2, is_cap=2.0, loss_scale=0.5)
    out = policy_loss(c["logp"], c["behaviour"], c["adv"], c["mask"], seq_norm=4.0, **kwargs)
    # Same per-token terms as the hand case (no KL): token sums -4.05 and 1.3, each / 4.
    assert out.loss.item() == pytest.approx(0.5 * (-4.05 + 1.3) / 4, abs=1e-6)
    out.loss.backward()
    grad = c["logp"].grad
    assert grad is not None
    # Every valid token's gradient is scaled by 1/4, whatever its sequence's length.
    assert grad[0, 1].item() == pytest.approx(0.5 / 4 * (1.5 * -1.0 * 1.1))
    assert grad[1, 2].item() == pytest.approx(0.5 / 4 * (0.5 * 1.3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kl_coef": 0.1}, "needs ref_logp"),
        ({"clip_eps": 0.0}, "clip_eps"),
        ({"is_cap": 0.0}, "is_cap"),
        ({"seq_norm": 0.0}, "seq_norm"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs: dict[str, float], match: str) -> None:
    c = _case()
    with pytest.raises(ValueError, match=match):
        policy_loss(c["logp"], c["behaviour"], c["adv"], c["mask"], **kwargs)  # type: ignore[arg-type]


def test_shape_mismatch_is_reported() -> None:
    c = _case()
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(c["logp"], c["behaviour"], torch.zeros(3), c["mask"])
