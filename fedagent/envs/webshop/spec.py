"""WebShop's :class:`~fedagent.core.envs.EnvSpec` (``env.kind: webshop``): the standard files or a synthetic catalogue.

Light on purpose: the registry imports this module at plan time (nothing of ``bm25s`` here).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from fedagent.core.envs import EnvSpec
from fedagent.core.errors import ConfigError

# A training client's env knobs (its environment arm); validation never gets any.
CLIENT_KEYS = ("arm", "search_return_n", "variant_n", "variant", "env_div", "keep_ratio")
# The goals' construction: what makes the task directory.
CATALOGUE_KEYS = ("n_products", "goals_per_product", "val_goals", "data", "data_manifest", "goals", "max_products")
ARM_POOL_SIZES = {"bm25_field_subset": 8, "bm25_reweight": 8, "lookalike": 4, "rank_wrapper": 4}


def open_source(games: Path, split: str, *, tasks=None, env_params=None, client_id=None):
    """The task directory's goals, the catalogue view built for ``client_id``'s arm over the served ``tasks``."""
    from fedagent.envs.webshop.source import WebShopTaskSource

    source = WebShopTaskSource(
        games, env_params=env_params, served=tasks, client_id=int(client_id) if client_id is not None else None
    )
    return source, split


def catalogue_args(config) -> str:
    """``fedagent webshop-catalog`` flags: only what changes the task directory."""
    ws = config["env"]["webshop"]
    flags = (
        f"webshop-catalog --data-seed {config['data_seed']} --n-products {ws['n_products']}"
        f" --goals-per-product {ws['goals_per_product']} --val-goals {ws['val_goals']} --goals {ws['goals']}"
    )
    if ws["data"] is not None:
        flags += f" --data {ws['data']}"
    if ws["data_manifest"] is not None:
        flags += f" --data-manifest {ws['data_manifest']}"
    if ws["max_products"] is not None:
        flags += f" --max-products {ws['max_products']}"
    return flags


def client_env_params(config) -> dict:
    """One training client's arm: its knobs and the data seed (``--env-params``)."""
    return {**{k: config["env"]["webshop"][k] for k in CLIENT_KEYS}, "seed": config["data_seed"]}


def check(config: dict) -> None:
    """Cross-field checks of ``env.webshop`` when env.kind is webshop (the arm pools' sizes as envs.webshop.arms)."""
    if config["env"]["kind"] != "webshop":
        return
    ws = config["env"]["webshop"]
    if ws["goals"] == "human" and ws["data"] is None:
        raise ConfigError("config key 'env.webshop.goals': human goals need the standard files (env.webshop.data)")
    if ws["arm"] == "lookalike" and (ws["goals"] == "human" or ws["max_products"] is not None):
        raise ConfigError("config key 'env.webshop.arm': lookalike cannot be combined with human goals or max_products")
    if ws["data"] is None and ws["n_products"] * ws["goals_per_product"] <= ws["val_goals"]:
        raise ConfigError(
            f"config key 'env.webshop.val_goals': {ws['val_goals']} leaves no training goal out of at most "
            f"{ws['n_products'] * ws['goals_per_product']} (n_products × goals_per_product)"
        )
    pools = ARM_POOL_SIZES
    if ws["arm"] in pools and ws["variant_n"] > pools[ws["arm"]]:
        raise ConfigError(f"config key 'env.webshop.variant_n': {ws['arm']} has {pools[ws['arm']]} variants")
    if ws["variant"] is not None and ws["variant"] >= ws["variant_n"]:
        raise ConfigError(f"config key 'env.webshop.variant': must be below variant_n={ws['variant_n']}")


SPEC = EnvSpec(
    kind="webshop",
    source="fedagent.envs.webshop.spec:open_source",
    catalogue="fedagent.envs.webshop.build",
    catalogue_args=catalogue_args,
    catalogue_keys=lambda env: {"webshop": {k: env["webshop"][k] for k in CATALOGUE_KEYS}},
    prompt_templates={"webshop": "fedagent.envs.webshop.prompt:TEMPLATE"},
    schema=yaml.safe_load((Path(__file__).parent / "schema.yaml").read_text()),
    check=check,
    val_pool_key="env.webshop.val_goals",
    train_games_sized=False,
    client_env_params=client_env_params,
    training_only_keys=tuple(f"env.webshop.{k}" for k in ("arm", "variant_n", "variant", "env_div", "keep_ratio")),
    commands={
        "webshop-catalog": (
            "fedagent.envs.webshop.build",
            "build the WebShop task directory (standard data or synthetic)",
        )
    },
)
