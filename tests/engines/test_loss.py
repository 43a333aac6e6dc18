"""The policy losses against cases worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from engines.loss import decoupled_loss, interpolate_prox_logp, policy_loss

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
        ({"over_cap": "clip"}, "over_cap"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs: dict[str, object], match: str) -> None:
    c = _case()
    with pytest.raises(ValueError, match=match):
        policy_loss(c["logp"], c["behaviour"], c["adv"], c["mask"], **kwargs)  # type: ignore[arg-type]


def test_shape_mismatch_is_reported() -> None:
    c = _case()
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(c["logp"], c["behaviour"], torch.zeros(3), c["mask"])


def _two_tokens() -> dict[str, torch.Tensor]:
    """One sample of two tokens, advantage +1 (see the tests below for the hand computation)."""
    prox = torch.tensor([[-1.0, -2.0]])
    return {
        "logp": (prox + torch.tensor([[LN(1.1), LN(1.5)]])).requires_grad_(True),
        "prox": prox,
        "behaviour": prox - torch.tensor([[LN(1.5), LN(3.0)]]),
        "adv": torch.tensor([1.0]),
        "mask": torch.ones(1, 2, dtype=torch.bool),
    }


def test_tis_two_tokens_by_hand() -> None:
    """Truncated IS, clip 0.2, cap 2, ``pi_old`` = the proximal log-probs:

    t0: r = 1.1 (inside the clip):   -1.1 * w, w = 1.5          = -1.65; d/dlogp = -1.65
    t1: r = 1.5 > 1.2, A > 0: -1.2 (clipped, no gradient) * w, w = 3 truncated to 2 = -2.4
    token mean: loss = (-1.65 - 2.4) / 2 = -2.025; grad = [-1.65 / 2, 0] = [-0.825, 0]
    """
    c = _two_tokens()
    out = policy_loss(
        c["logp"], c["behaviour"], c["adv"], c["mask"], old_logp=c["prox"], is_cap=2.0
    )
    assert out.loss.item() == pytest.approx(-2.025, abs=1e-6)
    assert out.metrics["is_weight_mean"] == pytest.approx((1.5 + 2.0) / 2)
    assert out.metrics["is_truncated_frac"] == 0.5 and out.metrics["clip_frac"] == 0.5
    out.loss.backward()
    torch.testing.assert_close(c["logp"].grad, torch.tensor([[-0.825, 0.0]]))


def test_decoupled_two_tokens_by_hand() -> None:
    """Decoupled PPO on the same tokens: r = pi / pi_prox, w = pi_prox / mu, cap 2 drops:

    t0: r = 1.1: -1.1 * w, w = 1.5                       = -1.65; d/dlogp = -1.65
    t1: r = 1.5 clipped to 1.2; w = 3 > 2: dropped, w = 0 =  0   (TIS truncated it: -2.4)
    token mean: loss = -1.65 / 2 = -0.825; grad = [-0.825, 0]
    """
    c = _two_tokens()
    out = decoupled_loss(
        c["logp"], c["behaviour"], c["prox"], c["adv"], c["mask"], clip_eps=0.2, is_cap=2.0
    )
    assert out.loss.item() == pytest.approx(-0.825, abs=1e-6)
    assert out.metrics["is_weight_mean"] == pytest.approx((1.5 + 0.0) / 2)
    assert out.metrics["is_truncated_frac"] == 0.5 and out.metrics["clip_frac"] == 0.5
    out.loss.backward()
    torch.testing.assert_close(c["logp"].grad, torch.tensor([[-0.825, 0.0]]))
    # is_cap=None: no behaviour correction (w = 1), as with TIS: (-1.1 - 1.2) / 2
    c = _two_tokens()
    plain = decoupled_loss(c["logp"], c["behaviour"], c["prox"], c["adv"], c["mask"], is_cap=None)
    assert plain.loss.item() == pytest.approx(-1.15, abs=1e-6)


def test_interpolated_prox_logp_by_hand() -> None:
    """mu = [-1, -3], log pi = [-0.5, -1], proximal version 4, current weights version 6:

    per token, versions [2, 5]: alpha = (4 - 2) / (6 - 2) = 0.5  -> -1 + 0.5 * 0.5 = -0.75
                                alpha = (4 - 5) / (6 - 5) = -1 -> 0: -3 (mu; nothing older)
    per sample, version 3:      alpha = (4 - 3) / (6 - 3) = 1/3 -> [-1 + 0.5/3, -3 + 2/3]
    current weights = proximal (version 4, asyncflow's step): alpha = 1 -> log pi, exactly
    """
    mu = torch.tensor([[-1.0, -3.0]])
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    per_token = interpolate_prox_logp(
        mu, logp, torch.tensor([[2, 5]]), prox_version=4, logp_version=6
    )
    torch.testing.assert_close(per_token, torch.tensor([[-0.75, -3.0]]))
    assert not per_token.requires_grad  # an anchor, never differentiated
    per_sample = interpolate_prox_logp(mu, logp, torch.tensor([3]), prox_version=4, logp_version=6)
    torch.testing.assert_close(per_sample, torch.tensor([[-1.0 + 0.5 / 3, -3.0 + 2.0 / 3]]))
    for v in ([[2, 5]], [[4, 4]], [[-1, 0]]):
        same = interpolate_prox_logp(mu, logp, torch.tensor(v), prox_version=4, logp_version=4)
        torch.testing.assert_close(same, logp.detach())
    with pytest.raises(ValueError, match="versions must be"):
        interpolate_prox_logp(mu, logp, torch.tensor([1, 2, 3]), prox_version=4, logp_version=6)
    with pytest.raises(ValueError, match="newer than logp_version"):
        interpolate_prox_logp(mu, logp, torch.tensor([1]), prox_version=5, logp_version=4)


def test_decoupled_with_interpolated_prox_by_hand() -> None:
    """The interpolation's output as the decoupled objective's anchor (A = +1, cap 2):

    prox = [-0.75, -3] (the case above); r = exp(logp - prox) = [e^0.25, e^2] both > 1.2:
    clipped to 1.2; w = exp(prox - mu) = [e^0.25, 1], both under the cap:
    loss = -1.2 * (e^0.25 + 1) / 2
    """
    mu = torch.tensor([[-1.0, -3.0]])
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    prox = interpolate_prox_logp(mu, logp, torch.tensor([[2, 5]]), prox_version=4, logp_version=6)
    out = decoupled_loss(logp, mu, prox, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
    assert out.loss.item() == pytest.approx(-1.2 * (math.exp(0.25) + 1.0) / 2, abs=1e-6)
    assert out.metrics["clip_frac"] == 1.0
