"""The verl backend's job at SmolLM2-1.7B's shape on one card: its memory plan (fedagent.model.verl_memory), the
settings sized from the job's declared memory (fedagent.train.verl.sizing) and the overrides they become in
verl's own config, for the presets config/experiments/gpu-verl-scale-webshop{,-ppo}.yaml on an 80 GB H100 and a
141 GB H200 (fake cards: FEDAGENT_GPUS), and the refusal of a card too small."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedagent.core import placement
from fedagent.core.config import prepare_config
from fedagent.model import memory, verl_memory
from fedagent.model.job_resources import job_resources

REPO = Path(__file__).resolve().parents[1]
PRESETS = {
    "grpo": REPO / "config" / "experiments" / "gpu-verl-scale-webshop.yaml",
    "ppo": REPO / "config" / "experiments" / "gpu-verl-scale-webshop-ppo.yaml",
}
H100, H200, A100_40 = 81559, 143771, 40960  # nvidia-smi's memory.total, MiB
# scripts/gpu/verl-scale.sh's BUDGETS=short overlay: gpu-scale-webshop.yaml's budgets and eval (issue 48's GPU run)
SHORT_FILE = REPO / "scripts" / "gpu" / "verl-scale-short.yaml"
SHORT = yaml.safe_load(SHORT_FILE.read_text())


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def preset(algo: str, **extra) -> dict:
    return prepare_config(_merge(yaml.safe_load(PRESETS[algo].read_text()), extra))


def usable(card: int) -> int:
    return placement.Card(0, card).usable_mib(placement.RESERVE_MIB)


def planned(cfg: dict, card: int) -> tuple[verl_memory.VerlMemoryPlan, int, int]:
    """(the plan, the train job's gpu_mem_mb, the eval's) as the workflow declares them on one such card."""
    res = job_resources(cfg, "train_client", card_mib=usable(card))
    ev = job_resources(cfg, "eval", card_mib=usable(card))["gpu_mem_mb"]
    return verl_memory.config_plan(cfg, usable(card), ev), res["gpu_mem_mb"], ev


def _choices(plan: verl_memory.VerlMemoryPlan) -> dict:
    """A plan's settings (its own declaration aside: the workflow may declare more, :func:`config_plan`)."""
    return {k: v for k, v in plan.summary().items() if k != "declared_mib"}


# ------------------------------------------------------------------ the reference's recipe in the presets
@pytest.mark.parametrize("algo", sorted(PRESETS))
def test_the_presets_are_the_reference_recipe_through_verl_at_1p7b(algo):
    cfg = preset(algo)
    tr = cfg["train"]
    assert cfg["model"] == "random:smollm2-1.7b" and tr["backend"] == "verl" and tr["algorithm"] == algo
    assert (tr["epochs"], cfg["clients"]["per_round"], cfg["rounds"]) == (3, 2, 4)
    # FACTS §4-5: 15 turns, 4096 prompt / 512 response tokens; lr 1e-6, KL 0.01, entropy 0.001, micro 4
    assert (tr["max_turns"], tr["max_prompt_tokens"], tr["max_new_tokens"]) == (15, 4096, 512)
    assert (tr["lr"], tr["kl_coef"], tr["entropy_coef"], tr["micro_batch_size"]) == (1e-6, 0.01, 0.001, 4)
    # GRPO: n = 8, 8 groups a step, mini = 8 prompts = 64 rows; PPO: n = 1, 64 tasks, mini 64
    assert (tr["group_size"], tr["groups_per_epoch"], tr["mini_batch_size"]) == (
        (8, 8, 64) if algo == "grpo" else (1, 64, 64)
    )
    assert tr["verl"]["engines"] == "run" and tr["verl"]["engine_sets"] == cfg["clients"]["per_round"]
    # nothing of the job's memory is hand-written: the plan sizes it
    for key in (
        "gpu_memory_utilization",
        "kv_cache_gb",
        "param_offload",
        "optimizer_offload",
        "gradient_checkpointing",
    ):
        assert tr["verl"][key] is None, key
    assert tr["gpu_mem_gb"] is None


# ------------------------------------------------------------------ the plan on both cards
# (preset, budgets, card) → (param_offload, optimizer_offload, gradient_checkpointing, micro, KV rows, jobs at once)
EXPECTED = {
    ("grpo", "reference", H100): (False, True, True, 4, 32, 1),
    ("grpo", "reference", H200): (False, True, True, 4, 32, 2),
    ("ppo", "reference", H100): (True, True, True, 4, 32, 1),
    ("ppo", "reference", H200): (True, True, True, 4, 32, 2),
    ("grpo", "short", H100): (True, True, True, 4, 64, 1),
    ("grpo", "short", H200): (False, True, True, 4, 64, 2),
    ("ppo", "short", H100): (True, True, True, 4, 64, 1),
    ("ppo", "short", H200): (True, True, True, 4, 64, 2),
}


@pytest.mark.parametrize("case", sorted(EXPECTED, key=str), ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_the_plan_fits_an_h100_and_an_h200_choosing_offload_where_needed(case):
    algo, budgets, card = case
    cfg = preset(algo, **(SHORT if budgets == "short" else {}))
    plan, train_mib, eval_mib = planned(cfg, card)
    got = (plan.param_offload, plan.optimizer_offload, plan.gradient_checkpointing, plan.micro_batch_size, plan.kv_rows)
    # the workflow declares the plan (padded so that no more verl jobs share the card than it was sized for)
    assert (
        train_mib
        == plan.declared_mib
        >= max(verl_memory._declared_mib(t, verl_memory.VerlJobKnobs.from_config(cfg)) for t in plan.phases.values())
    )
    at_once = min(cfg["clients"]["per_round"], usable(card) // train_mib)
    assert got + (at_once,) == EXPECTED[case], plan.summary()
    # what runs at once fits the card: the round's train jobs, then the eval beside every idle engine set
    assert at_once * train_mib <= usable(card)
    assert at_once * plan.idle_mib + eval_mib <= usable(card)
    # the KV cache holds the step's rows (or half of them) at prompt + response tokens each
    k = verl_memory.VerlJobKnobs.from_config(cfg)
    assert plan.kv_cache_bytes == plan.kv_rows * k.tokens * verl_memory.kv_bytes_per_token(
        memory.shape_of_source(cfg["model"])
    )


@pytest.mark.parametrize("algo", sorted(PRESETS))
@pytest.mark.parametrize("card", [H100, H200])
def test_the_job_sizes_the_same_plan_from_its_declared_memory(algo, card):
    """The job's own plan (budget: its gpu_mem_mb) is the plan-time one, whatever the budgets."""
    for extra in ({}, SHORT):
        cfg = preset(algo, **extra)
        at_plan, declared, _ = planned(cfg, card)
        s, k = memory.shape_of_source(cfg["model"]), verl_memory.VerlJobKnobs.from_config(cfg)
        in_job = verl_memory.plan(s, k, declared, key="train.gpu_mem_gb", card_mib=card)
        assert _choices(in_job) == _choices(at_plan), (in_job.summary(), at_plan.summary())


def test_when_fewer_jobs_fit_at_once_the_declaration_admits_no_more():
    """At the reference's budgets with the eval at batch 32 (61 GiB), two verl jobs and the eval beside their
    idle sets do not fit an H200: one job at a time, declared as more than half the card less the eval, so
    Snakemake never admits the second one beside it; the job's own plan within that declaration is the same."""
    cfg = preset("grpo", eval={"batch": 32}, env={"pool_size": 32})
    plan, declared, eval_mib = planned(cfg, H200)
    room = usable(H200) - eval_mib
    assert 2 * declared > usable(H200) and declared > room // 2 and declared >= plan.declared_mib
    assert plan.idle_mib + eval_mib <= usable(H200)
    s, k = memory.shape_of_source(cfg["model"]), verl_memory.VerlJobKnobs.from_config(cfg)
    assert _choices(verl_memory.plan(s, k, declared, key="train.gpu_mem_gb")) == _choices(plan)


def test_a_plan_whose_declaration_would_let_the_job_choose_another_is_never_declared(monkeypatch):
    """Declared more than its own peak (fewer jobs at once), a plan must still be the one the job's own plan
    within that declaration comes to: else the job would run a cheaper plan the card cannot hold idle beside
    the eval. Two plans on a 150 MiB card with a 90 MiB eval: A (cheap, idle 70: 70 + 90 > 150) and C (idle
    50); one job at a time declares 76 (> 150 / 2), within which the job would choose A: refused, not C."""

    def fake(cost, mib):
        return verl_memory.VerlMemoryPlan(False, False, False, 4, None, None, cost, {"rollout": {}}, mib, mib)

    monkeypatch.setattr(verl_memory, "candidates", lambda *a, **k: [fake(0, 70), fake(5, 50)])
    with pytest.raises(ValueError, match="train.verl.engines"):
        verl_memory.config_plan(preset("grpo"), 150, 90)


def test_a_card_too_small_is_refused_before_any_job_naming_the_key():
    with pytest.raises(ValueError, match=r"config key 'train\.verl\.gpus': the verl train job needs at least \d+ MiB"):
        planned(preset("grpo"), A100_40)
    # an H100 holds one job, but not the eval (batch 32: 61 GiB at these budgets) beside its idle engine set:
    # that key, and what to do
    with pytest.raises(ValueError, match=r"config key 'train\.verl\.engines': .*lower eval\.batch"):
        planned(preset("grpo", eval={"batch": 32}, env={"pool_size": 32}), H100)
    # a declaration that the cheapest plan exceeds: the declaration's key
    with pytest.raises(ValueError, match=r"config key 'train\.gpu_mem_gb'"):
        planned(preset("grpo", train={"gpu_mem_gb": 30}), H200)


def test_pinned_settings_stay_pinned_and_a_pin_that_cannot_fit_is_refused():
    plan, _, _ = planned(preset("grpo", train={"verl": {"optimizer_offload": False, "kv_cache_gb": 8}}), H200)
    assert plan.optimizer_offload is False and plan.kv_cache_bytes == 8 * 2**30 and plan.kv_rows is None
    pins = {"gradient_checkpointing": False, "param_offload": False, "optimizer_offload": False, "kv_cache_gb": 40}
    with pytest.raises(ValueError, match=r"config key 'train\.verl\.gpus': .* micro-batch 1, KV cache 40\.0 GiB"):
        planned(preset("grpo", train={"verl": pins}), H100)


# ------------------------------------------------------------------ the sized values reach verl
def _model_dir(tmp_path: Path, cfg: dict) -> Path:
    from fedagent.core.architectures import ARCHITECTURES, random_target

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(ARCHITECTURES[random_target(cfg["model"])]["config"]))
    return d


def _job(tmp_path: Path, cfg: dict, card: int):
    """The verl job's params, settings, sized memory and overrides as the train-client job builds them, its
    declared memory and card in its environment as the rule and the placement give them."""
    from fedagent.train.advantages import sections
    from fedagent.train.cli import verl_settings
    from fedagent.train.local import TrainParams
    from fedagent.train.verl import sizing
    from fedagent.train.verl.launch import VerlJob
    from fedagent.train.verl.overrides import build_overrides

    tmp_path.mkdir(parents=True, exist_ok=True)
    skip = ("threads", "backend", "ref_anchor", "ppo", "verl", "gpu_mem_gb", "lora", *sections())
    ppo = (
        {k: v for k, v in cfg["train"]["ppo"].items() if k != "critic_path"}
        if cfg["train"]["algorithm"] == "ppo"
        else {}
    )
    p = TrainParams.from_dict(  # as workflow/common.smk's TRAIN_PARAMS
        {
            "base_seed": cfg["seed"],
            **ppo,
            "pool_size": cfg["env"]["pool_size"],
            **{k: v for k, v in cfg["train"].items() if k not in skip},
        }
    )
    s = verl_settings(json.dumps(cfg["train"]["verl"]))
    _, declared, _ = planned(cfg, card)
    env = {placement.JOB_MEM_ENV: str(declared), placement.JOB_GPUS_ENV: "1", placement.GPUS_ENV: f"0:{card}"}
    env["CUDA_VISIBLE_DEVICES"] = "0"
    model = _model_dir(tmp_path, cfg)
    m = sizing.job_memory(p, s, model, env=env)
    job = VerlJob(tag="fa-r001-c0-1-0123456789abcdef", workdir=tmp_path / "w", ray_tmp=Path("/tmp/fa-ray-x"))
    ov = build_overrides(
        p,
        s,
        memory=m,
        job=job,
        model_dir=model,
        rows=tmp_path / "rows.parquet",
        agent_loop_yaml=tmp_path / "agent_loop.yaml",
        rollout_seed=1,
    )
    return p, m, ov


@pytest.mark.parametrize("algo", sorted(PRESETS))
def test_the_overrides_verl_composes_carry_the_sized_values(algo, tmp_path):
    pytest.importorskip("verl", reason="verl is installed by scripts/setup.sh (envs/verl-cpu.txt)")
    from verl_helpers import compose_ppo

    shares = {}
    for card in (H100, H200):
        cfg = preset(algo)
        plan, _, _ = planned(cfg, card)
        p, m, ov = _job(tmp_path / str(card), cfg, card)
        c = compose_ppo(ov)
        a, r = c.actor_rollout_ref.actor, c.actor_rollout_ref.rollout
        assert a.fsdp_config.param_offload is plan.param_offload
        assert a.fsdp_config.optimizer_offload is plan.optimizer_offload
        assert c.actor_rollout_ref.model.enable_gradient_checkpointing is plan.gradient_checkpointing
        micro = plan.micro_batch_size
        assert (a.ppo_micro_batch_size_per_gpu, r.log_prob_micro_batch_size_per_gpu) == (micro, micro)
        assert c.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == micro
        assert r.engine_kwargs.vllm.kv_cache_memory_bytes == plan.kv_cache_bytes
        assert r.max_model_len == p.max_prompt_tokens + p.max_new_tokens
        # vLLM's share: its weights, KV cache and runtime over the card's memory, rounded up to 0.01
        vllm = sum(v for name, v in plan.phases["rollout"].items() if name.startswith("vllm_"))
        assert r.gpu_memory_utilization == m.gpu_memory_utilization
        assert vllm / (card * 2**20) <= r.gpu_memory_utilization < vllm / (card * 2**20) + 0.01
        shares[card] = r.gpu_memory_utilization
        if algo == "ppo":
            assert c.critic.fsdp.param_offload is plan.param_offload
            assert c.critic.fsdp.optimizer_offload is plan.optimizer_offload
            assert c.critic.model.enable_gradient_checkpointing is plan.gradient_checkpointing
            assert c.critic.ppo_micro_batch_size_per_gpu == micro
        assert m.record()["plan"]["declared_mib"] == plan.declared_mib
    # a share of each card, not one number: the H200's is smaller for the same KV cache
    assert shares[H200] < shares[H100], shares


# ------------------------------------------------------------------ through Snakemake's plan
def _dry_run(tmp: Path, configfiles: list[Path], card: int, *extra: str) -> subprocess.CompletedProcess:
    from workflow_helpers import snakemake_env

    exe = Path(sys.executable).parent / "snakemake"
    cmd = [str(exe), "-n", "-p", "--profile", "profiles/local", "--directory", str(tmp), "--configfile"]
    cmd += [str(REPO / "config" / "config.yaml"), *map(str, configfiles), *extra]
    env = {**snakemake_env(warm=False), placement.GPUS_ENV: f"0:{card}", "CUDA_VISIBLE_DEVICES": "0"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _train_asks(out: str) -> list[dict]:
    asks, rule = [], None
    for line in out.splitlines():
        m = re.match(r"^\s*(?:local)?rule (\w+):", line)
        if m:
            rule = m.group(1)
        elif rule == "train_client" and line.strip().startswith("resources:"):
            asks.append(dict(kv.strip().split("=", 1) for kv in line.split(":", 1)[1].split(",")))
    return asks


@pytest.mark.workflow
@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(PRESETS))
@pytest.mark.parametrize("card", [H100, H200])
def test_the_preset_plans_through_snakemake_on_a_fake_card(algo, card, tmp_path):
    proc = _dry_run(tmp_path, [PRESETS[algo]], card)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    asks = _train_asks(proc.stdout + proc.stderr)
    _, declared, _ = planned(preset(algo), card)
    assert len(asks) == 4 * 2 and {int(a["gpu_mem_mb"]) for a in asks} == {declared}, asks[:2]
    assert {a["gpu"] for a in asks} == {"1"}


@pytest.mark.workflow
@pytest.mark.slow
def test_the_node_scripts_command_plans_the_short_budgets_on_an_h200(tmp_path):
    """scripts/gpu/verl-scale.sh's Snakemake command line (the preset, its short-budget overlay, one --config
    with the run's name and rounds, --notemp) plans the round with the plan of those budgets."""
    proc = _dry_run(tmp_path, [PRESETS["grpo"], SHORT_FILE], H200, "--notemp", "--config", "run=x-short", "rounds=4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _, declared, _ = planned(preset("grpo", **SHORT), H200)
    assert {int(a["gpu_mem_mb"]) for a in _train_asks(proc.stdout + proc.stderr)} == {declared}
    assert "results/x-short/round_004" in proc.stdout + proc.stderr


@pytest.mark.workflow
@pytest.mark.slow
def test_a_card_too_small_stops_the_plan_with_one_message(tmp_path):
    proc = _dry_run(tmp_path, [PRESETS["grpo"]], A100_40)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert re.search(r"fedagent: invalid config: config key 'train\.verl\.gpus': the verl train job needs", out), out[
        -2000:
    ]
    assert not (tmp_path / "results").exists()


def test_gpu_mem_prints_the_verl_jobs_plan_and_what_fits():
    from fedagent.report import gpu_mem

    text, fits = gpu_mem.report(preset("grpo"), usable(H200))
    plan, declared, eval_mib = planned(preset("grpo"), H200)
    assert fits and f"train_client   {declared} MiB = verl memory plan on one {usable(H200)} MiB card" in text
    assert "optimizer_offload True" in text and f"idle set {plan.idle_mib} MiB" in text
    assert f"2 train + 1 eval = {2 * declared + eval_mib} MiB of {usable(H200)}: fits" in text
    # on an H100 one verl job at a time, and the eval beside it does not fit: the plan has it wait
    text, fits = gpu_mem.report(preset("grpo"), usable(H100))
    assert fits and "1 train (56110 MiB), the eval (22949 MiB) when one ends: fits" in text
