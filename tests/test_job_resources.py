"""Every job that runs a model asks its scheduler for what it uses (fedagent.model.job_resources).

The GPU ask follows the job's device (train.device / eval.device cuda: 1; train.verl.gpus; eval.backend
vllm: 1; CPU: 0), host memory is an estimate calibrated on measured peaks, a GPU job's command carries
FEDAGENT_JOB_GPUS / FEDAGENT_JOB_GPU_MEM_MB, and a GPU ask the machine cannot meet is one message
naming the key. The plans are `snakemake -n` through `--profile profiles/slurm`: what the plugin would
submit (its --gpus is the `gpu` resource, its --mem the `mem_mb`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from fedagent.core import config as fc
from fedagent.core import placement
from fedagent.model.job_resources import RULE_JOBS, gpu_ask, gpu_fit_problem, job_resources
from fedagent.model.memory import host_terms, job_host_mib
from workflow_helpers import snakemake_env, snakemake_run

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "config" / "config.yaml"
GPU_PRESETS = sorted((REPO / "config" / "experiments").glob("gpu-*.yaml"))
GPU_RULES = {"train_client", "warm_start", "eval", "eval_client", "eval_base"}


def _config(**overrides) -> dict:
    return fc.load_config(DEFAULT, overrides)


# --------------------------------------------------------------------------- the decision
def test_the_gpu_ask_follows_the_device_and_the_backend():
    cpu = _config()
    assert {rule: job_resources(cpu, rule)["gpu"] for rule in RULE_JOBS} == dict.fromkeys(RULE_JOBS, 0)
    assert {rule: job_resources(cpu, rule)["gpu_mem_mb"] for rule in RULE_JOBS} == dict.fromkeys(RULE_JOBS, 0)
    cuda = _config(**{"train.device": "cuda", "eval.device": "cuda"})
    asks = {rule: job_resources(cuda, rule)["gpu"] for rule in RULE_JOBS}
    # labels plays the train tasks on the CPU (`fedagent labels` takes no device)
    assert asks == {**dict.fromkeys(GPU_RULES, 1), "labels": 0}
    assert all(job_resources(cuda, rule)["gpu_mem_mb"] > 0 for rule in GPU_RULES)
    assert gpu_ask(cuda, "train") == (1, "train.device")
    # only the train job on cuda: eval stays a CPU job
    half = _config(**{"train.device": "cuda"})
    assert job_resources(half, "train_client")["gpu"] == 1 and job_resources(half, "eval")["gpu"] == 0


def test_verl_asks_its_gpus_and_the_warm_start_stays_one_local_job():
    cfg = _config(**{"train.device": "cuda", "train.backend": "verl", "train.verl.gpus": 2})
    assert gpu_ask(cfg, "train") == (2, "train.verl.gpus")
    assert job_resources(cfg, "train_client")["gpu"] == 2
    assert job_resources(cfg, "warm_start")["gpu"] == 1  # the local backend's fine-tune on train.device


# --------------------------------------------------------------------------- host memory
def test_host_memory_estimate_covers_the_measured_cpu_peaks():
    cfg = _config()
    # The default run's train job (SmolLM2-135M on the CPU) peaked at 5.3-6.7 GB RSS, its eval at 0.8-1.1 GB
    # (docs/results/cpu.md, docs/how-to/slurm.md): the declared mem_mb must cover both, without asking a
    # cluster-sized 64 GB.
    train, ev = job_host_mib(cfg, "train") * 2**20, job_host_mib(cfg, "eval") * 2**20
    assert 6.7e9 < train < 1.3 * 6.7e9, train
    assert 1.1e9 < ev < 4e9, ev
    assert job_resources(cfg, "train_client")["mem_mb"] == job_host_mib(cfg, "train")
    # It follows the model: a 1.7B GPU job holds its fp32 state dict on the host while loading and saving.
    big = _config(**{"model": "random:smollm2-1.7b", "train.device": "cuda", "eval.device": "cuda"})
    assert host_terms(big, "train")["load_and_save"] > 13e9
    assert job_host_mib(big, "train") > job_host_mib(cfg, "train")


# --------------------------------------------------------------------------- GPUs the machine shows
def _resources(cfg):
    return {rule: job_resources(cfg, rule) for rule in RULE_JOBS}


def test_asking_more_gpus_than_the_machine_shows_names_the_key():
    two, four = placement.parse_gpus("0:81559,1:81559"), placement.parse_gpus("0:81559,1:81559,2:81559,3:81559")
    cfg = _config(**{"train.device": "cuda", "train.backend": "verl", "train.verl.gpus": 4})
    assert re.match(
        r"^train\.verl\.gpus: rule train_client asks 4 GPUs per job but this machine has 2",
        gpu_fit_problem(cfg, _resources(cfg), two),
    )
    assert gpu_fit_problem(cfg, _resources(cfg), four) is None
    ev = _config(**{"eval.device": "cuda"})
    assert gpu_fit_problem(ev, _resources(ev), []).startswith("eval.device: rule eval asks 1 GPU(s) but no GPU")
    assert gpu_fit_problem(_config(), _resources(_config()), []) is None  # CPU jobs fit anywhere


@pytest.mark.workflow
@pytest.mark.slow
def test_a_local_run_asking_more_gpus_than_visible_stops_before_any_job(tmp_path):
    from workflow_helpers import make_workdir, snakemake_cmd

    work = make_workdir(tmp_path / "w")
    env = {**snakemake_env(warm=False), "FEDAGENT_GPUS": "0:81559,1:81559", "CUDA_VISIBLE_DEVICES": "1"}
    proc = snakemake_run(
        snakemake_cmd("--config", "train={device: cuda, backend: verl, verl: {gpus: 2}}"), work, env, 300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "fedagent: train.verl.gpus: rule train_client asks 2 GPUs per job but this machine has 1 visible" in out
    assert not (work / "results").exists(), "a job ran"


# --------------------------------------------------------------------------- the plans through profiles/slurm
def _plan(tmp: Path, *configfiles: Path, extra: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """rule → [{resource: value, "shell": command}] of a `snakemake -n -p --profile profiles/slurm` plan."""
    exe = Path(sys.executable).parent / "snakemake"
    cmd = [str(exe), "-n", "-p", "--profile", "profiles/slurm", "--directory", str(tmp), "--configfile"]
    cmd += [str(p) for p in (DEFAULT, *configfiles)] + list(extra)
    proc = snakemake_run(cmd, REPO, snakemake_env(warm=False), 300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs: dict[str, list[dict]] = {}
    rule = None
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.match(r"^\s*(?:local)?rule (\w+):", line)  # group jobs indent their rules
        if m:
            rule = m.group(1)
            jobs.setdefault(rule, []).append({})
        elif rule and line.strip().startswith("resources:"):
            jobs[rule][-1].update(kv.strip().split("=", 1) for kv in line.split(":", 1)[1].split(","))
        elif rule and line.startswith("Shell command:"):
            jobs[rule][-1]["shell"] = line.split(":", 1)[1].strip()
    return jobs


def _the_fit_check_asks_the_planned_rules(jobs: dict, cfg: dict) -> None:
    """job_resources.planned_rules (what the start-up fit check asks) names exactly the model-running rules
    of the workflow's own plan: it restates the workflow's conditions, so the two must not drift apart."""
    from fedagent.model.job_resources import planned_rules

    assert set(planned_rules(cfg)) == set(jobs) & set(RULE_JOBS), sorted(jobs)


@pytest.mark.workflow
@pytest.mark.slow
@pytest.mark.parametrize("preset", GPU_PRESETS, ids=lambda p: p.stem)
def test_gpu_presets_plan_a_gpu_on_every_gpu_job_and_none_on_the_others(preset, tmp_path):
    jobs = _plan(tmp_path, preset)
    assert {"train_client", "eval"} <= set(jobs)
    _the_fit_check_asks_the_planned_rules(
        jobs, fc.prepare_config(fc.merge_into(fc.load_file(DEFAULT), fc.load_file(preset)))
    )
    for rule, planned in jobs.items():
        for job in planned:
            if rule in GPU_RULES:
                assert int(job["gpu"]) >= 1 and int(job["gpu_mem_mb"]) > 0, (rule, job)
                assert job["shell"].startswith(
                    f"FEDAGENT_JOB_GPUS={job['gpu']} FEDAGENT_JOB_GPU_MEM_MB={job['gpu_mem_mb']} fedagent "
                ), (rule, job["shell"][:120])
                # the job's own host-memory estimate, not the profile's default or a cluster-sized constant
                assert job["mem_mb"] not in ("16000", "64000"), (rule, job)
            else:
                assert job.get("gpu", "0") == "0", (rule, job)


@pytest.mark.workflow
@pytest.mark.slow
def test_the_default_cpu_run_plans_no_gpu_and_its_estimated_memory(tmp_path):
    jobs = _plan(tmp_path)
    cfg = _config()
    _the_fit_check_asks_the_planned_rules(jobs, cfg)
    for rule, planned in jobs.items():
        for job in planned:
            assert job.get("gpu", "0") == "0", (rule, job)
            if rule in GPU_RULES:
                assert job["shell"].startswith("FEDAGENT_JOB_GPUS=0 FEDAGENT_JOB_GPU_MEM_MB=0 fedagent "), rule
    assert {j["mem_mb"] for j in jobs["train_client"]} == {str(job_host_mib(cfg, "train"))}
    assert {j["mem_mb"] for j in jobs["eval"]} == {str(job_host_mib(cfg, "eval"))}


@pytest.mark.workflow
@pytest.mark.slow
def test_per_client_evals_and_hardness_labels_are_planned_rules_too(tmp_path):
    """The two conditional model-running rules no GPU preset plans: per-client evals and the hardness labels."""
    extra = tmp_path / "extra.yaml"
    extra.write_text("eval: {clients: true}\npartition: {strategy: hardness, labels_model: smollm2}\n")
    jobs = _plan(tmp_path / "work", extra)
    assert {"eval_client", "labels"} <= set(jobs)
    _the_fit_check_asks_the_planned_rules(
        jobs, fc.prepare_config(fc.merge_into(fc.load_file(DEFAULT), fc.load_file(extra)))
    )


def test_a_rule_the_run_never_plans_does_not_refuse_it_on_the_card():
    """The 7B LoRA preset's jobs fit one 80 GB card; its config's warm start (off) would be a 201 GB full
    fine-tune: the fit check asks only the planned rules (seen refusing the run on an H100 when it asked all)."""
    from fedagent.model.job_resources import planned_rules

    cfg = fc.prepare_config(
        fc.merge_into(fc.load_file(DEFAULT), fc.load_file(REPO / "config/experiments/gpu-lora-7b.yaml"))
    )
    h100 = [placement.Card(index=0, total_mib=81559)]
    every = {rule: job_resources(cfg, rule, card_mib=h100[0].usable_mib()) for rule in RULE_JOBS}
    planned = {rule: every[rule] for rule in planned_rules(cfg)}
    assert set(planned) == {"train_client", "eval"}
    assert gpu_fit_problem(cfg, planned, h100) is None
    assert "rule warm_start" in (gpu_fit_problem(cfg, every, h100) or "")


@pytest.mark.workflow
def test_the_7b_lora_preset_starts_on_one_80gb_card(tmp_path):
    """Through Snakemake's start-up check on an H100-sized card (FEDAGENT_GPUS): its planned jobs fit, so the
    run starts (one CPU job asked for); the warm start it never runs is not asked about."""
    from workflow_helpers import snakemake_cmd

    # the card as the node shows it: no CUDA_VISIBLE_DEVICES (a value here would hide FEDAGENT_GPUS's card)
    # FEDAGENT_DISK_CHECK=0: the start-up disk check measures this machine's free space against the run's
    # 46 GB of bf16 7B model dirs (it refused here with 44.3 GB free); what is asked is the GPU fit
    env = {**snakemake_env(warm=False), "FEDAGENT_GPUS": "0:81559", "FEDAGENT_DISK_CHECK": "0"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = snakemake_cmd("--configfile", str(REPO / "config/experiments/gpu-lora-7b.yaml"), "--directory", str(tmp_path))
    proc = snakemake_run([*cmd, "results/gpu-lora-7b/round_001/selection.json"], REPO, env, 300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "results/gpu-lora-7b/round_001/selection.json").is_file()


@pytest.mark.parametrize("preset", GPU_PRESETS, ids=lambda p: p.stem)
def test_every_gpu_preset_s_planned_jobs_fit_one_h100_and_one_h200(preset):
    """The start-up check (Snakemake's onstart; `-n` plans skip it) passes for each GPU preset on the cards
    the docs run it on: one 80 GB H100 and one 141 GB H200 (a job alone on its card at worst)."""
    from fedagent.model.job_resources import planned_rules

    cfg = fc.prepare_config(fc.merge_into(fc.load_file(DEFAULT), fc.load_file(preset)))
    for total in (81559, 143771):
        card = placement.Card(index=0, total_mib=total)
        planned = {rule: job_resources(cfg, rule, card_mib=card.usable_mib()) for rule in planned_rules(cfg)}
        assert gpu_fit_problem(cfg, planned, [card]) is None, (preset.stem, total)
