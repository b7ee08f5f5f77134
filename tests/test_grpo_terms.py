"""Every GRPO loss term pinned against a hand computation (issue 11, must-show 1).

The expected loss and gradient are written out from the formulas, on plain unpadded forward
passes of a tiny model at the sampling temperature, independently of ``fedagent.train``:

    loss = mean over response tokens of  max(-A·r, -A·clip(r, 1-ε, 1+ε))
                                         + β · (exp(ref - logp) - (ref - logp) - 1)
                                         - c · H
    r = exp(logp - old),  logp/old/ref/H all from softmax(logits / T)

Each test is seen failing on a named broken variant of the code (see the commit messages):
KL sign flipped, ratio taken against the reference log-probs, entropy sign flipped, log-probs
computed at T=1 while sampling at T≠1.
"""

from __future__ import annotations

import math

import pytest
import torch

from fake_env import build_tiny_model
from fedagent.model.policy import load_policy
from fedagent.core.seeds import python_rng
from fedagent.train import grpo
from fedagent.train.local import TrainParams
from fedagent.train.actor import grpo_epoch


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_terms") / "m", seed=7)


def test_token_terms_match_numbers_worked_by_hand():
    # One token: p = 0.5 now, 0.4 when sampled, 0.6 under the reference; A = 2, ε = 0.2.
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    old, ref = torch.tensor([math.log(0.4)]), torch.tensor([math.log(0.6)])
    ent = torch.tensor([0.7], requires_grad=True)
    loss, st = grpo.grpo_token_terms(
        logp, old, ref, torch.tensor([2.0]), clip=0.2, kl_coef=0.5, entropy_coef=0.1, entropy=ent
    )
    # ratio 0.5/0.4 = 1.25 → clipped to 1.2: pg = max(-2.5, -2.4) = -2.4
    # k3 = 0.6/0.5 - ln(0.6/0.5) - 1 = 0.2 - ln 1.2;  loss = -2.4 + 0.5·k3 - 0.1·0.7
    k3 = 0.2 - math.log(1.2)
    assert float(st["ratio"]) == pytest.approx(1.25, rel=1e-6)
    assert float(st["kl"]) == pytest.approx(k3, rel=1e-5)
    assert float(loss) == pytest.approx(-2.4 + 0.5 * k3 - 0.07, rel=1e-6)
    loss.sum().backward()
    # d/dlogp: the clipped branch is constant; the k3 term gives β·(1 - exp(ref - logp)) = 0.5·(1 - 1.2)
    assert float(logp.grad) == pytest.approx(0.5 * (1 - 1.2), rel=1e-5)
    assert float(ent.grad) == pytest.approx(-0.1)
    # Inside the clip range the policy-gradient term is -A·r: d/dlogp = -A·r.
    logp2 = torch.tensor([math.log(0.42)], requires_grad=True)
    loss2, _ = grpo.grpo_token_terms(logp2, old, None, torch.tensor([2.0]), clip=0.2, kl_coef=0.5)
    loss2.sum().backward()
    assert float(loss2) == pytest.approx(-2.0 * 0.42 / 0.4, rel=1e-6)
    assert float(logp2.grad) == pytest.approx(-2.0 * 0.42 / 0.4, rel=1e-5)


def _samples():
    out = [
        grpo.Sample([5, 6, 7, 8], [40, 41, 42], 1.0, 0, advantage=1.3),
        grpo.Sample([5, 9], [50, 51], 0.0, 0, advantage=-0.8),
        grpo.Sample([11, 12, 13], [60, 61, 62, 63], 0.5, 0, advantage=0.4),
    ]
    return out


def _hand_loss(model, ref, samples, *, T, clip, beta, c):
    """The loss of the first mini-batch written out from the formulas (autograd only for ∇)."""
    terms = []
    for s in samples:
        full = torch.tensor([s.prompt_ids + s.response_ids])
        n = len(s.prompt_ids)
        lp_all = torch.log_softmax(model(input_ids=full).logits[0].float() / T, -1)
        with torch.no_grad():
            ref_all = torch.log_softmax(ref(input_ids=full).logits[0].float() / T, -1)
        for k, tok in enumerate(s.response_ids):
            row = n - 1 + k
            logp = lp_all[row, tok]
            old = logp.detach()  # behaviour = the policy before this first step
            r = torch.exp(logp - old)
            a = s.advantage
            pg = torch.maximum(-a * r, -a * torch.clamp(r, 1 - clip, 1 + clip))
            d = ref_all[row, tok] - logp
            kl = torch.exp(d) - d - 1
            h = -(lp_all[row].exp() * lp_all[row]).sum()
            terms.append(pg + beta * kl - c * h)
    return torch.stack(terms).mean()


@pytest.mark.parametrize("T", [0.6, 1.0])
def test_first_step_loss_and_gradient_equal_the_hand_computation(tiny_dir, T):
    """grpo_epoch's loss and gradient = the hand formula (behaviour, current, ref, H all at T).

    The reference differs from the policy, so taking the ratio against the reference log-probs
    (instead of the behaviour ones) moves the ratio off 1 and changes loss and gradient; a
    flipped KL or entropy sign changes them by 2β∇KL or 2c∇H; log-probs at T=1 while the
    rollout sampled at T≠1 change every term.
    """
    beta, c, clip = 0.4, 0.05, 0.2
    samples = _samples()
    model, _ = load_policy(tiny_dir, threads=1)
    ref, _ = load_policy(tiny_dir, threads=1)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for q in ref.parameters():
            q.add_(0.01 * torch.randn(q.shape, generator=g))
    p = TrainParams(
        temperature=T,
        kl_coef=beta,
        entropy_coef=c,
        clip=clip,
        mini_batch_size=len(samples),
        micro_batch_size=2,
        grad_clip=1e9,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the step leaves the weights: grads stay readable
    steps = grpo_epoch(model, ref, opt, samples, p, python_rng(0, "t"), 0)
    got = {n: q.grad.detach().clone() for n, q in model.named_parameters()}

    hand_model, _ = load_policy(tiny_dir, threads=1)
    want_loss = _hand_loss(hand_model, ref, samples, T=T, clip=clip, beta=beta, c=c)
    want_loss.backward()
    assert steps[0]["loss"] == pytest.approx(float(want_loss), rel=1e-5, abs=1e-6)
    for n, q in hand_model.named_parameters():  # float32 sums in another order: 1e-4 of the norm
        assert float((got[n] - q.grad).norm()) <= 1e-4 * float(q.grad.norm()) + 1e-8, n
    # The KL term is live (reference differs) and the behaviour ratio is exactly 1 on a first step.
    assert steps[0]["kl"] > 1e-4


def test_logprobs_are_those_of_the_tempered_sampling_distribution(tiny_dir):
    """At T≠1 the scored log-prob of a sampled token is log softmax(logits/T), what sample() drew from."""
    from fedagent.model.policy import sample

    model, tok = load_policy(tiny_dir, threads=1)
    prompt = [5, 6, 7, 8]
    T = 0.5
    gen = sample(model, tok, [prompt], max_new_tokens=3, temperature=T, generator=torch.Generator().manual_seed(1))[0]
    s = grpo.Sample(prompt, gen.response_ids, 0.0, 0)
    with torch.no_grad():
        got, ent = grpo.response_logprobs(model, [s], temperature=T, with_entropy=True)
        full = torch.tensor([prompt + gen.response_ids])
        lp = torch.log_softmax(model(input_ids=full).logits[0].float() / T, -1)
    n = len(prompt)
    want = torch.stack([lp[n - 1 + k, t] for k, t in enumerate(gen.response_ids)])
    want_h = torch.stack([-(lp[n - 1 + k].exp() * lp[n - 1 + k]).sum() for k in range(len(gen.response_ids))])
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(ent, want_h, atol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        grpo.response_logprobs(model, [s], temperature=0.0)


def test_masked_tokens_are_context_not_targets(tiny_dir):
    """A concat sample's response_mask 0 tokens condition the next tokens but get no log-prob."""
    model, _ = load_policy(tiny_dir, threads=1)
    s = grpo.Sample([5, 6], [40, 41, 30, 31, 42], 1.0, 0, response_mask=[1, 1, 0, 0, 1])
    with torch.no_grad():
        got, _ = grpo.response_logprobs(model, [s], temperature=1.0)
        lp = torch.log_softmax(model(input_ids=torch.tensor([[5, 6, 40, 41, 30, 31, 42]])).logits[0].float(), -1)
    assert torch.allclose(got, torch.stack([lp[1, 40], lp[2, 41], lp[5, 42]]), atol=1e-5)
    assert s.trained_count() == 3 and grpo.token_advantages([s]).shape == (3,)


# ---- dual-clip (issue 31, must-show 1) ---------------------------------------------------------


def test_dual_clip_minimal_case_is_verls_number():
    """p = 0.8, p_old = 0.2 (ratio 4), A = −1, ε = 0.2: verl's vanilla loss caps the token at
    −A·c = 3.0 (and passes no gradient); without the cap it is −A·r = 4.0 with gradient 4."""
    logp = torch.tensor([math.log(0.8)], requires_grad=True)
    loss, st = grpo.grpo_token_terms(
        logp, torch.tensor([math.log(0.2)]), None, torch.tensor([-1.0]), clip=0.2, kl_coef=0.0, clip_ratio_c=3.0
    )
    assert float(loss) == pytest.approx(3.0, rel=1e-6) and float(st["dual_clipped"]) == 1.0
    loss.sum().backward()
    assert float(logp.grad) == 0.0
    off = torch.tensor([math.log(0.8)], requires_grad=True)
    loss_off, st_off = grpo.grpo_token_terms(
        off, torch.tensor([math.log(0.2)]), None, torch.tensor([-1.0]), clip=0.2, kl_coef=0.0, clip_ratio_c=None
    )
    loss_off.sum().backward()
    assert float(loss_off) == pytest.approx(4.0, rel=1e-6) and float(off.grad) == pytest.approx(4.0, rel=1e-6)
    assert float(st_off["dual_clipped"]) == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        grpo.grpo_token_terms(off, off.detach(), None, torch.tensor([-1.0]), clip=0.2, kl_coef=0.0, clip_ratio_c=1.0)


def _hand_token(r: float, a: float, eps: float, c: float | None) -> tuple[float, float]:
    """One token's policy loss and d loss / d logp (r = exp(logp − old), so dr/dlogp = r), by cases."""
    if a >= 0:
        # max(−A·r, −A·clip(r)): the unclipped branch wins while r ≤ 1 + ε
        return (-a * r, -a * r) if r <= 1 + eps else (-a * (1 + eps), 0.0)
    # A < 0: max(−A·r, −A·clip(r)) = −A·max(r, 1 − ε); then min with −A·c
    base = (-a * r, -a * r) if r >= 1 - eps else (-a * (1 - eps), 0.0)
    if c is not None and base[0] > -a * c:
        return -a * c, 0.0
    return base


@pytest.mark.parametrize("c", [3.0, 2.5, None])
def test_dual_clip_loss_and_gradient_equal_the_hand_computation(c):
    """A mini-batch of 12 tokens whose ratios span both clip edges and the cap: the token-mean loss
    and its gradient w.r.t. each log-prob are the case-by-case hand values (seen failing on the
    code without the cap: the four A < 0 tokens with r > c then carry −A·r and gradient −A·r)."""
    ratios = [0.5, 0.9, 1.0, 1.1, 1.3, 2.0, 2.8, 3.2, 4.0, 6.0, 0.7, 3.5]
    advs = [1.0, -0.5, 0.8, -1.2, 1.5, -0.7, -1.0, -0.9, -1.0, -2.0, -1.3, 0.6]
    eps = 0.2
    old = torch.tensor([math.log(0.1 + 0.05 * k) for k in range(len(ratios))])
    logp = (old + torch.log(torch.tensor(ratios))).detach().requires_grad_(True)
    terms, st = grpo.grpo_token_terms(logp, old, None, torch.tensor(advs), clip=eps, kl_coef=0.0, clip_ratio_c=c)
    loss = terms.sum() / len(ratios)
    loss.backward()
    hand = [_hand_token(r, a, eps, c) for r, a in zip(ratios, advs)]
    assert float(loss) == pytest.approx(sum(h[0] for h in hand) / len(hand), rel=1e-6)
    assert logp.grad.tolist() == pytest.approx([h[1] / len(hand) for h in hand], rel=1e-5, abs=1e-7)
    capped = [a < 0 and c is not None and -a * max(r, 1 - eps) > -a * c for r, a in zip(ratios, advs)]
    assert st["dual_clipped"].tolist() == [float(x) for x in capped]
    if c == 3.0:
        assert sum(capped) == 3  # r = 3.2, 4.0, 6.0 under A < 0 (r = 3.5 has A > 0: the ε clip, not the cap)


def test_actor_step_carries_the_dual_clip(tiny_dir):
    """update_step (the GRPO and PPO actor's step) with behaviour log-probs set so that some
    A < 0 tokens have ratio > c: loss and gradient = the hand formula with the cap (train.clip_ratio_c
    reaches the loss; seen failing with the actor not passing it, i.e. the loss without the cap)."""
    from fedagent.train.actor import token_slices, update_step

    beta, clip, c = 0.0, 0.2, 3.0
    samples = _samples()
    model, _ = load_policy(tiny_dir, threads=1)
    p = TrainParams(
        temperature=1.0,
        kl_coef=beta,
        entropy_coef=0.0,
        clip=clip,
        clip_ratio_c=c,
        mini_batch_size=len(samples),
        micro_batch_size=2,
        grad_clip=1e9,
    )
    with torch.no_grad():
        cur, _ = grpo.response_logprobs(model, samples, temperature=1.0)
    # ratio per token: the A < 0 sample (index 1, two tokens) gets 4 and 5: both past the cap.
    ratios = torch.tensor([1.1, 0.7, 1.4, 4.0, 5.0, 0.9, 1.0, 1.15, 2.0])
    old = cur - torch.log(ratios)
    adv = grpo.token_advantages(samples)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    params = [q for q in model.parameters() if q.requires_grad]
    rec = update_step(model, opt, samples, list(range(len(samples))), old, None, adv, token_slices(samples), p, params)
    got = {n: q.grad.detach().clone() for n, q in model.named_parameters()}

    hand_model, _ = load_policy(tiny_dir, threads=1)
    terms, k = [], 0
    for s in samples:
        full = torch.tensor([s.prompt_ids + s.response_ids])
        lp_all = torch.log_softmax(hand_model(input_ids=full).logits[0].float(), -1)
        for j, tok in enumerate(s.response_ids):
            r = torch.exp(lp_all[len(s.prompt_ids) - 1 + j, tok] - old[k])
            a = s.advantage
            pg = torch.maximum(-a * r, -a * torch.clamp(r, 1 - clip, 1 + clip))
            if a < 0:
                pg = torch.minimum(pg, torch.tensor(-a * c))
            terms.append(pg)
            k += 1
    want = torch.stack(terms).mean()
    want.backward()
    assert float(rec[2][:, 0].sum()) == pytest.approx(float(want), rel=1e-5)
    uncapped = float(want) + sum(0.8 * (float(r) - c) for r in ratios[3:5]) / len(ratios)
    assert abs(float(rec[2][:, 0].sum()) - uncapped) > 1e-3  # the cap changed the loss
    for n, q in hand_model.named_parameters():
        assert float((got[n] - q.grad).norm()) <= 1e-4 * float(q.grad.norm()) + 1e-8, n
