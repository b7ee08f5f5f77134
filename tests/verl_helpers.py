"""Helpers for the verl-backend tests: verl's own Hydra config, composed without running anything."""

from __future__ import annotations

import os


def verl_config_dir() -> str:
    """verl's packaged trainer config dir (``verl/trainer/config``)."""
    import verl

    return os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def compose_ppo(overrides: list[str]):
    """``ppo_trainer`` composed with ``overrides`` exactly as ``verl.trainer.main_ppo`` does."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def derive_ref_config(cfg) -> None:
    """``cfg.actor_rollout_ref.ref`` completed in place as verl's ``init_model`` derives the reference
    model's config (its log-prob batch keys renamed to the actor's, the actor's mini-batch size)."""
    from omegaconf import open_dict

    with open_dict(cfg.actor_rollout_ref.ref):
        ref_node = cfg.actor_rollout_ref.ref
        ref_node.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref_node.ppo_micro_batch_size = ref_node.pop("log_prob_micro_batch_size", None)
        ref_node.ppo_micro_batch_size_per_gpu = ref_node.pop("log_prob_micro_batch_size_per_gpu", None)
        ref_node.use_dynamic_bsz = ref_node.pop("log_prob_use_dynamic_bsz", False)
        ref_node.ppo_max_token_len_per_gpu = ref_node.pop("log_prob_max_token_len_per_gpu", None)


def build_engine(cls, model_config, cfg, path, model_type: str):
    """verl's ``TrainingWorker.__init__`` + first ``reset()``: its model type and padding flags, then the
    engine class (``cls``: the one verl's registry gives that type on a GPU), initialized."""
    model_config.local_path = str(path)
    model_config.model_type = model_type
    cfg.engine.use_remove_padding = model_config.get("use_remove_padding", False)
    cfg.engine.use_fused_kernels = model_config.get("use_fused_kernels", False)
    engine = cls(model_config, cfg.engine, cfg.optim, cfg.checkpoint)
    engine.initialize()
    return engine
