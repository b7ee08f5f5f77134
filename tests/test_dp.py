"""Client-level DP (fedagent.server.dp_fedavg) and its accountant (fedagent.server.accountant):
clipping, noise drawn from the seed module and replayed bit for bit by ``fedagent verify``, ε from
dp-accounting against published numbers, and the plan-time refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fedagent.core.config as fc
import fedagent.server.dp_fedavg as dp
from fedagent.core.seeds import torch_generator
from fedagent.model.hf_dir import save_model_dir
from fedagent.server import accountant
from fedagent.server.aggregate import AggregateError, aggregate
from fedagent.server.aggregators import RoundContext
from fedagent.server.verify import verify_round
from test_ppo import _with_critic
from workflow_helpers import TEST_CONFIG

SHAPES = {"embed.weight": (37, 16), "layer.0.attn.weight": (16, 16), "layer.0.norm.weight": (16,), "scalar": ()}
CTX = RoundContext(round=3, seed=11, clients_total=8, clients_per_round=3)


def dp_round(tmp_path, m=3, shapes=SHAPES, critic=False):
    """prev and ``m`` fp32 updates whose deltas grow with the client (norms ≈ 0.29, 0.58, 0.88 with SHAPES)."""
    g = torch_generator(5, "dp-test", index=m)
    prev = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    prev_dir = save_model_dir(tmp_path / "prev", prev)
    if critic:
        _with_critic(prev_dir, prev)
    dirs, deltas = [], []
    for i in range(m):
        c = {n: prev[n] + 0.01 * (i + 1) * torch.randn(s, generator=g) for n, s in shapes.items()}
        d = save_model_dir(tmp_path / f"c{i}", c, json_files={"metrics.json": {"client": i}})
        if critic:
            _with_critic(d, c)
        dirs.append(d)
        deltas.append({n: (c[n] - prev[n]).double() for n in shapes})  # the fp32 subtraction aggregate does
    return prev_dir, dirs, deltas


def hp(clip=0.5, noise=1.0, delta=1e-5):
    return {"dp_clip": clip, "dp_noise": noise, "dp_delta": delta}


def run_dp(tmp_path, prev_dir, dirs, hparams, ctx=CTX, weighting="uniform", weights=None, name="agg"):
    out = tmp_path / name
    aggregate(
        prev_dir, dirs, out, weighting=weighting, weights=weights, aggregator="dp_fedavg", hparams=hparams, context=ctx
    )
    return out, json.loads((out / "aggregate.json").read_text())


def clipped_mean(deltas, factors, weights):
    return {n: sum(w * f * d[n] for d, f, w in zip(deltas, factors, weights)) for n in deltas[0]}


def test_clip_to_c_then_the_mean(tmp_path):
    """σ = 0: the weighted mean of the updates scaled to norm ≤ C (numpy's norms); ε is not finite."""
    prev_dir, dirs, deltas = dp_round(tmp_path)
    out, summary = run_dp(tmp_path, prev_dir, dirs, hp(noise=0.0))
    decision = summary["rule"]["decision"]
    norms = [math.sqrt(sum(float((d[n] ** 2).sum()) for n in d)) for d in deltas]
    assert norms[0] < 0.5 < norms[1] < norms[2]  # one client inside the clip, two scaled down
    assert np.allclose(decision["norms"], norms, rtol=1e-6, atol=0)
    assert decision["clip_factors"] == [1.0 if x <= 0.5 else 0.5 / x for x in decision["norms"]]
    assert decision["noise_std"] == 0.0 and decision["epsilon"] is None
    assert summary["round_notes"] == {"dp_epsilon": None, "dp_epsilon_round": None, "dp_delta": 1e-5}
    got = load_file(out / "delta.safetensors")
    want = clipped_mean(deltas, decision["clip_factors"], [1 / 3] * 3)
    for n in SHAPES:
        assert torch.allclose(got[n].double(), want[n], rtol=0, atol=1e-8), n
    clipped = math.sqrt(
        sum(float((sum(f * d[n] for d, f in zip(deltas, decision["clip_factors"])) ** 2).sum()) for n in SHAPES)
    )
    assert clipped <= 3 * 0.5 + 1e-6  # the sum of clipped updates is within M·C
    assert (
        verify_round(prev_dir, dirs, "uniform", out, aggregator="dp_fedavg", hparams=hp(noise=0.0), context=CTX) == []
    )


def test_verify_replays_the_noise_bit_for_bit(tmp_path, monkeypatch):
    """verify draws every noise value aggregate added, identically, from the recorded seed; its tolerance
    holds no noise term, so a changed seed fails. Seen failing on a mutant whose aggregate drew its noise
    from the next round's seed while recording this round's (below), and on verify given another --seed."""
    prev_dir, dirs, _ = dp_round(tmp_path)
    drawn = {"aggregate": {}, "verify": {}}
    real = dp.noise

    def capture(phase):
        def noise(seed, round_, span, std):
            z = real(seed, round_, span, std)
            drawn[phase].setdefault(span.name, []).append(z.clone())
            return z

        return noise

    monkeypatch.setattr(dp, "noise", capture("aggregate"))
    out, summary = run_dp(tmp_path, prev_dir, dirs, hp())
    monkeypatch.setattr(dp, "noise", capture("verify"))
    assert verify_round(prev_dir, dirs, "uniform", out, aggregator="dp_fedavg", hparams=hp(), context=CTX) == []
    for n in SHAPES:
        assert torch.equal(torch.cat(drawn["aggregate"][n]), torch.cat(drawn["verify"][n]).reshape(-1)), n
    decision = summary["rule"]["decision"]
    assert decision["noise_std"] == 1.0 * 0.5 / 3  # σ·C/M
    assert decision["noise_seed"] == {"seed": 11, "purpose": "dp_noise", "round": 3, "block": dp.NOISE_BLOCK}
    monkeypatch.setattr(dp, "noise", real)

    # verify told another seed: the record and the values disagree
    fails = verify_round(
        prev_dir, dirs, "uniform", out, aggregator="dp_fedavg", hparams=hp(), context=RoundContext(3, 12, 8, 3)
    )
    assert any("rule context" in f for f in fails), fails

    # the mutant: noise from round 4's stream, aggregate.json claiming round 3's
    def wrong_stream(seed, purpose, device="cpu", **coords):
        return torch_generator(seed, purpose, device, **{**coords, "round": coords["round"] + 1})

    monkeypatch.setattr(dp, "torch_generator", wrong_stream)
    bad, bad_summary = run_dp(tmp_path, prev_dir, dirs, hp(), name="mutant")
    monkeypatch.setattr(dp, "torch_generator", torch_generator)
    assert bad_summary["rule"] == summary["rule"]  # the same record ...
    fails = verify_round(prev_dir, dirs, "uniform", bad, aggregator="dp_fedavg", hparams=hp(), context=CTX)
    assert len(fails) == len(SHAPES) and all("outside tolerance" in f for f in fails), fails  # ... other noise


def test_the_noise_has_the_stated_std_and_depends_on_the_heaviest_weight(tmp_path):
    shapes = {"w": (64, 64), "b": (300,)}
    prev_dir, dirs, deltas = dp_round(tmp_path, shapes=shapes)
    weights = [0.5, 0.3, 0.2]
    out, summary = run_dp(tmp_path, prev_dir, dirs, hp(clip=0.2, noise=2.0), weighting="weights", weights=weights)
    decision = summary["rule"]["decision"]
    assert decision["noise_std"] == 2.0 * 0.2 * 0.5  # σ·C·max w
    got = load_file(out / "delta.safetensors")
    mean = clipped_mean(deltas, decision["clip_factors"], weights)
    z = torch.cat([(got[n].double() - mean[n]).reshape(-1) for n in shapes])
    assert abs(float(z.std()) / 0.2 - 1) < 0.03 and abs(float(z.mean())) < 0.01
    assert summary["round_notes"]["dp_epsilon"] == pytest.approx(accountant.epsilon(2.0, 8, 3, 3, 1e-5), rel=1e-12)
    assert summary["round_notes"]["dp_epsilon_round"] == pytest.approx(
        accountant.epsilon(2.0, 8, 3, 1, 1e-5), rel=1e-12
    )
    assert (
        verify_round(
            prev_dir,
            dirs,
            "weights",
            out,
            given_weights=weights,
            aggregator="dp_fedavg",
            hparams=hp(0.2, 2.0),
            context=CTX,
        )
        == []
    )


def test_dp_refuses_data_dependent_weights_a_critic_and_a_missing_context(tmp_path):
    prev_dir, dirs, _ = dp_round(tmp_path, critic=True)
    with pytest.raises(fc.ConfigError, match="config key 'aggregate.weighting'.*must not depend on the clients' data"):
        run_dp(tmp_path, prev_dir, dirs, hp(), weighting="samples")
    with pytest.raises(AggregateError, match="critic is trained on the clients' data"):
        run_dp(tmp_path, prev_dir, dirs, hp())
    with pytest.raises(AggregateError, match="needs --round, --seed"):
        run_dp(tmp_path, prev_dir, dirs, hp(), ctx=RoundContext(clients_total=8, clients_per_round=3))
    assert not (tmp_path / "agg").exists()


# ---- the accountant ------------------------------------------------------------------------------

# The orders TF Privacy's compute_dp_sgd_privacy passes to dp-accounting's RdpAccountant
# (tensorflow/privacy, tensorflow_privacy/privacy/analysis/compute_dp_sgd_privacy_lib.py).
TF_ORDERS = [1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5] + list(range(5, 64)) + [128, 256, 512]


@pytest.mark.parametrize(
    ("n", "batch", "sigma", "epochs", "delta", "eps", "order"),
    [
        # tensorflow/privacy, tensorflow_privacy/privacy/analysis/compute_dp_sgd_privacy_test.py,
        # test_compute_dp_sgd_privacy 'Test0' and 'Test1' (ε to 7 places, the optimal RDP order):
        # q = batch/n, steps = ceil(epochs·n/batch), Poisson-sampled Gaussian, add/remove-one.
        (60000, 150, 1.3, 15, 1e-5, 0.7242234026109595, 19.0),
        (100000, 100, 1.0, 30, 1e-7, 1.4154988495444842, 13.0),
    ],
)
def test_the_accountant_gives_the_published_dp_sgd_examples(n, batch, sigma, epochs, delta, eps, order):
    """Seen failing on a mutant composing a single step (PoissonSampledDpEvent not self-composed)."""
    got, got_order = accountant.poisson_epsilon(sigma, batch / n, math.ceil(epochs * n / batch), delta, TF_ORDERS)
    assert got == pytest.approx(eps, abs=5e-8) and got_order == order


def test_the_run_accountant_is_fixed_size_sampling_with_replace_one_sensitivity():
    """M = N (every client every round): the Gaussian mechanism at σ/2 (replacing a client moves the
    clipped sum by 2C), composed over the rounds; a random M of N is cheaper, more rounds dearer. Seen
    failing on a mutant passing σ, not σ/2, to the Gaussian event."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    for sigma, rounds in [(1.0, 1), (2.0, 5), (4.0, 20)]:
        acc = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma / 2), rounds))
        assert accountant.epsilon(sigma, 8, 8, rounds, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert accountant.epsilon(2.0, 8, 4, 5, 1e-5) < accountant.epsilon(2.0, 8, 8, 5, 1e-5)
    assert accountant.epsilon(2.0, 8, 4, 5, 1e-5) < accountant.epsilon(2.0, 8, 4, 6, 1e-5)
    assert accountant.epsilon(2.0, 8, 4, 0, 1e-5) == 0.0 and math.isinf(accountant.epsilon(0.0, 8, 4, 1, 1e-5))
    need = accountant.min_noise(8.0, 8, 4, 2, 1e-5)
    assert accountant.epsilon(need, 8, 4, 2, 1e-5) <= 8.0 < accountant.epsilon(need * 0.99, 8, 4, 2, 1e-5)


def test_the_accountant_composes_each_setting_once_per_process(monkeypatch):
    """ε is kept per argument set: a plan that checks the same DP arm again (a matrix's seeds, its run's
    module) gets the same value without the library's RDP composition again. Seen failing without the
    cache (2 compositions for 2 calls)."""
    from dp_accounting.rdp import RdpAccountant

    composed = []
    compose = RdpAccountant.compose

    def counted(self, event, *args, **kwargs):
        composed.append(event)
        return compose(self, event, *args, **kwargs)

    monkeypatch.setattr(RdpAccountant, "compose", counted)
    accountant.epsilon.cache_clear()
    first = accountant.epsilon(1.61, 8, 4, 2, 1e-5)
    assert accountant.epsilon(1.61, 8, 4, 2, 1e-5) == first and len(composed) == 1
    assert accountant.epsilon(1.61, 8, 4, 3, 1e-5) > first and len(composed) == 2  # another setting: its own


def dp_config(**overrides) -> dict:
    cfg = fc.load_config(TEST_CONFIG)
    fc.set_path(cfg, "aggregate.aggregator", "dp_fedavg")
    fc.set_path(cfg, "aggregate.dp_clip", 1.0)
    for k, v in overrides.items():
        fc.set_path(cfg, k.replace("__", "."), v)
    return cfg


def test_planning_refuses_a_noise_too_small_for_the_target_naming_the_key():
    need = accountant.min_noise(5.0, 2, 2, 3, 1e-5)
    with pytest.raises(fc.ConfigError, match="config key 'aggregate.dp_noise'") as err:
        fc.prepare_config(dp_config(aggregate__dp_noise=need * 0.9, aggregate__dp_target_epsilon=5.0))
    assert f"set aggregate.dp_noise ≥ {need:g}" in str(err.value) and "over rounds=3" in str(err.value)
    fc.prepare_config(dp_config(aggregate__dp_noise=need, aggregate__dp_target_epsilon=5.0))
    with pytest.raises(fc.ConfigError, match="config key 'aggregate.dp_clip'"):
        cfg = dp_config()
        cfg["aggregate"]["dp_clip"] = None
        fc.prepare_config(cfg)


def test_the_matrix_table_carries_each_arms_final_epsilon(tmp_path):
    """A DP arm's ε after its last round reaches table.csv and table.md (another matrix's table keeps
    its columns). Seen failing on a mutant reading round 1's ε instead of the last round's."""
    from fedagent.report.matrix_table import TABLE_COLUMNS, build_table, markdown

    def summary(name, eps):
        rows = ["round,model,n,success_rate,dp_delta,dp_epsilon"]
        rows += [
            f"{r},{'base' if r == 0 else 'aggregated'},10,0.{r},{'' if r == 0 else 1e-5},{e}" for r, e in enumerate(eps)
        ]
        (tmp_path / name).write_text("\n".join(rows) + "\n")
        return str(tmp_path / name)

    (tmp_path / "a.csv").write_text(
        "round,model,n,success_rate\n0,base,10,0.0\n1,aggregated,10,0.1\n2,aggregated,10,0.2\n"
    )
    runs = [
        {"arm": "nonprivate", "seed": 1, "summary": str(tmp_path / "a.csv")},  # neither column
        {"arm": "dp", "seed": 1, "summary": summary("b.csv", ["", 5.5, 7.93])},
        {"arm": "clip", "seed": 1, "summary": summary("c.csv", ["", "", ""])},
    ]
    table, _ = build_table(runs, "nonprivate")
    assert list(table.columns) == TABLE_COLUMNS + ["dp_epsilon", "dp_delta"]
    assert table.set_index("arm").loc["dp", "dp_epsilon"] == 7.93
    md = markdown(table, "m", "nonprivate")
    assert "- dp: ε = 7.93 at δ = 1e-05" in md and "- clip: no finite ε (no noise) at δ = 1e-05" in md
    assert "nonprivate: " not in md.split("Client-level DP")[1]
    plain, _ = build_table(runs[:1], "nonprivate")
    assert list(plain.columns) == TABLE_COLUMNS
