"""``train.verl.warm_refit``: a job fits twice on the same live verl engines — the probe of the
run-scoped engines (docs/explanation/verl-engines.md).

A verl job spends ≈ 3 minutes starting processes for seconds of work (docs/results/verl.md). The run-scoped
design keeps the engines alive between jobs and resets them per job; what a job on warm engines
costs, and whether the reset is complete, is what this measures inside one ordinary job:
``python -m fedagent.train.verl.refit`` is verl 0.9.1's ``main_ppo`` with :func:`runner_class` as its
TaskRunner, which fits once, then puts the live trainer back where a fresh job starts
(:func:`reset_for_refit`) and fits again. The second fit's checkpoint and episodes are the job's
update, so aggregate/merge/eval and ``fedagent verify`` see an ordinary job.

The reset uses verl's own constructors, not hand-made state surgery: the actor and its KL reference
are rebuilt by ``TrainingWorker.reset()`` (verl's ``FSDPEngine.initialize``: the module read again from
the start model dir, a new optimizer and LR scheduler), in a worker method :func:`arm` adds to verl's
``ActorRolloutRefWorker`` (armed in every Ray worker by :mod:`fedagent.train.verl.ray_hook` when the
job's runtime env carries :data:`REFIT_ENV`); the critic likewise (``critic_wg.reset()``, PPO); a new
dataloader over the same rows, a new replay buffer, ``global_steps`` 0, an empty TransferQueue; the
first fit's checkpoint and episode record removed; the reset weights synced into the vLLM replicas
(verl's ``on_init_end``). Before each engine is rebuilt its old model and optimizer are freed
(:func:`fedagent.train.verl.release.release_engine`: torch's FSDP1 would otherwise keep every old model's
weights, one per trained engine per reset).
Not reset: vLLM's engine RNG (seeded once). It decides no sample: the agent loop gives every request
the job's own seed (:func:`fedagent.core.seeds.request_seed`), so the second fit samples as a fresh job.

The job's log gets :func:`refit_line` (when the reset began) and :data:`RESET_LINE` (from the worker,
with the directory it reloaded); the backend refuses a warm-refit job without both and reads verl's
step records from after the refit line only.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

REFIT_ENV = "FEDAGENT_VERL_WARM_REFIT"
MODULE = "fedagent.train.verl.refit"
REFIT_PREFIX = "fedagent: warm refit begins at "
RESET_LINE = "fedagent: engines reset, actor reloaded from "
REF_RESET_LINE = "fedagent: engines reset, KL reference reloaded from "
TARGET_MODULE = "verl.workers.engine_workers"
TARGET_CLASS = "ActorRolloutRefWorker"
METHOD = "fedagent_reset_engines"
CRITIC_CLASS = "TrainingWorker"
PATH_METHOD = "fedagent_set_model_path"
RELEASE_METHOD = "fedagent_release_model"
TQ_PARTITION = "train"
CLEARED_PREFIX = "fedagent: warm refit cleared leftover TransferQueue entries: "
FIRST_FIT_TOKEN_PREFIX = "fedagent: the first fit's first token at "


def refit_line(t: float) -> str:
    """The line the TaskRunner prints when the reset for the second fit begins (``t``: epoch seconds)."""
    return f"{REFIT_PREFIX}{t:.3f}"


def _last(log_text: str, prefix: str) -> tuple[int, str] | None:
    """(offset after the line, rest of the line) of the last line containing ``prefix``."""
    found = None
    pos = 0
    for line in log_text.splitlines(keepends=True):
        i = line.find(prefix)
        if i >= 0:
            found = (pos + len(line), line[i + len(prefix) :].strip())
        pos += len(line)
    return found


def first_fit_token_at(log_text: str) -> float | None:
    """When the first fit's first rollout token came (the job's cold start), as the refit logged it
    before wiping the first fit's episodes; None without the line."""
    hit = _last(log_text, FIRST_FIT_TOKEN_PREFIX)
    return None if hit is None or hit[1] == "none" else float(hit[1].split()[0])


def started_at(log_text: str) -> float | None:
    """When the (last) warm refit began, from its :func:`refit_line`; None if the log has none."""
    hit = _last(log_text, REFIT_PREFIX)
    return None if hit is None else float(hit[1].split()[0])


def after_refit(log_text: str) -> str:
    """The log after the last refit line (the second fit's output); '' if there is none."""
    hit = _last(log_text, REFIT_PREFIX)
    return "" if hit is None else log_text[hit[0] :]


def reset_paths(log_text: str, prefix: str = RESET_LINE) -> list[str]:
    """The directories named by every ``prefix`` line (:data:`RESET_LINE`, :data:`REF_RESET_LINE`) in
    ``log_text`` (Ray prefixes worker lines)."""
    from fedagent.train.verl.steplog import marked

    return marked(log_text, prefix)


def reset_engines(self, model_dir: str | None = None, ref_dir: str | None = None) -> dict:
    """A worker method of verl's ``ActorRolloutRefWorker`` (ONE_TO_ALL, added by :func:`arm`): rebuild
    its KL reference and actor as ``init_model`` built them — ``reset()`` = verl's engine
    ``initialize()``: the module from the model config's ``local_path``, a new optimizer and LR
    scheduler. ``model_dir`` / ``ref_dir``: the actor's / reference's new ``local_path`` first (the engine
    reads it at ``reset``). Only the weights' path changes: the HF config, tokenizer and the agent loop's
    stop tokens stay the first job's, so a later job's model must be the same architecture (a round's
    aggregate always is). The actor keeps its loss function (set on the worker, not the engine). Each
    engine's old model and optimizer are freed before its rebuild
    (:func:`fedagent.train.verl.release.release_engine`), so the reset never holds two models and leaves
    none behind. Returns ``{"path": the actor's dir, "released": the two release records}``."""
    from verl.utils.memory_utils import aggressive_empty_cache

    from fedagent.train.verl.release import release_engine

    actor = getattr(self, "actor", None)
    if actor is None:
        raise RuntimeError(f"{TARGET_CLASS} has no actor engine: nothing to reset for the warm refit")
    if model_dir is not None:
        actor.engine.model_config.local_path = str(model_dir)
    released = []
    ref = getattr(self, "ref", None)
    if ref is not None:
        if ref_dir is not None:
            ref.engine.model_config.local_path = str(ref_dir)
        released.append(release_engine(ref.engine, "ref"))
        ref.reset()
        print(f"{REF_RESET_LINE}{ref.engine.model_config.local_path}", flush=True)
    released.append(release_engine(actor.engine, "actor"))
    actor.reset()
    aggressive_empty_cache(force_sync=True)
    path = str(actor.engine.model_config.local_path)
    print(f"{RESET_LINE}{path}", flush=True)
    return {"path": path, "released": released}


def set_model_path(self, model_dir: str) -> str:
    """A worker method of verl's ``TrainingWorker`` (ONE_TO_ALL, added by :func:`arm`; the PPO critic's
    worker group): the engine's ``local_path``, read by its next ``reset()``."""
    self.engine.model_config.local_path = str(model_dir)
    return str(model_dir)


def release_model(self) -> dict:
    """A worker method of verl's ``TrainingWorker`` (ONE_TO_ALL, added by :func:`arm`; the PPO critic's
    worker group): free its engine's model and optimizer before verl's ``reset()`` rebuilds them
    (:func:`fedagent.train.verl.release.release_engine`); the release record."""
    from fedagent.train.verl.release import release_engine

    return release_engine(self.engine, "critic")


def _patch(module) -> None:
    from verl.single_controller.base.decorator import Dispatch, register

    from fedagent.train.verl.memory import CENSUS_METHOD, MEMORY_METHOD, allocated_gb, device_tensors

    for cls_name, name, fn in (
        (TARGET_CLASS, METHOD, reset_engines),
        (CRITIC_CLASS, PATH_METHOD, set_model_path),
        (CRITIC_CLASS, RELEASE_METHOD, release_model),
        *((c, MEMORY_METHOD, allocated_gb) for c in (TARGET_CLASS, CRITIC_CLASS)),
        *((c, CENSUS_METHOD, device_tensors) for c in (TARGET_CLASS, CRITIC_CLASS)),
    ):
        owner = getattr(module, cls_name, None)
        if owner is None:
            raise RuntimeError(f"{TARGET_MODULE}.{cls_name} is missing: cannot add the warm refit's {name}")
        if getattr(owner, name, None) is None:
            setattr(owner, name, register(dispatch_mode=Dispatch.ONE_TO_ALL)(fn))


def arm() -> None:
    """Give verl's ``ActorRolloutRefWorker`` the :func:`reset_engines` method and its ``TrainingWorker``
    (the critic's) :func:`set_model_path` and :func:`release_model`, both the memory readings of :mod:`fedagent.train.verl.memory`,
    in this process (now or when verl's module is imported); both the TaskRunner (which binds
    worker-group methods from the class) and the workers (which run them) need them."""
    from fedagent.train.verl.post_import import patch_on_import

    patch_on_import(TARGET_MODULE, _patch, "add the warm refit's engine reset", key="warm_refit")


def record_files(config) -> list[str]:
    """The episode record files of the job's agent loops (from its agent-loop YAML, or the job file it names)."""
    import json

    import yaml

    path = config.actor_rollout_ref.rollout.agent.get("agent_loop_config_path")
    if not path:
        return []
    out = []
    for e in yaml.safe_load(Path(path).read_text()) or []:
        if e.get("job_file"):
            e = json.loads(Path(e["job_file"]).read_text())
        if e.get("record_file"):
            out.append(str(e["record_file"]))
    return out


def reset_for_refit(trainer, config) -> None:
    """Put a fitted v1 trainer back where a fresh job starts (see the module doc): the first fit's Tracking
    finished, its checkpoint and episodes removed, then :func:`reset_trainer` from the job's own dirs."""
    tracking = getattr(trainer, "logger", None)
    if tracking is not None:
        tracking.finish(exit_code=0)
    # The first fit's outputs are not the job's: its checkpoint and episodes go (its first token's time,
    # the job's cold start, is logged first).
    shutil.rmtree(str(config.trainer.default_local_dir), ignore_errors=True)
    firsts = []
    for record in record_files(config):
        if Path(record).is_file():
            for line in Path(record).read_text().splitlines():
                t = json.loads(line).get("t_first_generation") if line.strip() else None
                if t is not None:
                    firsts.append(float(t))
        Path(record).write_text("")
    print(f"{FIRST_FIT_TOKEN_PREFIX}{min(firsts):.3f}" if firsts else f"{FIRST_FIT_TOKEN_PREFIX}none", flush=True)
    # The start dirs passed on, as a run-scoped engine set passes a later job's (verl's local_path of a
    # local dir is the dir itself; use_shm is refused before the first fit); the KL reference's: the
    # job's other model when ref_model armed one (train.ref_anchor: base), else the start model.
    from fedagent.train.verl.ref_model import REF_MODEL_ENV

    model = str(config.actor_rollout_ref.model.path)
    reset_trainer(
        trainer,
        model_dir=model,
        ref_dir=os.environ.get(REF_MODEL_ENV) or model,
        critic_dir=str(config.critic.model.path) if trainer.use_critic else None,
    )


def reset_trainer(trainer, *, model_dir: str, ref_dir: str, critic_dir: str | None) -> list[dict]:
    """Put a fitted v1 trainer's engines and state where a fresh job from ``model_dir`` (KL reference
    ``ref_dir``, critic ``critic_dir``) starts, in verl's own order: replicas asleep, engines rebuilt (each
    after its old model is freed), data and step state new, weights synced into the replicas. The trainer's
    config must already name the job's rows and checkpoint dir (``data.train_files``,
    ``trainer.default_local_dir``): the new dataloader and the save read them. Returns the release records
    of every rank's engines (:func:`fedagent.train.verl.release.release_engine`)."""
    trainer.checkpoint_manager.sleep_replicas()
    # A fresh job's TransferQueue is empty: the replay buffer samples whatever the partition holds
    # (sorted by the prompts' global step, which restarts at 1), so nothing of the last fit may stay.
    import transfer_queue as tq

    left = (tq.kv_list(TQ_PARTITION) or {}).get(TQ_PARTITION, {})
    if left:
        tq.kv_clear(partition_id=TQ_PARTITION, keys=list(left))
    print(f"{CLEARED_PREFIX}{len(left)}", flush=True)
    released = [
        rec
        for rank in getattr(trainer.actor_rollout_wg, METHOD)(str(model_dir), str(ref_dir))
        for rec in rank["released"]
    ]
    if trainer.use_critic:
        if critic_dir is None:
            raise ValueError("reset_trainer: a PPO trainer needs the job's critic dir")
        getattr(trainer.critic_wg, PATH_METHOD)(str(critic_dir))
        released += getattr(trainer.critic_wg, RELEASE_METHOD)()
        trainer.critic_wg.reset()
    trainer._init_dataloader()
    trainer._init_dump_executor()
    trainer.replay_buffer = trainer._build_replay_buffer()
    trainer.local_trigger_step = 0
    trainer._restored_tq_prompt_count = 0
    trainer._load_checkpoint()  # resume_mode=disable: global_steps = 0
    trainer.on_init_end()  # the sync trainer: the reset weights into the vLLM replicas
    return released


def check_config(config, what: str = "train.verl.warm_refit") -> None:
    """What the reset needs of verl's config (raised before any engine starts)."""
    if config.trainer.v1.trainer_mode != "sync":
        raise ValueError(f"{what} needs verl's sync trainer (trainer.v1.trainer_mode=sync)")
    if config.actor_rollout_ref.model.get("use_shm"):
        raise ValueError(
            f"{what}: actor_rollout_ref.model.use_shm loads the model from a copy "
            "elsewhere, and the reset reloads the start dir itself; unsupported"
        )
    if config.algorithm.get("use_kl_in_reward"):
        raise ValueError(
            f"{what}: algorithm.use_kl_in_reward keeps an adaptive KL controller in the trainer "
            "that the reset does not rebuild; unsupported"
        )


def fit_recorded(trainer, agent_loop_manager) -> list:
    """``trainer.fit`` with verl's ``Tracking`` recording every step's metrics (:func:`recording_tracking`);
    the records, in order."""
    import verl.trainer.ppo.v1.trainer_base as trainer_base

    steps: list = []
    plain = trainer_base.Tracking
    trainer_base.Tracking = recording_tracking(plain, steps)
    try:
        trainer.fit(agent_loop_manager)
    finally:
        trainer_base.Tracking = plain
    return steps


STEPS_FILE = "refit_steps.json"  # beside the job's checkpoint dir: the second fit's metrics as returned


def recording_tracking(base, sink: list):
    """A subclass of verl's ``Tracking`` that also appends every ``log(data, step)`` to ``sink`` as one
    numeric record (what a run-scoped engine set would return to its job instead of a shared stdout)."""

    class RecordingTracking(base):
        def log(self, data, step, backend=None):
            rec = {"step": int(step)}
            for k, v in data.items():
                try:
                    rec[str(k)] = float(v)
                except (TypeError, ValueError):
                    continue
            sink.append(rec)
            return super().log(data=data, step=step, backend=backend)

    return RecordingTracking


def steps_file(config) -> Path:
    return Path(str(config.trainer.default_local_dir)).parent / STEPS_FILE


def steps_match(path: Path, logged: list[dict]) -> bool | None:
    """Whether the recorded second-fit steps (:data:`STEPS_FILE`) carry the values of the log's step lines
    (every key a line has, relative 1e-6); None when the file is missing."""

    if not Path(path).is_file():
        return None
    return steps_agree(json.loads(Path(path).read_text()), logged)


def steps_agree(recorded: list[dict], logged: list[dict]) -> bool:
    """Whether recorded step metrics carry the values of the log's step lines (every key a line has,
    relative 1e-6), step for step."""
    import math

    if [r["step"] for r in recorded] != [r["step"] for r in logged]:
        return False
    return all(
        k in rec and math.isclose(rec[k], v, rel_tol=1e-6, abs_tol=1e-12)
        for rec, line in zip(recorded, logged)
        for k, v in line.items()
        if k != "step"
    )


def runner_class():
    """verl 0.9.1's ``TaskRunnerV1`` whose ``run`` fits, resets and fits again (a Ray actor class)."""
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.main_ppo import TaskRunnerV1

    base = TaskRunnerV1.__ray_actor_class__

    class RefitTaskRunner(base):
        def run(self, config):
            # TaskRunnerV1.run of verl 0.9.1, with the refit between two fits.
            import transfer_queue as tq
            from verl.trainer.ppo.v1 import get_trainer_cls
            from verl.utils.logging_utils import configure_verl_logging

            configure_verl_logging()
            check_config(config)
            trainer_cls = get_trainer_cls(config.trainer.v1.trainer_mode)
            config.transfer_queue.enable = True
            OmegaConf.resolve(config)
            self.config = config
            tq.init(config.transfer_queue)
            succeeded = False
            try:
                self.trainer = trainer_cls(config=config)
                self.trainer.init()
                self.init_agent_loop_manager()
                self.trainer.fit(self.agent_loop_manager)
                print(refit_line(time.time()), flush=True)
                reset_for_refit(self.trainer, config)
                steps = fit_recorded(self.trainer, self.agent_loop_manager)
                steps_file(config).write_text(json.dumps(steps))
                succeeded = True
            finally:
                try:
                    tracking = getattr(self.trainer, "logger", None)
                    if tracking is not None:
                        tracking.finish(exit_code=0 if succeeded else 1)
                finally:
                    tq.close()

    return ray.remote(RefitTaskRunner)


def prepare_verl_config(config, what: str) -> None:
    """What verl 0.9.1's ``main_ppo.main`` does to the composed config before ``run_ppo`` (the device,
    ``validate_config``), and the v1 trainer the reset needs (``what``: who needs it, for the message)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    if not config.trainer.use_v1:
        raise ValueError(f"{what} needs verl's v1 trainer (trainer.use_v1=True)")


def main() -> None:
    """``python -m fedagent.train.verl.refit <verl overrides>``: verl 0.9.1's ``main_ppo.main`` with
    :func:`runner_class`. Hydra's own flags work as there (``--cfg job`` prints the composed config)."""
    import hydra

    @hydra.main(config_path="pkg://verl.trainer.config", config_name="ppo_trainer", version_base=None)
    def _main(config):
        from verl.trainer import main_ppo

        prepare_verl_config(config, "train.verl.warm_refit")
        if not os.environ.get(REFIT_ENV) and REFIT_ENV not in str(config.ray_kwargs):
            raise ValueError(f"{REFIT_ENV} is not in the job's Ray runtime env: the workers would lack the reset")
        main_ppo.run_ppo(config, task_runner_class=runner_class())

    _main()


if __name__ == "__main__":
    main()
