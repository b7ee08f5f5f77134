"""PPO (issue 11): GAE, whitening, the clipped value loss and its scale, value-head detection,
round-1 critic choice (warm-start order), and the critic path of aggregate / merge / verify."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedagent.server.aggregate import aggregate
from fedagent.core.atomic import write_manifest
from fedagent.core.config import ConfigError, load_config
from fedagent.model.critic_dir import CRITIC_RECORD, critic_digests
from fedagent.model.hf_dir import TensorReader, read_header, save_model_dir, write_tensors
from fedagent.server.merge import MergeError, merge
from fedagent.core.seeds import torch_generator
from fedagent.server.optimizers import make_optimizer
from fedagent.model import critic as fc
from fedagent.train import grpo, ppo
from fedagent.server.verify import verify_round
from workflow_helpers import TEST_CONFIG


# ---------------------------------------------------------------------------------- GAE
def test_gae_matches_hand_computation():
    # δ2 = 2 − 1.5 = 0.5                 A2 = 0.5
    # δ1 = 0 + 0.9·1.5 − 1.0 = 0.35      A1 = 0.35 + 0.9·0.8·0.5  = 0.71
    # δ0 = 0 + 0.9·1.0 − 0.5 = 0.4       A0 = 0.4  + 0.9·0.8·0.71 = 0.9112
    adv, ret = ppo.gae(torch.tensor([0.0, 0.0, 2.0]), torch.tensor([0.5, 1.0, 1.5]), gamma=0.9, lam=0.8)
    assert adv.tolist() == pytest.approx([0.9112, 0.71, 0.5], abs=1e-6)
    assert ret.tolist() == pytest.approx([1.4112, 1.71, 2.0], abs=1e-6)
    # the reference's γ = λ = 1: every token's advantage is the return minus its value
    adv, ret = ppo.gae(torch.tensor([0.0, 0.0, 9.9]), torch.tensor([0.5, 1.0, 1.5]), gamma=1.0, lam=1.0)
    assert adv.tolist() == pytest.approx([9.4, 8.9, 8.4], abs=1e-5)
    assert ret.tolist() == pytest.approx([9.9, 9.9, 9.9], abs=1e-5)
    # λ = 0: one-step TD errors
    adv, _ = ppo.gae(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5, 1.0, 1.5]), gamma=0.5, lam=0.0)
    assert adv.tolist() == pytest.approx([1.0 + 0.5 - 0.5, 0.75 - 1.0, 0.5], abs=1e-6)


def test_rewards_sit_on_the_last_token_and_advantages_are_whitened_over_the_batch():
    samples = [grpo.Sample([1], [2, 3], 10.0, 0), grpo.Sample([1], [4, 5, 6], -0.1, 1)]
    assert ppo.token_rewards(samples[0]).tolist() == [0.0, 10.0]
    values = torch.tensor([1.0, 2.0, 0.5, 0.25, 0.0])
    adv, ret = ppo.advantages_and_returns(samples, values, gamma=1.0, lam=1.0)
    raw = torch.tensor([9.0, 8.0, -0.6, -0.35, -0.1])
    assert ret.tolist() == pytest.approx([10.0, 10.0, -0.1, -0.1, -0.1], abs=1e-6)
    m, var = raw.mean(), raw.var(unbiased=True)
    assert adv.tolist() == pytest.approx(((raw - m) / torch.sqrt(var + 1e-8)).tolist(), abs=1e-5)
    assert float(adv.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(adv.std(unbiased=True)) == pytest.approx(1.0, abs=1e-5)


# --------------------------------------------------------------------- clipped value loss
def test_clipped_value_loss_by_hand():
    vpred = torch.tensor([1.0, 0.0, 0.2], requires_grad=True)
    old = torch.tensor([0.0, 0.0, 0.0])
    ret = torch.tensor([2.0, -1.0, 1.0])
    terms, clipped = ppo.value_loss_terms(vpred, old, ret, clip=0.5)
    # token 0: V moved 1.0 > 0.5 → clipped V = 0.5, (0.5−2)² = 2.25 > (1−2)² = 1: the clipped
    #          branch wins and gives no gradient; token 1: unchanged, (0+1)² = 1 both ways;
    #          token 2: within the clip, (0.2−1)² = 0.64 both ways.
    assert terms.tolist() == pytest.approx([2.25, 1.0, 0.64])
    assert clipped.tolist() == [1.0, 0.0, 0.0]
    terms.sum().backward()
    assert vpred.grad.tolist() == pytest.approx([0.0, 2.0, 2 * (0.2 - 1.0)])


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """The tiny policy and its fresh critic (written by the CLI, as the workflow does)."""
    out = tmp_path_factory.mktemp("tiny") / "m"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedagent.cli",
            "tiny-model",
            "--seed",
            "5",
            "--out",
            str(out),
            "--critic",
            "--critic-seed",
            "5",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    return out


def test_critic_loss_is_the_mean_of_micro_token_means(tiny_pair):
    """legacy_exact (invariant 14): Σ_micro token-mean / n_micro, coefficient 1 — not 0.5×, not
    summed over micros, not one token-mean over the mini-batch (micros of unequal token counts)."""
    critic = fc.load_critic(tiny_pair / "critic")
    samples = [
        grpo.Sample([5, 6, 7], [9, 10, 11, 12, 13], 1.0, 0),
        grpo.Sample([5, 6], [12], 0.0, 1),
        grpo.Sample([5], [14, 15], -0.1, 2),
    ]
    slices = [slice(0, 5), slice(5, 6), slice(6, 8)]
    with torch.no_grad():
        old = ppo.response_values(critic, samples)
    returns = old + torch.tensor([1.0, -0.3, 0.2, 0.1, 0.4, -2.0, 0.05, 0.3])

    class NoStep:  # keep the gradient of the step for inspection
        def zero_grad(self, set_to_none=True):
            critic.zero_grad(set_to_none=True)

        def step(self):
            pass

    st = ppo.critic_step(
        critic,
        NoStep(),
        samples,
        [0, 1, 2],
        old,
        returns,
        slices,
        micro=2,
        clip=0.5,
        grad_clip=1e9,
        autocast=lambda: torch.autocast("cpu", enabled=False),
    )
    got = critic.score.weight.grad.clone()
    critic.zero_grad(set_to_none=True)
    by_hand = 0
    for micro in ([0, 1], [2]):
        v = ppo.response_values(critic, [samples[i] for i in micro])
        o = torch.cat([old[slices[i]] for i in micro])
        r = torch.cat([returns[slices[i]] for i in micro])
        by_hand = by_hand + torch.maximum((v - r) ** 2, (o + (v - o).clamp(-0.5, 0.5) - r) ** 2).mean() / 2
    by_hand.backward()
    assert torch.allclose(got, critic.score.weight.grad, rtol=1e-5, atol=1e-8)
    assert st["vf_loss"] == pytest.approx(float(by_hand.detach()), rel=1e-5)
    assert st["critic_grad_norm"] > 0


def test_critic_step_moves_values_toward_returns(tiny_pair):
    critic = fc.load_critic(tiny_pair / "critic")
    samples = [grpo.Sample([5, 6, 7], [9, 10], 1.0, 0), grpo.Sample([5, 6], [12, 13], 0.0, 1)]
    slices = [slice(0, 2), slice(2, 4)]
    with torch.no_grad():
        old = ppo.response_values(critic, samples)
    returns = old + 0.3
    opt = torch.optim.AdamW(critic.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(3):
        ppo.critic_step(
            critic,
            opt,
            samples,
            [0, 1],
            old,
            returns,
            slices,
            micro=1,
            clip=0.5,
            grad_clip=1.0,
            autocast=lambda: torch.autocast("cpu", enabled=False),
        )
    with torch.no_grad():
        new = ppo.response_values(critic, samples)
    assert float(((new - returns) ** 2).mean()) < float(((old - returns) ** 2).mean())


# ----------------------------------------------------------------------- value-head detection
def _st(path: Path, tensors: dict, config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    write_tensors(path / "model.safetensors", tensors)
    (path / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"]}))
    return path


BACKBONE = {"model.embed_tokens.weight": torch.zeros(10, 4), "model.norm.weight": torch.ones(4)}


def test_value_head_is_detected_from_tensor_names_never_from_config(tmp_path, tiny_pair):
    assert fc.has_value_head(tiny_pair) is False
    assert fc.has_value_head(tiny_pair / "critic") is True
    critic = {**BACKBONE, "score.weight": torch.zeros(1, 4), "score.bias": torch.zeros(1)}
    # config.json says ForCausalLM for a critic and ForTokenClassification for a policy: ignored
    assert fc.has_value_head(_st(tmp_path / "c", critic, {"architectures": ["LlamaForCausalLM"]})) is True
    assert (
        fc.has_value_head(
            _st(
                tmp_path / "a",
                {**BACKBONE, "lm_head.weight": torch.zeros(10, 4)},
                {"architectures": ["LlamaForTokenClassification"], "num_labels": 1},
            )
        )
        is False
    )
    # a classifier head with two labels is not a value head
    assert fc.has_value_head(_st(tmp_path / "two", {**BACKBONE, "score.weight": torch.zeros(2, 4)})) is False
    # sharded: the index's files are read
    sh = tmp_path / "sharded"
    sh.mkdir()
    write_tensors(sh / "model-00001-of-00002.safetensors", BACKBONE)
    write_tensors(
        sh / "model-00002-of-00002.safetensors", {"score.weight": torch.zeros(1, 4), "score.bias": torch.zeros(1)}
    )
    (sh / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    **{k: "model-00001-of-00002.safetensors" for k in BACKBONE},
                    "score.weight": "model-00002-of-00002.safetensors",
                    "score.bias": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    assert fc.has_value_head(sh) is True
    # undeterminable: pickled weights only, a corrupt header, no directory
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    assert fc.has_value_head(tmp_path / "bin") is None
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{")
    assert fc.has_value_head(bad) is None
    assert fc.has_value_head(tmp_path / "missing") is None


def _trl_checkpoint(path: Path, actor: Path, head_shape=None) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A critic as TRL's AutoModelForCausalLMWithValueHead saves it: the policy's tensors (lm_head
    included) + v_head.summary.weight [1, H] / .bias [1], the policy's config.json."""
    from safetensors.torch import load_file

    pol = load_file(actor / "model.safetensors")
    pol.setdefault("lm_head.weight", pol["model.embed_tokens.weight"].clone())  # an untied policy's LM head
    hidden = pol["model.embed_tokens.weight"].shape[1]
    g = torch_generator(7, "trl_head")
    w = torch.randn(head_shape or (1, hidden), generator=g)
    b = torch.randn(1, generator=g)
    path.mkdir(parents=True)
    write_tensors(path / "model.safetensors", {**pol, "v_head.summary.weight": w, "v_head.summary.bias": b})
    (path / "config.json").write_text((actor / "config.json").read_text())
    return path, w, b


def test_a_trl_v_head_checkpoint_is_a_critic_with_our_head_names(tmp_path, tiny_pair):
    """TRL's v_head.summary.* is accepted when it fits (renamed to score.*, lm_head dropped); the
    round-0 critic written from it holds our names only and the same head; a misfit or absent
    head is still refused with "no value head"."""
    from safetensors.torch import load_file

    trl, w, b = _trl_checkpoint(tmp_path / "trl", tiny_pair)
    assert fc.has_value_head(trl) is True
    assert fc.resolve_start_critic("tiny", str(trl))[:2] == ("explicit", trl)
    assert fc.backbone_mismatch(tiny_pair, trl) is None
    critic = fc.load_critic(trl)
    assert torch.equal(critic.score.weight, w) and torch.equal(critic.score.bias, b)
    pol = load_file(tiny_pair / "model.safetensors")
    sd = critic.state_dict()
    assert all(torch.equal(sd[k], pol[k]) for k in pol if k.startswith("model."))
    load_config(TEST_CONFIG, {"train.algorithm": "ppo", "train.ppo.critic_path": str(trl)})
    out = tmp_path / "base"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedagent.cli",
            "tiny-model",
            "--seed",
            "5",
            "--out",
            str(out),
            "--critic",
            "--critic-seed",
            "5",
            "--critic-path",
            str(trl),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    saved = load_file(out / "critic/model.safetensors")
    assert not any(k.startswith(("v_head.", "lm_head.")) for k in saved)
    assert torch.equal(saved["score.weight"], w) and torch.equal(saved["score.bias"], b)
    # a v_head that does not fit the backbone (hidden + 1, or two outputs) is no value head
    for shape in ((1, w.shape[1] + 1), (2, w.shape[1])):
        bad, _, _ = _trl_checkpoint(tmp_path / f"bad{shape}", tiny_pair, head_shape=shape)
        assert fc.has_value_head(bad) is False
        with pytest.raises(ConfigError, match="config key 'train.ppo.critic_path'.*no value head.*v_head"):
            load_config(TEST_CONFIG, {"train.algorithm": "ppo", "train.ppo.critic_path": str(bad)})
        with pytest.raises(ValueError, match="no value head"):
            fc.load_critic(bad)
    # no value head at all (the policy itself): the same clear refusal
    with pytest.raises(ConfigError, match="config key 'train.ppo.critic_path'.*holds no value head"):
        fc.resolve_start_critic("tiny", str(tiny_pair))


# ------------------------------------------------------------------- round 1's critic (warm start)
def test_warm_start_order_explicit_then_sibling_then_fresh(tmp_path, tiny_pair, capsys):
    actor_only = tmp_path / "actor"
    _st(actor_only, {**BACKBONE, "lm_head.weight": torch.zeros(10, 4)})
    trained = tmp_path / "run" / "round_005" / "model"
    _st(trained, {**BACKBONE, "lm_head.weight": torch.zeros(10, 4)})
    (trained / "server.json").write_text("{}")
    critic = {**BACKBONE, "score.weight": torch.zeros(1, 4), "score.bias": torch.zeros(1)}
    _st(trained / "critic", critic)
    explicit = _st(tmp_path / "explicit", critic)
    # 1. an explicit path wins over the sibling
    assert fc.resolve_start_critic(str(trained), str(explicit))[:2] == ("explicit", explicit)
    # ... and must hold a value head: a hard error even when a good sibling exists
    with pytest.raises(ConfigError, match="config key 'train.ppo.critic_path'.*no value head"):
        fc.resolve_start_critic(str(trained), str(actor_only))
    with pytest.raises(ConfigError, match="not a directory"):
        fc.resolve_start_critic(str(trained), str(tmp_path / "nope"))
    # 2. the critic beside the start model
    assert fc.resolve_start_critic(str(trained), None)[:2] == ("auto-sibling", trained / "critic")
    # 3. a fresh head: loudly for a trained fedagent model without a critic, quietly for a base
    shutil_rm(trained / "critic")
    mode, path, msg = fc.resolve_start_critic(str(trained), None)
    assert (mode, path) == ("fresh-value-head", None) and "[warn]" in msg and "FRESH" in msg
    mode, path, msg = fc.resolve_start_critic("tiny", None)
    assert (mode, path) == ("fresh-value-head", None) and "[warn]" not in msg
    # a sibling that is not a critic is an error, not a silent fresh head
    _st(trained / "critic", {**BACKBONE, "lm_head.weight": torch.zeros(10, 4)})
    with pytest.raises(ConfigError, match="holds no value head"):
        fc.resolve_start_critic(str(trained), None)


def shutil_rm(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def test_critic_path_without_a_value_head_stops_planning_and_the_job(tmp_path, tiny_pair):
    with pytest.raises(ConfigError, match="config key 'train.ppo.critic_path'.*no value head"):
        load_config(TEST_CONFIG, {"train.algorithm": "ppo", "train.ppo.critic_path": str(tiny_pair)})
    load_config(TEST_CONFIG, {"train.algorithm": "ppo", "train.ppo.critic_path": str(tiny_pair / "critic")})
    # GRPO ignores the key; PPO runs on verl too (issue 30); a GRPO group of one is refused
    load_config(TEST_CONFIG, {"train.ppo.critic_path": str(tiny_pair)})
    load_config(
        TEST_CONFIG,
        {
            "train.algorithm": "ppo",
            "train.backend": "verl",
            "train.ref_anchor": "round",
            "train.group_size": 1,
            "train.groups_per_epoch": 2,
            "train.mini_batch_size": 2,
        },
    )
    with pytest.raises(ConfigError, match="config key 'train.group_size'"):
        load_config(TEST_CONFIG, {"train.group_size": 1})
    load_config(TEST_CONFIG, {"train.group_size": 1, "train.algorithm": "ppo"})
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedagent.cli",
            "tiny-model",
            "--seed",
            "5",
            "--out",
            str(tmp_path / "m"),
            "--critic",
            "--critic-seed",
            "5",
            "--critic-path",
            str(tiny_pair),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "train.ppo.critic_path" in res.stderr
    assert not (tmp_path / "m").exists()


def test_base_model_records_its_critic_choice(tmp_path, tiny_pair):
    """A warm start off a global model dir takes the critic beside it; an explicit path wins;
    a fresh head is seeded (same seed, same head). The choice is in provenance.json."""
    from safetensors.torch import load_file

    def base(out, *extra):
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "fedagent.cli",
                "base-model",
                "--source",
                str(tiny_pair),
                "--out",
                str(out),
                "--critic",
                "--critic-seed",
                "3",
                *extra,
            ],
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stderr
        return json.loads((out / "provenance.json").read_text())["critic"], load_file(out / "critic/model.safetensors")

    rec, sib = base(tmp_path / "b1")
    assert rec == {"critic_init": "auto-sibling", "start_critic": str(tiny_pair / "critic"), "value_head_seed": None}
    want = load_file(tiny_pair / "critic/model.safetensors")
    assert set(sib) == set(want) and all(torch.equal(sib[k], want[k]) for k in want)
    other = tmp_path / "other"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "fedagent.cli",
            "tiny-model",
            "--seed",
            "5",
            "--out",
            str(other),
            "--critic",
            "--critic-seed",
            "11",
        ],
        check=True,
        capture_output=True,
    )
    rec, exp = base(tmp_path / "b2", "--critic-path", str(other / "critic"))
    assert rec["critic_init"] == "explicit" and rec["start_critic"] == str(other / "critic")
    assert not torch.equal(exp["score.weight"], sib["score.weight"])
    assert torch.equal(exp["score.weight"], load_file(other / "critic/model.safetensors")["score.weight"])
    # fresh heads: seeded, on the policy's own backbone
    a, b = fc.fresh_critic(tiny_pair, seed=3), fc.fresh_critic(tiny_pair, seed=3)
    assert torch.equal(a.score.weight, b.score.weight) and not torch.equal(
        a.score.weight, fc.fresh_critic(tiny_pair, 4).score.weight
    )
    assert float(a.score.bias.detach().abs().sum()) == 0.0
    pol = load_file(tiny_pair / "model.safetensors")
    sd = a.state_dict()
    assert all(torch.equal(sd[k], pol[k]) for k in pol if k.startswith("model."))


# -------------------------------------------------------- the critic path of aggregate/merge/verify
def _critic_tensors(index: int, base=None) -> dict[str, torch.Tensor]:
    g = torch_generator(99, "critic_test", index=index)
    out = {}
    for name, shape in (("model.w", (4, 3)), ("score.weight", (1, 3)), ("score.bias", (1,))):
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        out[name] = (base[name] + 1e-2 * x) if base is not None else x
    return out


def _with_critic(d: Path, tensors: dict) -> Path:
    """``d/critic`` with ``tensors``; a client update (one with metrics.json) records its critic
    there as train-client does (critic_dir.CRITIC_RECORD)."""
    (d / "critic").mkdir()
    (d / "critic" / "config.json").write_text(json.dumps({"model_type": "synthetic"}))
    write_tensors(d / "critic" / "model.safetensors", tensors)
    if (d / "metrics.json").is_file():
        metrics = json.loads((d / "metrics.json").read_text())
        (d / "metrics.json").write_text(json.dumps({**metrics, CRITIC_RECORD: critic_digests(d)}))
    write_manifest(d)
    return d


def _ppo_round(tmp_path, m=2):
    actor = {"w": torch.randn(3, 2, generator=torch_generator(1, "a"))}
    prev = _with_critic(save_model_dir(tmp_path / "prev", actor), _critic_tensors(0))
    pc = _critic_tensors(0)
    clients, crit = [], []
    for i in range(m):
        c = _critic_tensors(10 + i, base=pc)
        crit.append(c)
        d = save_model_dir(
            tmp_path / f"client{i}",
            {"w": actor["w"] + 0.01 * (i + 1)},
            json_files={"metrics.json": {"num_samples": i + 1, "num_tokens": 3, "round": 1, "client": i}},
        )
        clients.append(_with_critic(d, c))
    return prev, clients, pc, crit


def test_critic_is_aggregated_merged_and_verified_with_its_own_server_state(tmp_path):
    prev, clients, pc, crit = _ppo_round(tmp_path)
    s = aggregate(prev, clients, tmp_path / "agg", weighting="samples")
    assert s["critic"]["num_tensors"] == 3
    with TensorReader() as r:
        delta = {n: r.read(i) for n, i in read_header(tmp_path / "agg/critic/delta.safetensors").items()}
    w = [1 / 3, 2 / 3]
    for n in pc:
        want = sum(wi * (c[n].double() - pc[n].double()) for wi, c in zip(w, crit))
        assert torch.allclose(delta[n].double(), want, atol=1e-7)
    opt = make_optimizer("fedadam", lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    merge(prev, tmp_path / "agg", tmp_path / "m1", opt, round_=1)
    st = read_header(tmp_path / "m1/critic/server_state.safetensors")
    assert {"m/score.weight", "v/score.weight"} <= set(st)
    assert json.loads((tmp_path / "m1/critic/server.json").read_text())["step"] == 1
    assert verify_round(prev, clients, "samples", tmp_path / "agg", model_dir=tmp_path / "m1", opt=opt) == []
    # round 2 continues the critic's server state from round 1's model dir
    clients2 = []
    for i in range(2):
        d = save_model_dir(
            tmp_path / f"r2c{i}",
            {"w": torch.zeros(3, 2) + i},
            json_files={"metrics.json": {"num_samples": 1, "num_tokens": 3}},
        )
        clients2.append(_with_critic(d, _critic_tensors(20 + i, base=pc)))
    aggregate(tmp_path / "m1", clients2, tmp_path / "agg2")
    merge(tmp_path / "m1", tmp_path / "agg2", tmp_path / "m2", opt, round_=2, prev_state_dir=tmp_path / "m1")
    assert (
        verify_round(
            tmp_path / "m1",
            clients2,
            "uniform",
            tmp_path / "agg2",
            model_dir=tmp_path / "m2",
            opt=opt,
            prev_state_dir=tmp_path / "m1",
        )
        == []
    )
    # tamper the critic's server state (re-signed): named, with its file
    path = tmp_path / "m2/critic/server_state.safetensors"
    with TensorReader() as r:
        t = {n: r.read(i).clone() for n, i in read_header(path).items()}
    t["v/score.bias"] += 1e-3
    write_tensors(path, t)
    write_manifest(tmp_path / "m2")
    fails = verify_round(
        tmp_path / "m1",
        clients2,
        "uniform",
        tmp_path / "agg2",
        model_dir=tmp_path / "m2",
        opt=opt,
        prev_state_dir=tmp_path / "m1",
    )
    assert (
        len(fails) == 1 and fails[0].startswith("critic: server state: tensor 'v/score.bias'") and str(path) in fails[0]
    )


def _swap_critic(dst: Path, src: Path) -> None:
    """Put ``src``'s critic/ in ``dst`` and re-sign ``dst`` (its metrics.json left as it was)."""
    import shutil

    shutil.rmtree(dst / "critic")
    shutil.copytree(src / "critic", dst / "critic")
    write_manifest(dst)


def test_verify_names_a_critic_swapped_in_from_another_client_or_round(tmp_path):
    """Every critic folder is called critic/: whose it is comes from the update's metrics.json
    (critic_sha256). A swapped critic, aggregated and merged consistently (so its values verify),
    is still refused, naming the file; so is a critic aggregate.json listing other clients."""
    prev, clients, pc, _ = _ppo_round(tmp_path)
    opt = make_optimizer("fedavg")

    def run(name: str, cs) -> list[str]:
        aggregate(prev, cs, tmp_path / f"agg-{name}")
        merge(prev, tmp_path / f"agg-{name}", tmp_path / f"m-{name}", opt, round_=1)
        return verify_round(prev, cs, "uniform", tmp_path / f"agg-{name}", model_dir=tmp_path / f"m-{name}", opt=opt)

    assert run("good", clients) == []
    # client 1's critic in client 0's update
    _swap_critic(clients[0], clients[1])
    fails = run("other-client", clients)
    assert len(fails) == 1, fails
    assert fails[0].startswith(
        f"critic: identity: {clients[0] / 'critic' / 'model.safetensors'} is not the critic "
        f"that {clients[0] / 'metrics.json'} records"
    ), fails
    assert f"it is the critic of the update {clients[1]} (client 1, round 1)" in fails[0]
    # a critic from another round (matches no update of this one)
    later = _with_critic(save_model_dir(tmp_path / "r2c0", {"w": torch.zeros(3, 2)}), _critic_tensors(30, base=pc))
    _swap_critic(clients[0], later)
    fails = run("other-round", clients)
    assert len(fails) == 1 and "a critic from another client or round?" in fails[0], fails
    # an update that records no critic: nothing says whose critic it is
    (clients[0] / "metrics.json").write_text(json.dumps({"num_samples": 1, "num_tokens": 3}))
    write_manifest(clients[0])
    fails = run("unrecorded", clients)
    assert len(fails) == 1 and f"{clients[0] / 'metrics.json'} records no critic_sha256" in fails[0], fails


def test_verify_checks_the_critic_aggregate_lists_the_actors_clients(tmp_path):
    prev, clients, _, _ = _ppo_round(tmp_path, m=3)
    aggregate(prev, clients, tmp_path / "agg")
    assert verify_round(prev, clients, "uniform", tmp_path / "agg") == []
    path = tmp_path / "agg" / "critic" / "aggregate.json"
    summary = json.loads(path.read_text())
    # clients 0 and 1 swapped in the critic's list (same folder names: "critic"), re-signed
    summary["clients"][0]["dir"], summary["clients"][1]["dir"] = (
        summary["clients"][1]["dir"],
        summary["clients"][0]["dir"],
    )
    path.write_text(json.dumps(summary))
    write_manifest(tmp_path / "agg")
    fails = verify_round(prev, clients, "uniform", tmp_path / "agg")
    assert fails and all(f.startswith("critic: ") for f in fails), fails
    assert any("critic: aggregate.json: clients" in f and str(path) in f for f in fails), fails
    assert any(f.startswith(f"critic: identity: {path} lists clients") for f in fails), fails


def test_a_client_without_its_critic_stops_the_round(tmp_path):
    prev, clients, _, _ = _ppo_round(tmp_path)
    lacking = save_model_dir(
        tmp_path / "grpo_client",
        {"w": torch.zeros(3, 2)},
        json_files={"metrics.json": {"num_samples": 1, "num_tokens": 3}},
    )
    with pytest.raises(ValueError, match="grpo_client: no critic/"):
        aggregate(prev, [clients[0], lacking], tmp_path / "agg")
    assert not (tmp_path / "agg").exists()
    aggregate(prev, clients, tmp_path / "good")
    assert any(
        "grpo_client: no critic/" in f for f in verify_round(prev, [clients[0], lacking], "uniform", tmp_path / "good")
    )
    # a critic in the clients but none in prev: no base for its delta
    plain = save_model_dir(tmp_path / "plain_prev", {"w": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="carries a critic/ but prev"):
        aggregate(plain, clients, tmp_path / "agg")
    # merge: an aggregate with a critic needs prev's
    with pytest.raises(MergeError, match="no critic/"):
        merge(plain, tmp_path / "good", tmp_path / "m", make_optimizer("fedavg"), round_=1)


def test_grpo_dirs_stay_as_they_were(tmp_path):
    """No critic anywhere: no critic key, no critic/ (GRPO's aggregate.json is unchanged)."""
    actor = {"w": torch.ones(2, 2)}
    prev = save_model_dir(tmp_path / "prev", actor)
    c = save_model_dir(tmp_path / "c0", {"w": torch.ones(2, 2) * 2}, json_files={"metrics.json": {"num_samples": 1}})
    s = aggregate(prev, [c], tmp_path / "agg")
    assert "critic" not in s and not (tmp_path / "agg/critic").exists()
    merge(prev, tmp_path / "agg", tmp_path / "m", make_optimizer("fedavg"), round_=1)
    assert not (tmp_path / "m/critic").exists()


def test_ppo_params_are_recorded_only_for_ppo():
    from fedagent.train.local import TrainParams

    assert "algorithm" not in TrainParams().recorded() and "gamma" not in TrainParams().recorded()
    p = TrainParams.from_dict({"algorithm": "ppo", "group_size": 1, "groups_per_epoch": 4, "gamma": 0.99, "lam": 0.95})
    assert p.recorded()["algorithm"] == "ppo" and p.recorded()["lam"] == 0.95
    with pytest.raises(ConfigError, match="config key 'train.ppo.gamma'"):
        TrainParams.from_dict({"algorithm": "ppo", "gamma": 1.5})
    with pytest.raises(ConfigError, match="config key 'train.group_size'"):
        TrainParams.from_dict({"group_size": 1, "groups_per_epoch": 4})
    assert math.isclose(TrainParams().value_clip, 0.5)


def test_ppo_client_round_is_byte_reproducible_and_moves_the_critic(tiny_pair, tmp_path):
    """A PPO train_client (fake env) twice: identical actor and critic bytes; the critic moved.

    Its metrics carry no GRPO group counts (PPO has no groups) but ``samples_nonzero_reward``:
    here (no invalid penalty, answers of even length win) some samples are rewarded, some not."""
    from fake_env import FakeEnv
    from fedagent.core.atomic import sha256_file
    from fedagent.train.local import TrainParams, train_client

    p = TrainParams.from_dict(
        dict(
            base_seed=3,
            epochs=1,
            groups_per_epoch=3,
            group_size=1,
            max_turns=2,
            max_new_tokens=6,
            lr=1e-3,
            mini_batch_size=3,
            micro_batch_size=2,
            max_prompt_tokens=256,
            pool_size=4,
            algorithm="ppo",
            critic_lr=1e-3,
            invalid_penalty=0.0,
        )
    )
    outs = []
    for k in range(2):
        env = FakeEnv(mode="draw", win_if=lambda text: len(text) % 2 == 0)
        m = train_client(tiny_pair, tiny_pair, env, round=1, client=0, params=p, threads=1, out_dir=tmp_path / f"u{k}")
        assert m["params"]["algorithm"] == "ppo" and m["ppo"][0]["tokens"] > 0
        outs.append(tmp_path / f"u{k}")
    assert "groups" not in m and "groups_nonzero_advantage" not in m
    episodes = [json.loads(line) for line in (outs[0] / "samples.jsonl").read_text().splitlines()]
    rewarded = [ep["return"] != 0.0 for ep in episodes for t in ep["turns"] if t["response_tokens"]]
    assert len(rewarded) == m["num_samples"] and 0 < sum(rewarded) < len(rewarded)
    assert m["samples_nonzero_reward"] == sum(rewarded)
    # the update records its own critic (whose critic it is, for verify)
    assert m[CRITIC_RECORD] == critic_digests(outs[0]) and set(m[CRITIC_RECORD]) >= {"config.json", "model.safetensors"}
    assert json.loads((outs[0] / "metrics.json").read_text())[CRITIC_RECORD] == m[CRITIC_RECORD]
    for f in ("model.safetensors", "critic/model.safetensors"):
        assert sha256_file(outs[0] / f) == sha256_file(outs[1] / f), f
    assert sha256_file(outs[0] / "critic/model.safetensors") != sha256_file(tiny_pair / "critic/model.safetensors")
    prov = json.loads((outs[0] / "provenance.json").read_text())
    assert prov["start_critic"] == str(tiny_pair / "critic")


def test_ppo_preset_is_the_reference_recipe():
    """Invariant 14's recipe half: PPO n = 1 with batch 64 and mini = batch (64 rows per update, as
    GRPO's 8 prompts × n 8), critic lr 1e-5 — not the snapshot's n = 8 (8× the rollout)."""
    import yaml

    root = Path(__file__).resolve().parent.parent / "config" / "experiments"
    ppo_cfg = load_config(Path(__file__).resolve().parent.parent / "config" / "config.yaml")
    for key, value in yaml.safe_load((root / "textworld-uniform-ppo.yaml").read_text()).items():
        ppo_cfg[key] = {**ppo_cfg[key], **value} if isinstance(value, dict) else value
    t = ppo_cfg["train"]
    grpo_t = yaml.safe_load((root / "textworld-uniform.yaml").read_text())["train"]
    assert t["algorithm"] == "ppo" and t["group_size"] == 1 and t["groups_per_epoch"] == 64
    assert t["mini_batch_size"] == 64 == grpo_t["mini_batch_size"] == grpo_t["group_size"] * 8
    assert grpo_t["group_size"] == 8
    assert t["ppo"]["critic_lr"] == 1e-5 and t["ppo"]["gamma"] == 1.0 and t["ppo"]["lam"] == 1.0
    ppo_t = yaml.safe_load((root / "textworld-uniform-ppo.yaml").read_text())["train"]
    # otherwise the GRPO arm's recipe: the twins differ in the algorithm only
    assert {k: v for k, v in ppo_t.items() if k not in ("algorithm", "group_size", "groups_per_epoch", "ppo")} == {
        k: v for k, v in grpo_t.items() if k not in ("algorithm", "group_size", "groups_per_epoch")
    }


def test_fedprox_with_ppo_moves_the_actor_not_the_critic(tiny_pair, tmp_path):
    """FedProx (μ > 0) on a PPO client: the actor's update differs from μ = 0, the critic's does not.

    One epoch, so both runs roll out the same samples; the critic's steps see only those samples
    and its own values, so any difference in its bytes would be μ·(w − w_t) reaching the critic."""
    from fake_env import FakeEnv
    from fedagent.core.atomic import sha256_file
    from fedagent.train.local import TrainParams, train_client

    base = dict(
        base_seed=3,
        epochs=1,
        groups_per_epoch=3,
        group_size=1,
        max_turns=2,
        max_new_tokens=6,
        lr=1e-3,
        mini_batch_size=2,
        micro_batch_size=2,
        max_prompt_tokens=256,
        pool_size=4,
        algorithm="ppo",
        critic_lr=1e-3,
    )
    outs = {}
    for mu in (0.0, 5.0):
        p = TrainParams.from_dict({**base, "fedprox_mu": mu})
        outs[mu] = tmp_path / f"mu{mu}"
        train_client(
            tiny_pair, tiny_pair, FakeEnv(mode="draw"), round=1, client=0, params=p, threads=1, out_dir=outs[mu]
        )
    assert sha256_file(outs[0.0] / "model.safetensors") != sha256_file(outs[5.0] / "model.safetensors")
    assert sha256_file(outs[0.0] / "critic/model.safetensors") == sha256_file(outs[5.0] / "critic/model.safetensors")
