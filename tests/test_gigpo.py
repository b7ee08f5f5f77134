"""GiGPO (train.algorithm: gigpo): advantages pinned by hand, the estimator seam, a local round."""

from __future__ import annotations

import hashlib
import json
import random
import statistics

import pytest

from fake_env import TINY_TRAIN, FakeEnv
from fedagent.core import config as fc
from fedagent.rollout.episode import Trajectory, Turn
from fedagent.train import advantages, grpo
from fedagent.train.local import TrainParams, train_client


def _z(values):
    """(v − mean) / (stdev + 1e-6) of a hand-listed group (unbiased stdev, as torch.std)."""
    m, s = statistics.mean(values), statistics.stdev(values)
    return [(v - m) / (s + 1e-6) for v in values]


def _sample(group, anchor, rewards_to_go, episode_return, valid=True):
    penalty = 0.0 if valid else 0.1
    return grpo.Sample(
        prompt_ids=[1],
        response_ids=[2],
        reward=episode_return - penalty,
        group=group,
        anchor=anchor,
        rewards_to_go=tuple(rewards_to_go),
        penalty=penalty,
    )


def _batch():
    """Two tasks (groups 0 and 1). Observation "s0" opens every episode of both tasks (the same text
    in two tasks: never one step group); "s1" is reached by two rollouts of task 0, one of them twice
    (its invalid answer left the state as it was)."""
    return [
        # group 0, episode 0: s0 → s1 → s2, wins on its third turn (return 10)
        _sample(0, "s0", [0, 0, 10], 10),
        _sample(0, "s1", [0, 10], 10),
        _sample(0, "s2", [10], 10),
        # group 0, episode 1: s0 → s1 (invalid answer: a no-op) → s1, never wins
        _sample(0, "s0", [0, 0, 0], 0),
        _sample(0, "s1", [0, 0], 0, valid=False),
        _sample(0, "s1", [0], 0),
        # group 0, episode 2: s0 → s3, wins on its second turn
        _sample(0, "s0", [0, 10], 10),
        _sample(0, "s3", [10], 10),
        # group 1, episode 3: s0 → s4, never wins
        _sample(1, "s0", [0, 0], 0),
        _sample(1, "s4", [0], 0),
        # group 1, episode 4: s0 → s4, wins on its second turn
        _sample(1, "s0", [0, 10], 10),
        _sample(1, "s4", [10], 10),
    ]


def _hand(step_weight=1.0):
    """The advantages of :func:`_batch` at γ = 0.5, mode mean_std_norm, computed by hand."""
    # Episode level: every per-turn sample of a group, its episode's return less its own penalty.
    e0 = _z([10, 10, 10, 0, -0.1, 0, 10, 10])
    e1 = _z([0, 0, 10, 10])
    episode = e0 + e1
    # Step level: discounted returns G_t = r_t + 0.5 r_{t+1} + 0.25 r_{t+2} less the turn's penalty.
    #   group 0, s0: episodes 0, 1, 2 at turn 0: 0.25·10 = 2.5, 0, 0.5·10 = 5
    #   group 0, s1: episode 0 turn 1 (0.5·10 = 5), episode 1 turn 1 (0 − 0.1), episode 1 turn 2 (0)
    #   group 0, s2 and s3: one step each → 0
    #   group 1, s0: episodes 3, 4 at turn 0: 0, 0.5·10 = 5;  group 1, s4: 0, 10
    s0a, s0b, s0c = _z([2.5, 0.0, 5.0])
    s1a, s1b, s1c = _z([5.0, -0.1, 0.0])
    t0a, t0b = _z([0.0, 5.0])
    t4a, t4b = _z([0.0, 10.0])
    step = [s0a, s1a, 0.0, s0b, s1b, s1c, s0c, 0.0, t0a, t4a, t0b, t4b]
    return [e + step_weight * s for e, s in zip(episode, step)]


def test_gigpo_advantages_match_a_hand_computation():
    samples = _batch()
    stats = advantages.estimator("gigpo", {"gamma": 0.5, "step_weight": 1.0}).assign(samples)
    assert [s.advantage for s in samples] == pytest.approx(_hand(), rel=1e-12, abs=1e-12)
    # step groups: (0,s0) 3, (0,s1) 3, (0,s2) 1, (0,s3) 1, (1,s0) 2, (1,s4) 2
    assert stats == {
        "step_groups": 6,
        "step_groups_shared": 4,
        "steps_in_shared_groups": 10,
        "steps_nonzero_step_advantage": 9,  # the shared ten less episode 0's first step (2.5, its group's mean)
    }
    # The step term matters here: GRPO's advantages (the episode term alone) differ.
    grpo_samples = _batch()
    advantages.estimator("grpo").assign(grpo_samples)
    assert [s.advantage for s in grpo_samples] != pytest.approx(_hand(), rel=1e-6)


def test_gigpo_step_weight_scales_the_step_term_and_zero_is_grpo():
    half = _batch()
    advantages.estimator("gigpo", {"gamma": 0.5, "step_weight": 0.5}).assign(half)
    assert [s.advantage for s in half] == pytest.approx(_hand(0.5), rel=1e-12, abs=1e-12)
    zero, ref = _batch(), _batch()
    advantages.estimator("gigpo", {"gamma": 0.5, "step_weight": 0.0}).assign(zero)
    advantages.estimator("grpo").assign(ref)
    assert [s.advantage for s in zero] == [s.advantage for s in ref]  # bit for bit


def test_gigpo_mean_norm_subtracts_the_means_only():
    samples = _batch()
    advantages.estimator("gigpo", {"gamma": 0.5, "mode": "mean_norm"}).assign(samples)
    e0, e1 = statistics.mean([10, 10, 10, 0, -0.1, 0, 10, 10]), statistics.mean([0, 0, 10, 10])
    g0s0, g0s1 = statistics.mean([2.5, 0.0, 5.0]), statistics.mean([5.0, -0.1, 0.0])
    expect = [
        10 - e0 + 2.5 - g0s0,
        10 - e0 + 5.0 - g0s1,
        10 - e0,
        0 - e0 + 0.0 - g0s0,
        -0.1 - e0 + -0.1 - g0s1,
        0 - e0 + 0.0 - g0s1,
        10 - e0 + 5.0 - g0s0,
        10 - e0,
        0 - e1 + 0 - 2.5,
        0 - e1 + 0 - 5.0,
        10 - e1 + 5.0 - 2.5,
        10 - e1 + 10 - 5.0,
    ]
    assert [s.advantage for s in samples] == pytest.approx(expect, rel=1e-12, abs=1e-12)


def test_gigpo_is_deterministic_and_independent_of_sample_order():
    a, b = _batch(), _batch()
    est = advantages.estimator("gigpo", {"gamma": 0.5})
    est.assign(a)
    est.assign(b)
    assert [s.advantage for s in a] == [s.advantage for s in b]
    order = list(range(len(a)))
    random.Random(7).shuffle(order)
    shuffled = [_batch()[i] for i in order]
    est.assign(shuffled)  # exact sums (math.fsum): the same bits in any order
    assert [s.advantage for s in shuffled] == [a[i].advantage for i in order]


def test_gigpo_refuses_samples_without_an_observation():
    s = _batch()
    s[3].anchor = None
    with pytest.raises(ValueError, match="rollout.mode windowed"):
        advantages.estimator("gigpo").assign(s)


def test_turn_samples_carry_the_anchor_and_the_rewards_from_the_turn_on():
    def turn(obs, reward, valid=True):
        return Turn(prompt_ids=[1], response_ids=[2], text="", action="", valid=valid, reward=reward, observation=obs)

    t = Trajectory("a", "x", 0, turns=[turn("o0", 0.0), turn("o1", 0.0, valid=False), turn("o1", 10.0)])
    t.episode_return = 10.0
    s = grpo.turn_samples([t], [3], invalid_penalty=0.1)
    assert [(x.anchor, x.rewards_to_go, x.penalty, x.reward) for x in s] == [
        ("o0", (0.0, 0.0, 10.0), 0.0, 10.0),
        ("o1", (0.0, 10.0), 0.1, 9.9),
        ("o1", (10.0,), 0.0, 10.0),
    ]
    assert "observation" not in t.summary()["turns"][0]  # samples.jsonl keeps its bytes


# --------------------------------------------------------------------------- the seam and the config
def _cfg(overrides):
    """A config whose epoch shape suits every case below (4 groups × 4 rollouts, mini-batches of 4)."""
    out = {"train": {"groups_per_epoch": 4, "group_size": 4, "mini_batch_size": 4}}
    for section, values in overrides.items():
        out.setdefault(section, {}).update(values)
    return out


def test_the_registry_gives_train_algorithm_its_choices_and_gigpo_its_keys():
    assert list(advantages.ADVANTAGE_ESTIMATORS) == ["grpo", "gigpo", "ppo"]
    assert fc.subschema("train.algorithm")["enum"] == ["grpo", "gigpo", "ppo"]
    assert fc.subschema("train.gigpo.gamma")["default"] == 0.95
    assert fc.subschema("train.gigpo.step_weight")["default"] == 1.0
    assert fc.subschema("train.gigpo.mode")["enum"] == ["mean_std_norm", "mean_norm"]
    base = fc.prepare_config({})
    assert base["train"]["gigpo"] == {"gamma": 0.95, "step_weight": 1.0, "mode": "mean_std_norm"}
    assert advantages.job_params(base["train"]) == {}  # GRPO: a default run's params as they were
    gig = fc.prepare_config({"train": {"algorithm": "gigpo", "gigpo": {"gamma": 0.9}}})
    assert advantages.job_params(gig["train"]) == {
        "algorithm": "gigpo",
        "advantage_params": {"gamma": 0.9, "step_weight": 1.0, "mode": "mean_std_norm"},
    }


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        ({"train": {"algorithm": "gigpo", "backend": "verl", "ref_anchor": "round"}}, "train.algorithm", "local"),
        ({"train": {"algorithm": "gigpo"}, "rollout": {"mode": "concat"}}, "train.algorithm", "windowed"),
        ({"train": {"algorithm": "gigpo", "group_size": 1}}, "train.group_size", "at least 2"),
        ({"train": {"algorithm": "gigpo", "gigpo": {"gamma": 1.5}}}, "train.gigpo.gamma", ""),
        ({"train": {"algorithm": "gigpo", "gigpo": {"mode": "std"}}}, "train.gigpo.mode", ""),
        ({"train": {"gigpo": {"bogus": 1}}}, "train.gigpo.bogus", "unknown"),
        ({"train": {"algorithm": "gigpo_x"}}, "train.algorithm", ""),
    ],
)
def test_bad_gigpo_configs_are_refused_naming_the_key(overrides, key, words):
    with pytest.raises(fc.ConfigError, match=f"config key '{key}'.*{words}"):
        fc.prepare_config(_cfg(overrides))


def test_train_params_check_the_estimator_keys():
    p = TrainParams.from_dict({"algorithm": "gigpo", "advantage_params": {"gamma": 0.9, "step_weight": 2.0}})
    assert p.recorded()["algorithm"] == "gigpo"
    assert p.recorded()["advantage_params"] == {"gamma": 0.9, "step_weight": 2.0}
    assert "gamma" not in p.recorded()  # PPO's GAE γ is not recorded for GiGPO
    assert "algorithm" not in TrainParams().recorded()  # GRPO's files as they were
    with pytest.raises(fc.ConfigError, match="train.gigpo.gamma"):
        TrainParams.from_dict({"algorithm": "gigpo", "advantage_params": {"gamma": -1}})
    with pytest.raises(fc.ConfigError, match="train.grpo.gamma"):
        TrainParams.from_dict({"algorithm": "grpo", "advantage_params": {"gamma": 0.9}})


def test_the_verl_backend_refuses_gigpo_in_the_job_too():
    from fedagent.train.verl.backend import check_job_keys

    with pytest.raises(fc.ConfigError, match="config key 'train.algorithm'.*local"):
        check_job_keys({"backend": "verl", "ref_anchor": "round", "algorithm": "gigpo"})


def test_gigpo_and_grpo_arms_share_one_round_0_but_ppo_does_not():
    from fedagent.plan.matrix import start_key

    grpo_cfg = fc.prepare_config(_cfg({"train": {"algorithm": "grpo"}}))
    gigpo_cfg = fc.prepare_config(_cfg({"train": {"algorithm": "gigpo", "gigpo": {"step_weight": 0.5}}}))
    ppo_cfg = fc.prepare_config(_cfg({"train": {"algorithm": "ppo", "group_size": 1}}))
    assert start_key(grpo_cfg) == start_key(gigpo_cfg) != start_key(ppo_cfg)


# --------------------------------------------------------------------------- a local GiGPO round
PARAMS = {**TINY_TRAIN, "max_turns": 3}


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_gigpo_round_trains_byte_identically_and_records_its_step_groups(tiny_dir, tmp_path):
    gig = {**PARAMS, "algorithm": "gigpo", "advantage_params": {"gamma": 0.95, "step_weight": 1.0}}
    outs = []
    for k, params in enumerate((gig, gig, PARAMS)):
        env = FakeEnv(mode="draw", win_if=lambda text: len(text) % 3 == 0, max_turns=3)
        m = train_client(
            tiny_dir,
            tiny_dir,
            env,
            round=1,
            client=0,
            params=TrainParams.from_dict(params),
            threads=1,
            out_dir=tmp_path / f"u{k}",
        )
        outs.append(m)
    a, b, g = (tmp_path / f"u{k}" / "model.safetensors" for k in range(3))
    assert _sha(a) == _sha(b)  # deterministic
    assert _sha(a) != _sha(g)  # and not GRPO's update: the step term moved something
    stats = outs[0]["gigpo"]
    # "Nothing happens." / "Invalid format." recur within a group: shared anchor states exist
    assert stats["step_groups_shared"] > 0 and stats["steps_in_shared_groups"] > 0
    assert "gigpo" not in outs[2]
    prov = json.loads((tmp_path / "u0" / "provenance.json").read_text())
    assert prov["params"]["algorithm"] == "gigpo" and prov["params"]["advantage_params"]["gamma"] == 0.95
