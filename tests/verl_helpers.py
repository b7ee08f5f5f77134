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
