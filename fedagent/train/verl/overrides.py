"""One verl job's Hydra overrides against verl 0.9.1's ``ppo_trainer`` config: the training params and
the verl settings as verl's keys, the job's private places (:class:`fedagent.train.verl.launch.VerlJob`)
and the hooks that arm our code in verl's Ray workers. Nothing here imports verl: the CPU venv composes
them with verl's config in tests; the job passes them to ``python -m verl.trainer.main_ppo``.
"""

from __future__ import annotations

from pathlib import Path

from fedagent.train.verl.job_files import AGENT_NAME
from fedagent.train.verl.launch import TAG_ENV, VerlJob
from fedagent.train.verl.settings import VerlSettings
from fedagent.train.verl.sizing import SizedMemory

RAY_HOOK = "fedagent.train.verl.ray_hook.setup"


def mini_batch_prompts(p) -> int:
    """verl's ``ppo_mini_batch_size`` (in prompts, verl multiplies by n) for our row count.

    Ours counts per-turn samples; verl counts prompts of ``n = group_size`` rollouts each.
    The nearest whole number of groups, at least 1 and at most a step's groups.
    """
    return max(1, min(int(p.groups_per_epoch), int(p.mini_batch_size) // int(p.group_size) or 1))


# train.algorithm → verl's algorithm.adv_estimator: the estimators this backend runs.
VERL_ESTIMATORS = {"grpo": "grpo", "ppo": "gae"}


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
    memory: "SizedMemory | None" = None,
) -> list[str]:
    """The Hydra overrides of one client's round, against verl's ``ppo_trainer`` config.

    ``p`` is :class:`fedagent.train.local.TrainParams` (the same knobs as the local backend).
    One dataset row per task draw (``groups_per_epoch`` rows per epoch, ``epochs`` epochs in
    order, no shuffling), ``rollout.n = group_size``, one optimizer pass per step, one save at
    the last step (model shards only: the fp32 masters; no HF export, which verl writes in
    bf16), no resume, no validation. ``ref_model_dir``: a KL reference other than the start model
    (``train.ref_anchor: base`` after round 1); verl 0.9.1 has no key for it, so it reaches Ray's
    workers as ``REF_MODEL_ENV``, where :mod:`fedagent.train.verl.ray_hook` arms
    :mod:`fedagent.train.verl.ref_model` (None: verl's reference is the start model). ``memory``: the
    job's memory settings sized from its declared memory (:mod:`fedagent.train.verl.sizing`): offload,
    gradient checkpointing, micro-batches, vLLM's KV cache and share (None: ``s``'s own, verl's defaults
    for the rest).
    """
    use_kl = float(p.kl_coef) > 0
    m = memory or SizedMemory.unsized(p, s)
    if p.algorithm not in VERL_ESTIMATORS:
        # the cross rule refuses it before any job; here too, so no other estimator silently runs instead
        raise ValueError(
            f"config key 'train.algorithm': {p.algorithm!r} is not built on train.backend=verl "
            f"(verl runs {', '.join(sorted(VERL_ESTIMATORS))}); use train.backend=local"
        )
    ov = [
        f"algorithm.adv_estimator={VERL_ESTIMATORS[p.algorithm]}",
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
        f"actor_rollout_ref.model.enable_gradient_checkpointing={m.gradient_checkpointing}",
        f"+actor_rollout_ref.model.override_config.attn_implementation={s.attn_implementation}",
        f"actor_rollout_ref.actor.optim.lr={float(p.lr)}",
        f"actor_rollout_ref.actor.optim.weight_decay={float(p.weight_decay)}",
        f"actor_rollout_ref.actor.grad_clip={float(p.grad_clip)}",
        f"actor_rollout_ref.actor.clip_ratio={float(p.clip)}",
        f"actor_rollout_ref.actor.clip_ratio_c={float(p.clip_ratio_c)}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch_prompts(p)}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={m.micro_batch_size}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.actor.use_kl_loss={use_kl}",
        f"actor_rollout_ref.actor.kl_loss_coef={float(p.kl_coef)}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.actor.entropy_coeff={float(p.entropy_coef)}",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model]",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={m.micro_batch_size}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.n={int(p.group_size)}",
        f"actor_rollout_ref.rollout.temperature={float(p.temperature)}",
        "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.enforce_eager={bool(s.enforce_eager)}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={m.micro_batch_size}",
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
    ov += m.overrides()
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
        ov += ppo_overrides(p, s, model_dir, m)
    return ov + list(s.extra_overrides)


def ppo_overrides(p, s: VerlSettings, model_dir: Path, m: "SizedMemory | None" = None) -> list[str]:
    """``train.algorithm: ppo`` (``adv_estimator=gae`` in the base list): GAE with the round's critic
    (``<start model>/critic``), as the local backend.

    verl's GAE runs per row, and a row is one turn whose reward sits on its last response token
    (the agent loop's ``rm_scores``): the local backend's ``ppo.gae`` over per-turn samples. The
    critic trains beside the actor on the same mini-batches (``critic.ppo_mini_batch_size`` and
    ``ppo_epochs`` follow the actor's), from the start critic's fp32 masters, one save at the end
    (model shards only, converted like the actor's into the update's ``critic/``). Its loss is the
    reference's ``legacy_exact`` (``critic_loss``, armed in the trainer's Ray worker by
    :mod:`fedagent.train.verl.ray_hook` when ``CRITIC_LOSS_ENV`` is set: the backend sets it and
    refuses a log without the armed line). The critic's offload, gradient checkpointing and micro-batch are
    the actor's (``m``).
    """
    from fedagent.model.critic_dir import critic_of

    m = m or SizedMemory.unsized(p, s)
    from fedagent.train.verl.critic_loss import CRITIC_LOSS_ENV, LEGACY_EXACT

    return [
        f"algorithm.gamma={float(p.gamma)}",
        f"algorithm.lam={float(p.lam)}",
        "critic.enable=True",
        f"critic.model.path={critic_of(model_dir)}",
        f"critic.model.tokenizer_path={model_dir}",
        "critic.model.use_remove_padding=False",
        f"critic.model.enable_gradient_checkpointing={m.gradient_checkpointing}",
        f"+critic.model.override_config.attn_implementation={s.attn_implementation}",
        f"critic.optim.lr={float(p.critic_lr)}",
        f"critic.optim.weight_decay={float(p.weight_decay)}",
        f"critic.grad_clip={float(p.grad_clip)}",
        f"critic.cliprange_value={float(p.value_clip)}",
        f"critic.ppo_micro_batch_size_per_gpu={m.micro_batch_size}",
        "critic.checkpoint.save_contents=[model]",
        "critic.fsdp.model_dtype=fp32",
        *m.critic_overrides(),
        "trainer.max_critic_ckpt_to_keep=1",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.{CRITIC_LOSS_ENV}={LEGACY_EXACT}",
    ]
