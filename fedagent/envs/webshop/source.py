"""A WebShop task directory as a :class:`fedagent.envs.base.TaskSource`.

``WebShopTaskSource(games_dir, env_params, client_id, served)`` loads the verified task
directory (:func:`.build.load_catalog`) once and builds one shared :class:`.arms.EnvView`
for the service: the unperturbed catalogue, or the client's arm (``env_params`` = the
:class:`.arms.ArmSpec` JSON). ``served`` are the goal ids this service draws from; with
catalog_split their targets are always kept, and at start-up every served goal's target
must be reachable in the view (the reference's tripwire). Task ids are goal ids; the task
type is the goal's top-level category (beauty, electronics, fashion, food, furniture).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from fedagent.envs.webshop.arms import ArmError, ArmSpec, build_view
from fedagent.envs.webshop.build import load_catalog


class WebShopTaskSource:
    """Goals of a WebShop task directory, one shared catalogue view per service."""

    def __init__(
        self,
        games_dir: str | Path,
        *,
        env_params: dict | None = None,
        client_id: int | None = None,
        served: Sequence[str] | None = None,
        check_hashes: bool = True,
    ):
        """Load the directory and build the view (``served`` default: every goal)."""
        self.games_dir = Path(games_dir)
        self.index, products, goals = load_catalog(self.games_dir, check_hashes=check_hashes)
        self.spec = ArmSpec.from_dict(env_params)
        self.goals = {g["goal_id"]: g for g in goals}
        if self.spec.arm == "lookalike":
            src = self.index.get("source", {})
            if src.get("goals") == "human" or src.get("max_products") is not None:
                raise ArmError("lookalike injection cannot be combined with human goals or a product cap")
        served_ids = list(served) if served is not None else list(self.goals)
        unknown = [t for t in served_ids if t not in self.goals]
        if unknown:
            raise KeyError(f"unknown goal ids {unknown[:5]}")
        served_goals = [self.goals[t] for t in served_ids]
        self.view = build_view(products, self.spec, client=client_id, served_goals=served_goals)
        unreachable = sorted({g["asin"] for g in served_goals} - set(self.view.products))
        if unreachable:
            raise ArmError(f"{len(unreachable)} served goal targets are not in the catalogue: {unreachable[:5]}")
        self.info = dict(self.view.info)

    prompt_template = "webshop"  # the reference's WebShop prompt (fedagent.rollout.prompts)

    def task_ids(self, split: str) -> list[str]:
        """Goal ids of ``split`` (``train`` or ``val``) in the fixed order."""
        if split not in ("train", "val"):
            raise ValueError(f"unknown split {split!r} (train or val)")
        return list(self.index[split])

    def task_type(self, task_id: str) -> str:
        """The goal's top-level category; KeyError for an unknown id."""
        return self.goals[task_id]["category"]

    def make_env(self, max_turns: int = 15, *, policy_commands: bool = False):
        """A fresh env over the shared view and goal table (its oracle needs no flag: ``policy_commands``
        is accepted for the service's expert mode)."""
        from fedagent.envs.webshop.env import WebShopEnv

        return WebShopEnv(self.view, self.goals, max_turns=max_turns)
