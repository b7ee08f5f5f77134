"""One client's round through verl: task rows → ``verl.trainer.main_ppo`` → fp32 update dir.

Same contract as :func:`fedagent.train.local.train_client`: the output dir (written with
:func:`fedagent.core.atomic.atomic_dir`) holds the fp32 HF model, ``metrics.json`` (with
``num_samples``/``num_tokens`` for aggregation weights) and ``samples.jsonl`` (one line
per episode), so aggregate/merge/verify/eval do not know which backend trained.

The job's env service is started by ``fedagent train-client`` (as for the local backend);
the agent loops in verl's Ray workers connect to it by the address in the agent-loop YAML.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path

from fedagent.core import placement
from fedagent.core.config import JobKeys
from fedagent.train.update_transform import UpdateTransform
from fedagent.core.seeds import derive_seed
from fedagent.train.epilogue import ModelUpdate, require_start_critic, seconds, write_client_update
from fedagent.train.verl import job_files, launch, refit, sizing, steplog
from fedagent.train.verl.overrides import build_overrides
from fedagent.train.verl.settings import VerlSettings


# The verl job's own config keys (beyond TrainParams): checked by the job as planning checked them.
VERL_KEYS = JobKeys(
    "train-client-verl",
    {
        "backend": "train.backend",
        "ref_anchor": "train.ref_anchor",
        "kl_coef": "train.kl_coef",
        "fedprox_mu": "train.fedprox_mu",
        "rollout_mode": "rollout.mode",
        "algorithm": "train.algorithm",
        "mini_batch_size": "train.mini_batch_size",
        "group_size": "train.group_size",
        "groups_per_epoch": "train.groups_per_epoch",
        "residual_dtype": "train.residual_dtype",
        "clip_ratio_c": "train.clip_ratio_c",
        "activation_checkpointing": "train.activation_checkpointing",
        "deterministic": "deterministic",
        "lora": "train.lora.enabled",  # refused (a cross rule): the verl backend trains the full model
    },
)


MEMORY_PREFIX = "fedagent: verl memory: "  # the job log's line with its sized memory settings

# What metrics.json records of the engine set a job ran on (train.verl.engines: run).
# reset_release: what the job's reset freed of each engine's old model (fedagent.train.verl.release)
ENGINE_SET_KEYS = (
    "set",
    "warm",
    "jobs_before",
    "fit_s",
    "slot_wait_s",
    "memory_gb",
    "memory_growth_gb",
    "reset_release",
)


def check_job_keys(values: dict) -> None:
    """The verl job's key checks (ConfigError naming the key), before any work."""
    VERL_KEYS.check(values)


def read_episodes(path: Path) -> list[dict]:
    """The agent loops' episode records in a fixed order (epoch, group, session), not arrival order."""
    if not Path(path).is_file():
        return []
    recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return sorted(recs, key=lambda r: (r["epoch"], r["group"], r["session"], r["seed"]))


def check_sampling_seeds(episodes: list[dict], base_seed: int, round: int, client: int) -> None:
    """Fail closed unless every recorded turn was sampled with its own request seed
    (:func:`fedagent.core.seeds.request_seed` of this job and the turn's place): the samples are then
    this job's whichever engine (a cold one, a warm set's) served them."""
    from fedagent.core.seeds import request_seed

    for e in episodes:
        for k, t in enumerate(e["turns"]):
            want = request_seed(
                base_seed,
                round=round,
                client=client,
                epoch=int(e["epoch"]),
                group=int(e["group"]),
                session=int(e["session"]),
                turn=k,
            )
            if t.get("sampling_seed") != want:
                raise RuntimeError(
                    f"episode (epoch {e['epoch']}, group {e['group']}, session {e['session']}) turn {k}: "
                    f"sampled with seed {t.get('sampling_seed')!r}, not its own {want} "
                    "(fedagent.core.seeds.request_seed); refusing the update"
                )


def episode_metrics(episodes: list[dict]) -> dict:
    """Sample/token counts and return statistics over the recorded episodes."""
    turns = [t for e in episodes for t in e["turns"] if t["response_tokens"] > 0]
    returns = [float(e["return"]) for e in episodes]
    return {
        "num_samples": len(turns),
        "num_tokens": sum(t["response_tokens"] for t in turns),
        "num_prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "num_episodes": len(episodes),
        "mean_return": math.fsum(returns) / len(returns) if returns else 0.0,
        "success_rate": sum(bool(e["won"]) for e in episodes) / len(episodes) if episodes else 0.0,
    }


def train_client_verl(
    model_dir: Path,
    ref_model_dir: Path | None,
    env_address: dict,
    *,
    round: int,
    client: int,
    params,
    settings: VerlSettings,
    out_dir: Path,
    quarantine: Path | None = None,
    transform: UpdateTransform | None = None,
) -> dict:
    """Run one verl job for this client and round; write the update dir (a Byzantine client's
    ``transform`` of it: fedagent.train.update_transform); return the metrics."""
    from fedagent.core.atomic import verifying
    from fedagent.core.progress import Progress
    from fedagent.core.timing import PhaseClock
    from fedagent.model.critic_dir import critic_of
    from fedagent.train.local import epoch_task_seeds, same_weights
    from fedagent.train.verl.convert import write_critic_update, write_update

    clock = PhaseClock()  # process start → …: the same timings block as the local backend
    t0 = time.time()
    p = params
    ppo = p.algorithm == "ppo"
    if ppo:
        require_start_critic(model_dir)
    ref_dir = None
    if ref_model_dir is not None and p.kl_coef and not same_weights(model_dir, ref_model_dir):
        # Another reference than the start model (train.ref_anchor: base, rounds >= 2): verl builds it
        # with the start model's HF config, so its weights must fit that config exactly.
        from fedagent.train.verl.ref_model import same_architecture

        if not same_architecture(model_dir, ref_model_dir):
            raise ValueError(
                f"train.backend=verl: the KL reference {ref_model_dir} is not the architecture of the "
                f"start model {model_dir} (config.json differs), and verl builds it with the start "
                "model's config"
            )
        ref_dir = Path(ref_model_dir).resolve()
    out_dir = Path(out_dir)
    workdir = out_dir.parent / f".verl-{out_dir.name}"
    # The start model's (and another reference's) manifests: listings and sizes now, every file's
    # sha256 in threads while verl runs (at 1.7B ≈ 7 GB a dir, no longer hashed before the launch);
    # the update is committed only after they pass (inputs.wait() in the atomic_dir below).
    inputs_to_check = [Path(model_dir)] + ([Path(ref_model_dir)] if ref_dir is not None else [])
    engines = settings.engines == "run"
    with verifying(inputs_to_check) as inputs, launch.isolated_job(workdir, round=round, client=client) as job:
        rows = job_files.write_rows(job.workdir / "rows.parquet", job_files.task_rows(p, round, client))
        # named by the attempt's tag, as its checkpoint dir: a dying process of an earlier attempt (a killed
        # job's engine set, a stale trainer) cannot write into this attempt's files
        record = job.workdir / f"episodes-{job.tag}.jsonl"
        yaml_path = job_files.write_agent_loop_yaml(
            job.workdir / "agent_loop.yaml",
            env_uds=env_address.get("uds"),
            env_url=env_address.get("base_url"),
            env_token=env_address.get("token"),
            p=p,
            record_file=record,
            history_length=p.history,
            # a warm refit reaches its agent loops' env address through the per-episode job file, as a
            # run-scoped engine set reaches a later job's
            job_file=job.workdir / "agent_loop_job.json" if (settings.warm_refit or engines) else None,
            model_dir=Path(model_dir).resolve(),
        )
        # memory settings sized from the job's declared memory (fedagent.train.verl.sizing)
        memory = sizing.job_memory(p, settings, Path(model_dir))
        print(f"{MEMORY_PREFIX}{json.dumps(memory.record(), sort_keys=True)}", flush=True)
        overrides = build_overrides(
            p,
            settings,
            memory=memory,
            job=job,
            model_dir=Path(model_dir).resolve(),
            rows=rows,
            agent_loop_yaml=yaml_path,
            rollout_seed=derive_seed(p.base_seed, "rollout_sampling", round=round, client=client) % 2**31,
            ref_model_dir=ref_dir,
        )
        reply = None
        if engines:  # the slot's run-scoped engine set (fedagent.train.verl.engines)
            reply, trainer_s, t_launch = _on_engines(job, overrides, yaml_path, settings, out_dir, client, clock)
            attempts = 1
            marks: dict = {}
        else:
            attempts = 0
            while True:
                attempts += 1
                marks: dict = {}
                t_launch = time.time()
                clock.set("trainer_launch", t_launch)
                try:
                    # progress lines (fedagent.core.progress): verl's training steps as its log shows them
                    # (a warm refit's first fit counts too; the count stops at the total)
                    with Progress(f"train_client/{client}", "steps", int(p.epochs)) as progress:
                        trainer_s = launch.run_trainer(
                            launch.trainer_command(overrides, warm_refit=settings.warm_refit),
                            launch.job_environ(job),
                            job.log,
                            marks=marks,
                            workdir=job.workdir,
                            on_line=lambda text: progress.advance(len(steplog.step_metrics_in(text))),
                        )
                    break
                except RuntimeError:
                    if attempts > 1 or not launch.port_collision(job.log):
                        raise
                    # Relaunch once on a port collision, from scratch (the failed log is echoed first).
                    _echo(job.log)
                    job.log.rename(job.log.with_suffix(".portfail"))
                    shutil.rmtree(job.ckpt_dir, ignore_errors=True)
                    record.unlink(missing_ok=True)
                finally:
                    _echo(job.log)  # into the rule's log (stdout), before the work dir goes
        actor = launch.final_checkpoint(job.ckpt_dir)
        log_text = job.log.read_text(errors="replace")
        warm = bool(reply and reply["warm"])  # a job on an engine set that was reset to its start
        if ref_dir is not None and not warm:  # (a warm job's reference: its reset lines, below)
            from fedagent.train.verl.ref_model import check_loaded

            # fail closed: without the loaded line the KL reference was the start model, not ref_model_dir
            check_loaded(job.log, ref_dir)
        if ppo:
            from fedagent.train.verl.critic_loss import ARMED_LINE

            # fail closed: without the armed line the critic trained verl's own loss, not legacy_exact
            if ARMED_LINE not in log_text:
                raise RuntimeError(
                    f"{job.log}: no '{ARMED_LINE}' line: the job's critic did not train the "
                    "legacy_exact loss (fedagent.train.verl.critic_loss); refusing its update"
                )
            from fedagent.train.verl.critic_attn import armed_line

            # fail closed as well: without it verl loaded the critic its own way (flash_attention_2 hard-coded)
            if armed_line() not in log_text:
                raise RuntimeError(
                    f"{job.log}: no '{armed_line()}' line: the critic's loader was not armed "
                    "(fedagent.train.verl.critic_attn); refusing its update"
                )
            critic_ckpt = actor.parent / "critic"
            if not (critic_ckpt / "fsdp_config.json").is_file():
                raise RuntimeError(f"{critic_ckpt}: verl wrote no critic checkpoint")
        t_refit = (
            refit_started(log_text, Path(model_dir).resolve(), ref_dir, has_ref=float(p.kl_coef) > 0)
            if settings.warm_refit or warm
            else None
        )
        # a refit's cold start is its first fit's first token (logged before that fit's episodes were wiped)
        t_cold = refit.first_fit_token_at(log_text) if settings.warm_refit else None
        warm_start = {}
        episodes = read_episodes(record)
        check_sampling_seeds(episodes, p.base_seed, round, client)
        firsts = [e.pop("t_first_generation", None) for e in episodes]
        firsts = [t for t in firsts if t is not None]
        if firsts and t_refit is not None:  # a job on warm engines: its reset → its first token
            warm_start["refit_to_first_generation"] = seconds(min(firsts) - t_refit)
            if settings.warm_refit:  # the probe's launch → first token: its first fit's
                firsts = [t_cold] if t_cold is not None else []
        if firsts:
            marks["first_generation"] = seconds(min(firsts) - t_launch)
            clock.mark("first_token", min(firsts))
        if t_refit is not None:
            marks["refit"] = seconds(t_refit - t_launch)
        for name, secs in marks.items():
            if name != "first_generation":  # = first_token
                clock.mark(name, t_launch + secs)
        clock.mark("trainer_done", t_launch + trainer_s)
        # a warm refit's update is its second fit: verl's step records from after the refit line only
        steps = steplog.step_metrics_in(refit.after_refit(log_text) if settings.warm_refit else log_text)
        engine_check = {}
        if reply is not None:  # an engine set returns the steps as verl's Tracking got them: those count,
            engine_check = {"engine_steps_match": refit.steps_agree(reply["steps"], steps)}
            if not engine_check["engine_steps_match"]:  # and must agree with the job's own log lines
                raise RuntimeError(
                    f"train.verl.engines: the set returned steps {[r.get('step') for r in reply['steps']]} "
                    f"that disagree with the job's log lines {[r.get('step') for r in steps]}; "
                    "refusing the update"
                )
            steps = reply["steps"]
        records = steplog.step_records(steps)
        clock.phases.update(steplog.phase_totals(steps))
        # the probe of returned (not scraped) step metrics: the second fit's records as verl's Tracking got
        # them, against its console lines (a diagnostic; the log's lines stay the source)
        refit_check = (
            {"refit_steps_match": refit.steps_match(job.workdir / refit.STEPS_FILE, steps)}
            if settings.warm_refit
            else engine_check
        )
        t1 = time.time()

        def job_metrics(conv: dict) -> dict:
            # the conversion's seconds: the update's model files, written once the inputs verified
            convert_s = time.time() - t1
            metrics = {
                "round": round,
                "client": client,
                "backend": "verl",
                **episode_metrics(episodes),
                # verl's own per-step values (its console logger's lines); None where verl logged none
                "kl": steplog.mean_of(records, "kl"),
                "entropy": steplog.mean_of(records, "entropy"),
                "clipfrac": steplog.mean_of(records, "clipfrac"),
                "steps": records,
                "task_seeds": [epoch_task_seeds(p, round, client, e) for e in range(p.epochs)],
                "params": dataclasses.asdict(p),
                "verl": {
                    **dataclasses.asdict(settings),
                    "tag": job.tag,
                    "world_size": conv["world_size"],
                    # None: verl's KL reference was the start model
                    "ref_model": None if ref_dir is None else str(ref_dir),
                    "memory": memory.record(),  # the sized memory settings and their plan
                    **({"engine_set": {k: reply[k] for k in ENGINE_SET_KEYS}} if reply is not None else {}),
                },
                "timings_s": {
                    "trainer": seconds(trainer_s),
                    "convert": seconds(convert_s),
                    **{f"launch_to_{k}": v for k, v in sorted(marks.items())},
                    **warm_start,
                },
                "trainer_attempts": attempts,
                **refit_check,
                "verl_steps": steps,
                "wall_time_s": seconds(time.time() - t0),
                **placement.recorded(),  # the card(s) the job was placed on, if any
            }
            if ppo:  # verl's critic values per step (vf_loss, …) are in steps / verl_steps
                metrics["vf_loss"] = steplog.mean_of(records, "vf_loss")
            return metrics

        update = ModelUpdate(
            write_policy=lambda d: write_update(actor, model_dir, d),
            write_critic=(lambda d: write_critic_update(critic_ckpt, critic_of(model_dir), d)) if ppo else None,
        )
        # verl's updates record no provenance.json (the local backend's do)
        return write_client_update(
            out_dir,
            update,
            metrics=job_metrics,
            samples=episodes,
            clock=clock,
            quarantine=quarantine,
            inputs=inputs,
            transform=transform,
            start=Path(model_dir),
        )


def engines_dir(out_dir: Path) -> Path:
    """Where a run's engine-set slots live: ``<results>/<run>/.verl-engines`` for a workflow update dir
    (``<run>/round_<r>/clients/<c>``), else beside the update dir."""
    out_dir = Path(out_dir).resolve()
    if out_dir.parent.name == "clients" and out_dir.parent.parent.name.startswith("round_"):
        return out_dir.parents[2] / ".verl-engines"
    return out_dir.parent / ".verl-engines"


def _on_engines(job, overrides, yaml_path, settings, out_dir, client, clock):
    """One job on a slot's engine set: the request from the job's own overrides (so its dirs are named as
    the set's config names them); returns (the set's answer, seconds, when the request went)."""
    from fedagent.train.verl.engines import client as engines_client, keys

    _, own = keys.split(overrides)
    entry_job_file = json.loads((job.workdir / "agent_loop_job.json").read_text())
    from fedagent.train.verl.ref_model import REF_MODEL_ENV

    ref_key = f"+ray_kwargs.ray_init.runtime_env.env_vars.{REF_MODEL_ENV}="
    ref = next((o[len(ref_key) :] for o in overrides if o.startswith(ref_key)), None)
    request = {
        "tag": job.tag,
        "model_dir": own["actor_rollout_ref.model.path"],
        "ref_dir": ref,
        "critic_dir": own.get("critic.model.path"),
        "rows": own["data.train_files"],
        "ckpt_dir": own["trainer.default_local_dir"],
        "job_file": entry_job_file,
    }
    t_asked = time.time()
    try:
        reply = engines_client.run_job(
            sets_dir=engines_dir(out_dir),
            n_sets=settings.engine_sets,
            preferred=client,
            overrides=overrides,
            agent_loop_yaml=yaml_path,
            request=request,
            log=job.log,
            env=launch.job_environ(job),
            idle_s=settings.engines_idle_s,
            max_growth_gb=settings.engines_max_growth_gb,
        )
    finally:
        _echo(job.log)  # into the rule's log (stdout), before the work dir goes
    # the job's launch is its request (sent once it had its slot: the wait for a busy slot is not start-up)
    clock.set("trainer_launch", reply["t_request"])
    reply["slot_wait_s"] = seconds(reply["t_slot"] - t_asked)
    return reply, time.time() - reply["t_request"], reply["t_request"]


def refit_started(log_text: str, model_dir: Path, ref_dir: Path | None = None, *, has_ref: bool = True) -> float:
    """When a ``train.verl.warm_refit`` job's reset began; fail closed without the refit line, without the
    workers' reset lines (anywhere in the log) naming the start model, or — when the job has a KL reference
    (``has_ref``) — without reference reset lines naming exactly its reference (the update would be the
    first fit's, or from engines not reset, or reset from another model)."""
    t = refit.started_at(log_text)
    if t is None:
        raise RuntimeError(
            f"train.verl.warm_refit: no '{refit.REFIT_PREFIX}' line in the job's log: verl did not "
            "refit (fedagent.train.verl.refit); refusing the update"
        )
    # Only the refit's reset prints these, from the workers: searched in the whole log, since Ray forwards
    # each process's output on its own and need not keep the TaskRunner's refit line ahead of them.
    paths = refit.reset_paths(log_text)
    if not paths:
        raise RuntimeError(
            f"train.verl.warm_refit: no '{refit.RESET_LINE}' line in the job's log: the "
            "engines were not reset; refusing the update"
        )
    if set(paths) != {str(model_dir)}:
        raise RuntimeError(
            f"train.verl.warm_refit: the engines were reset from {sorted(set(paths))}, not only from "
            f"the start model {model_dir}; refusing the update"
        )
    refs = set(refit.reset_paths(log_text, refit.REF_RESET_LINE))
    want = str(ref_dir if ref_dir is not None else model_dir)
    if (refs != {want}) if has_ref else (refs - {want}):  # no KL term: verl built no reference
        raise RuntimeError(
            f"train.verl.warm_refit: the KL reference was reset from {sorted(refs)}, not {want}; refusing the update"
        )
    return t


def _echo(log: Path) -> None:
    if Path(log).is_file():
        sys.stdout.write(Path(log).read_text(errors="replace"))
        sys.stdout.flush()
