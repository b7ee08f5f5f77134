"""One verl job per client per round: its Hydra overrides, its private dirs, its process tree.

Nothing here imports verl (the CPU venv may compose verl's config in tests, the job itself
runs ``python -m verl.trainer.main_ppo`` in a child process). Isolation by construction
(FACTS §8): every job gets

- a job tag (``fa-<round>-<client>-<pid>-<random>``) that salts verl's weight-transfer IPC
  socket names (``/tmp/rl-colocate-zmq-<ray job id>-…``; a fresh Ray cluster's first job id
  is always ``01000000``, so two isolated clusters would share the name) through
  :mod:`fedagent.train.verl.ray_hook`, installed as Ray's ``worker_process_setup_hook``;
- its own Ray cluster with a private temp dir (``ray.init(_temp_dir=…)``: session dirs,
  Unix sockets and the address file that ``ray.init()`` would otherwise find and join),
  no dashboard, every port OS-assigned (Ray 2.60 asks for port 0 when ``ray.init`` starts a
  local cluster); ``RAY_ADDRESS`` is removed so a job never attaches to someone else's;
- ``CUDA_VISIBLE_DEVICES`` passed through unchanged: Ray maps its GPU ids onto the visible
  devices, so every pin is relative to the job's allocation;
- a work dir beside the job's output (checkpoints, parquet rows, agent-loop YAML, logs),
  removed in ``finally`` with the Ray temp dir (which also holds the job's ``TMPDIR``: vLLM
  and ZMQ put Unix sockets there, so it must be short) and the job's own IPC sockets.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from fedagent.model.memory import kv_cache_bytes
from fedagent.train.verl import leftovers

AGENT_NAME = "fedagent_windowed"
AGENT_LOOP_TARGET = "fedagent.train.verl.agent_loop.WindowedAgentLoop"
RAY_HOOK = "fedagent.train.verl.ray_hook.setup"
TAG_ENV = "FEDAGENT_VERL_JOB_TAG"
# Ray puts ``<temp_dir>/session_<date>_<time>_<pid>/sockets/plasma_store`` (~70 bytes below
# the temp dir) into AF_UNIX addresses, which hold 107 bytes on Linux.
RAY_TMP_MAX = 36
# Environment a job must not inherit: it would attach the job to another Ray cluster.
FOREIGN_ENV = ("RAY_ADDRESS", "RAY_NAMESPACE", "RAY_JOB_ID", "RAY_RUNTIME_ENV_HOOK")
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class VerlJob:
    """The private places of one verl job (all removed when the job ends)."""

    tag: str
    workdir: Path  # beside the job's output: rows, YAML, checkpoints, logs, TMPDIR
    ray_tmp: Path  # short path (AF_UNIX limit) unique to this job

    @property
    def ckpt_dir(self) -> Path:
        # named by the attempt's tag: nothing of an earlier attempt's (still dying) process lands in it
        return self.workdir / f"ckpt-{self.tag}"

    @property
    def log(self) -> Path:
        return self.workdir / "verl.log"


def job_tag(round: int, client: int) -> str:
    """A tag no other job on any machine shares (pid + 8 random bytes; naming only)."""
    return f"fa-r{int(round):03d}-c{int(client)}-{os.getpid()}-{secrets.token_hex(8)}"


@contextlib.contextmanager
def isolated_job(workdir: Path, *, round: int, client: int, tmp_root: Path | None = None) -> Iterator[VerlJob]:
    """Create the job's private dirs; remove them, and the job's IPC sockets, afterwards.

    A killed attempt's leftover ``workdir`` is removed first, with the Ray temp dir and IPC sockets
    its ``leftovers.json`` record names (:mod:`fedagent.train.verl.leftovers`). The Ray temp dir lives in the work dir when that path is
    short enough, else in a fresh ``mkdtemp`` under ``tmp_root`` (default: the system temp dir),
    which is unique by construction.
    """
    workdir = Path(workdir).resolve()
    if workdir.exists():
        leftovers.remove(workdir, tmp_root, grace_s=STOP_GRACE_S)
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    tag = job_tag(round, client)
    inside = workdir / "ray"
    own_tmp = None
    if len(str(inside)) <= RAY_TMP_MAX:
        inside.mkdir()
        ray_tmp = inside
    else:
        own_tmp = Path(tempfile.mkdtemp(prefix="fa-ray-", dir=str(tmp_root) if tmp_root else None))
        ray_tmp = own_tmp
    leftovers.record(workdir, tag=tag, ray_tmp=str(own_tmp.resolve()) if own_tmp else None)
    if len(str(ray_tmp)) > RAY_TMP_MAX:
        raise RuntimeError(
            f"Ray temp dir {ray_tmp} is longer than {RAY_TMP_MAX} characters "
            "(Ray's Unix sockets would not fit); set TMPDIR to a shorter path"
        )
    (ray_tmp / "t").mkdir()
    try:
        yield VerlJob(tag=tag, workdir=workdir, ray_tmp=ray_tmp)
    finally:
        leftovers.remove_ipc_sockets(tag)
        if own_tmp is not None:
            shutil.rmtree(own_tmp, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


def job_environ(job: VerlJob, base: dict | None = None) -> dict:
    """The trainer child's environment: the caller's, minus foreign Ray settings, plus ours."""
    env = dict(os.environ if base is None else base)
    for key in FOREIGN_ENV:
        env.pop(key, None)
    env[TAG_ENV] = job.tag
    # Short and private: vLLM and ZMQ put Unix sockets (107-byte paths) under the temp dir.
    env["TMPDIR"] = str(job.ray_tmp / "t")
    env["RAY_TMPDIR"] = str(job.ray_tmp)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # no flashinfer in the GPU wheel set
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("HYDRA_FULL_ERROR", "1")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


@dataclass(frozen=True)
class VerlSettings:
    """Knobs of the verl backend that are not GRPO hyper-parameters (``train.verl``)."""

    gpus: int = 1
    gpu_memory_utilization: float = 0.5
    attn_implementation: str = "sdpa"  # no flash-attn in the GPU wheel set
    enforce_eager: bool = False
    # A fixed KV cache (GiB) instead of one sized by profiling: vLLM's profiling assumes no other
    # process changes its GPU memory meanwhile, so jobs starting together on one GPU can each
    # count the other's allocations as their own and find no memory left for the cache.
    kv_cache_gb: float | None = None
    # The batch sizes vLLM captures CUDA graphs for (None: vLLM's own list): a start-up lever.
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    # vLLM's executor inside each rollout server: "uni" (the worker runs inside the engine process:
    # one process start fewer, 10-20 s of a job's start, docs/results/verl.md) or "mp" (verl's own
    # choice: the engine process starts a worker process).
    vllm_executor: str = "uni"
    # Ray actors verl starts per job that a fedagent job never uses or barely uses (start-up levers;
    # verl's defaults are 8 each): reward-loop workers (our agent loop scores every turn, so
    # verl never calls them) and the v1 trainer's TransferQueue storage units (one in-memory sample
    # store, sharded). Each is a Ray worker process importing verl while the job starts.
    reward_workers: int = 1
    storage_units: int = 1
    # The probe of run-scoped engines (fedagent.train.verl.refit): the job fits, resets its live
    # engines to a fresh job's start and fits again; the second fit is the job's update.
    warm_refit: bool = False
    # Run-scoped engines (fedagent.train.verl.engines): "job" (each job starts its own verl process tree)
    # or "run" (a slot's engine set, started by its first job, serves the later ones after a reset).
    engines: str = "job"
    engine_sets: int = 2  # slots per run: concurrent verl jobs on warm engines
    engines_idle_s: float = 900.0  # a set with no job for this long stops
    # a set whose training workers hold this many GB more device memory after a job than after its first
    # stops after that job (the next starts a fresh set): each warm job has been seen to leave ≈ 0.5 GB per
    # trained 135M engine allocated (docs/results/verl.md)
    engines_max_growth_gb: float = 4.0
    extra_overrides: tuple[str, ...] = ()  # appended last, e.g. from the lead's GPU script


def mini_batch_prompts(p) -> int:
    """verl's ``ppo_mini_batch_size`` (in prompts, verl multiplies by n) for our row count.

    Ours counts per-turn samples; verl counts prompts of ``n = group_size`` rollouts each.
    The nearest whole number of groups, at least 1 and at most a step's groups.
    """
    return max(1, min(int(p.groups_per_epoch), int(p.mini_batch_size) // int(p.group_size) or 1))


def build_overrides(
    p,
    s: VerlSettings,
    *,
    job: VerlJob,
    model_dir: Path,
    rows: Path,
    agent_loop_yaml: Path,
    rollout_seed: int,
    ref_model_dir: Path | None = None,
) -> list[str]:
    """The Hydra overrides of one client's round, against verl's ``ppo_trainer`` config.

    ``p`` is :class:`fedagent.train.local.TrainParams` (the same knobs as the local backend).
    One dataset row per task draw (``groups_per_epoch`` rows per epoch, ``epochs`` epochs in
    order, no shuffling), ``rollout.n = group_size``, one optimizer pass per step, one save at
    the last step (model shards only: the fp32 masters; no HF export, which verl writes in
    bf16), no resume, no validation. ``ref_model_dir``: a KL reference other than the start model
    (``train.ref_anchor: base`` after round 1); verl 0.9.1 has no key for it, so it reaches Ray's
    workers as ``REF_MODEL_ENV``, where :mod:`fedagent.train.verl.ray_hook` arms
    :mod:`fedagent.train.verl.ref_model` (None: verl's reference is the start model).
    """
    use_kl = float(p.kl_coef) > 0
    ov = [
        f"algorithm.adv_estimator={'gae' if p.algorithm == 'ppo' else 'grpo'}",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={rows}",
        f"data.val_files={rows}",
        f"data.train_batch_size={int(p.groups_per_epoch)}",
        f"data.max_prompt_length={int(p.max_prompt_tokens)}",
        f"data.max_response_length={int(p.max_new_tokens)}",
        "data.filter_overlong_prompts=False",
        "data.truncation=left",
        "data.shuffle=False",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"+actor_rollout_ref.model.override_config.attn_implementation={s.attn_implementation}",
        f"actor_rollout_ref.actor.optim.lr={float(p.lr)}",
        f"actor_rollout_ref.actor.optim.weight_decay={float(p.weight_decay)}",
        f"actor_rollout_ref.actor.grad_clip={float(p.grad_clip)}",
        f"actor_rollout_ref.actor.clip_ratio={float(p.clip)}",
        f"actor_rollout_ref.actor.clip_ratio_c={float(p.clip_ratio_c)}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch_prompts(p)}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={int(p.micro_batch_size)}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.actor.use_kl_loss={use_kl}",
        f"actor_rollout_ref.actor.kl_loss_coef={float(p.kl_coef)}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.actor.entropy_coeff={float(p.entropy_coef)}",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model]",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={int(p.micro_batch_size)}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.n={int(p.group_size)}",
        f"actor_rollout_ref.rollout.temperature={float(p.temperature)}",
        "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={float(s.gpu_memory_utilization)}",
        f"actor_rollout_ref.rollout.enforce_eager={bool(s.enforce_eager)}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={int(p.micro_batch_size)}",
        f"actor_rollout_ref.rollout.seed={int(rollout_seed)}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agent_loop_yaml}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_NAME}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        # v1 (TransferQueue) trainer: it stores each element of an agent loop's output list as
        # its own row (one sample per turn) and pads the batch to the mini-batch multiple.
        "trainer.use_v1=True",
        f"reward.num_workers={int(s.reward_workers)}",
        f"transfer_queue.backend.SimpleStorage.num_data_storage_units={int(s.storage_units)}",
        "trainer.critic_warmup=0",
        "trainer.logger=[console]",
        "trainer.project_name=fedagent",
        f"trainer.experiment_name={job.tag}",
        f"trainer.n_gpus_per_node={int(s.gpus)}",
        "trainer.nnodes=1",
        "trainer.total_epochs=1",
        f"trainer.total_training_steps={int(p.epochs)}",
        f"trainer.save_freq={int(p.epochs)}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
        "trainer.resume_mode=disable",
        "trainer.max_actor_ckpt_to_keep=1",
        f"trainer.default_local_dir={job.ckpt_dir}",
        f"+ray_kwargs.ray_init._temp_dir={job.ray_tmp}",
        "+ray_kwargs.ray_init.include_dashboard=False",
        f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={RAY_HOOK}",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.{TAG_ENV}={job.tag}",
    ]
    if s.kv_cache_gb is not None:
        ov.append(
            f"+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes={kv_cache_bytes(s.kv_cache_gb)}"
        )
    if s.vllm_executor != "mp":
        # verl 0.9.1 sets "mp" and spreads engine_kwargs after it: this one wins
        ov.append(f"+actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend={s.vllm_executor}")
    if s.cudagraph_capture_sizes is not None:
        ov.append(
            "actor_rollout_ref.rollout.cudagraph_capture_sizes=["
            + ",".join(str(int(n)) for n in s.cudagraph_capture_sizes)
            + "]"
        )
    if ref_model_dir is not None:
        from fedagent.train.verl.ref_model import REF_MODEL_ENV

        ov.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.{REF_MODEL_ENV}={ref_model_dir}")
    if s.warm_refit:
        from fedagent.train.verl.refit import REFIT_ENV

        ov.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.{REFIT_ENV}='1'")
    if p.algorithm == "ppo":
        ov += ppo_overrides(p, s, model_dir)
    return ov + list(s.extra_overrides)


def ppo_overrides(p, s: VerlSettings, model_dir: Path) -> list[str]:
    """``train.algorithm: ppo`` (``adv_estimator=gae`` in the base list): GAE with the round's critic
    (``<start model>/critic``), as the local backend.

    verl's GAE runs per row, and a row is one turn whose reward sits on its last response token
    (the agent loop's ``rm_scores``): the local backend's ``ppo.gae`` over per-turn samples. The
    critic trains beside the actor on the same mini-batches (``critic.ppo_mini_batch_size`` and
    ``ppo_epochs`` follow the actor's), from the start critic's fp32 masters, one save at the end
    (model shards only, converted like the actor's into the update's ``critic/``). Its loss is the
    reference's ``legacy_exact`` (``critic_loss``, armed in the trainer's Ray worker by
    :mod:`fedagent.train.verl.ray_hook` when ``CRITIC_LOSS_ENV`` is set: the backend sets it and
    refuses a log without the armed line).
    """
    from fedagent.model.critic_dir import critic_of
    from fedagent.train.verl.critic_loss import CRITIC_LOSS_ENV, LEGACY_EXACT

    return [
        f"algorithm.gamma={float(p.gamma)}",
        f"algorithm.lam={float(p.lam)}",
        "critic.enable=True",
        f"critic.model.path={critic_of(model_dir)}",
        f"critic.model.tokenizer_path={model_dir}",
        "critic.model.use_remove_padding=False",
        "critic.model.enable_gradient_checkpointing=False",
        f"+critic.model.override_config.attn_implementation={s.attn_implementation}",
        f"critic.optim.lr={float(p.critic_lr)}",
        f"critic.optim.weight_decay={float(p.weight_decay)}",
        f"critic.grad_clip={float(p.grad_clip)}",
        f"critic.cliprange_value={float(p.value_clip)}",
        f"critic.ppo_micro_batch_size_per_gpu={int(p.micro_batch_size)}",
        "critic.checkpoint.save_contents=[model]",
        "critic.fsdp.model_dtype=fp32",
        "trainer.max_critic_ckpt_to_keep=1",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.{CRITIC_LOSS_ENV}={LEGACY_EXACT}",
    ]


def write_agent_loop_yaml(
    path: Path,
    *,
    env_uds: str | None,
    env_url: str | None,
    env_token: str | None,
    p,
    record_file: Path,
    history_length: int,
    job_file: Path | None = None,
    model_dir: Path | None = None,
) -> Path:
    """The agent-loop YAML verl loads (``rollout.agent.agent_loop_config_path``).

    Each entry is ``hydra.utils.instantiate``-d per episode; its extra keys become the
    loop's constructor arguments (the job's own env service, the episode budget). With ``job_file``
    the env address and record file go into that JSON instead, with the job's start model dir
    ``model_dir`` (its generation config gives the loop's stop tokens), which the loop reads per episode
    (``agent_loop.read_job_file``: verl reads this YAML once per worker; ``train.verl.warm_refit``,
    ``train.verl.engines: run``).
    """
    import yaml

    entry = {
        "name": AGENT_NAME,
        "_target_": AGENT_LOOP_TARGET,
        "env_uds": env_uds,
        "env_url": env_url,
        "env_token": env_token,
        "max_turns": int(p.max_turns),
        "max_prompt_tokens": int(p.max_prompt_tokens),
        "invalid_penalty": float(p.invalid_penalty),
        "history_length": int(history_length),
        "answer_format": str(p.answer_format),
        "record_file": str(record_file),
    }
    if job_file is not None:
        from fedagent.core.atomic import atomic_write_text

        if model_dir is None:
            raise ValueError("an agent-loop job file needs the job's start model dir")
        per_job = {
            **{k: entry.pop(k) for k in ("env_uds", "env_url", "env_token", "record_file")},
            "model_dir": str(model_dir),
        }
        atomic_write_text(Path(job_file), json.dumps(per_job, sort_keys=True) + "\n")
        entry["job_file"] = str(job_file)
    Path(path).write_text(yaml.safe_dump([entry], sort_keys=True))
    return Path(path)


def task_rows(p, round: int, client: int) -> list[dict]:
    """One verl dataset row per task draw: the same seeds as the local backend, in order.

    The prompt is a placeholder the agent loop never reads (the env service gives the
    observation); verl's dataset needs a chat message to build its batch.
    """
    from fedagent.train.local import epoch_task_seeds

    rows = []
    for epoch in range(int(p.epochs)):
        for g, seed in enumerate(epoch_task_seeds(p, round, client, epoch)):
            rows.append(
                {
                    "data_source": "fedagent",
                    "prompt": [{"role": "user", "content": f"task seed {seed}"}],
                    "ability": "agent",
                    "agent_name": AGENT_NAME,
                    "reward_model": {"style": "rule", "ground_truth": ""},
                    # round/client/epoch/group + base_seed: the agent loop's per-request sampling seeds
                    "extra_info": {
                        "seed": int(seed),
                        "epoch": epoch,
                        "group": g,
                        "round": int(round),
                        "client": int(client),
                        "base_seed": int(p.base_seed),
                        "index": len(rows),
                    },
                }
            )
    return rows


def write_rows(path: Path, rows: Sequence[dict]) -> Path:
    """The rows as parquet (verl's dataset format)."""
    import pandas as pd

    pd.DataFrame(list(rows)).to_parquet(path)
    return Path(path)


def trainer_command(overrides: Sequence[str], python: str | None = None, *, warm_refit: bool = False) -> list[str]:
    """``python -m verl.trainer.main_ppo <overrides>`` (``warm_refit``: ``fedagent.train.verl.refit``, verl's
    main with the refitting TaskRunner); ``FEDAGENT_VERL_TRAINER`` replaces the module (tests)."""
    default = "fedagent.train.verl.refit" if warm_refit else "verl.trainer.main_ppo"
    module = os.environ.get("FEDAGENT_VERL_TRAINER", default)
    return [python or sys.executable, "-m", module, *overrides]


# Log lines whose first appearance times a job's start-up (seconds after launch, in metrics.json).
PHASE_MARKERS = {
    "ray_started": "Started a local Ray instance",  # ray.init of the job's own cluster
    "runner_ready": "train and validate dataloader initialized",  # verl's TaskRunner: config, data
    "engines_initialized": "actor and ref model engine initialized",  # FSDP actor + reference
    "rollout_server_up": "LLMServerManager: [",  # vLLM server(s) started (compile, CUDA graphs)
    "ready_to_fit": "all initialize finished, ready to fit",
    "first_step_logged": "step:1 - ",  # verl's console logger after step 1
}


def run_trainer(
    cmd: Sequence[str],
    env: dict,
    log: Path,
    timeout: float | None = None,
    marks: dict | None = None,
    workdir: Path | None = None,
) -> float:
    """Run the trainer in its own process group; kill the whole group on any exit path.

    Output goes to ``log`` line by line; ``marks`` (if given) gets the seconds after launch at
    which each :data:`PHASE_MARKERS` line first appeared. Returns the wall time. A non-zero
    exit is a RuntimeError quoting the log's tail. ``workdir``: the job's, whose ``leftovers.json``
    record gets the group (pid and start time), so that the next attempt stops it if a SIGKILL of
    this one left it running (its own session outlives the job's process).
    """
    import threading

    from fedagent.core import procs

    t0 = time.monotonic()
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    if workdir is not None:
        leftovers.record(workdir, pgid=proc.pid, start=procs.proc_start(proc.pid))
    seen = {} if marks is None else marks

    def pump():
        with open(log, "ab") as fh:
            for line in proc.stdout:
                fh.write(line)
                fh.flush()
                text = line.decode(errors="replace")
                for name, marker in PHASE_MARKERS.items():
                    if name not in seen and marker in text:
                        seen[name] = round(time.monotonic() - t0, 3)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout)
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        _kill_group(proc)  # Ray/vLLM children left behind by a finished driver
        reader.join(30)
    if rc != 0:
        tail = "\n".join(Path(log).read_text(errors="replace").splitlines()[-60:])
        raise RuntimeError(f"verl trainer exited with code {rc}; log {log}:\n{tail}")
    return time.monotonic() - t0


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.2)
        else:
            time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(5)


# A port taken between a free-port probe and its bind (FACTS §8: ≈1 in 40 rounds); vLLM's own
# startup probe prints a benign "address already in use" line, so only a failed run counts.
PORT_COLLISION = ("address already in use", "eaddrinuse", "distnetworkerror")


def port_collision(log: Path) -> bool:
    """Whether a failed trainer's log shows a port collision (then it is relaunched once)."""
    try:
        text = Path(log).read_text(errors="replace").lower()
    except FileNotFoundError:
        return False
    return any(k in text for k in PORT_COLLISION)


def final_checkpoint(ckpt_dir: Path) -> Path:
    """The actor dir of the newest ``global_step_<N>`` verl wrote (one save per job)."""
    steps = sorted(Path(ckpt_dir).glob("global_step_*"), key=lambda d: int(d.name.rsplit("_", 1)[1]))
    if not steps:
        raise RuntimeError(f"verl wrote no checkpoint under {ckpt_dir}")
    actor = steps[-1] / "actor"
    if not (actor / "fsdp_config.json").is_file():
        raise RuntimeError(f"{actor}: no fsdp_config.json (incomplete checkpoint)")
    return actor


def describe(job: VerlJob, overrides: Sequence[str]) -> dict:
    """A JSON-able record of the launch (kept in metrics.json)."""
    return {"tag": job.tag, "overrides": list(overrides)}


def dump_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
