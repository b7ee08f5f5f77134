"""A scripted reference policy for ALFWorld hardness labels: the PDDL planner's solution with noise.

Each turn the agent takes the planner's next command from the **current** state with
probability ``p`` (TextWorld's ``policy_commands``: fast-downward replans after every step,
so a detour is recovered from), otherwise a uniformly random admissible command; the
episode stops when won or after ``max_turns`` steps. A game whose solution is longer needs
more turns and gives the noise more chances to lead it astray, so it is won less often under
the same budget: success is a real, reproducible difficulty signal ("hard for a noisy
planner"), not a trained agent's competence. ``p = 1`` plays the plan itself; ``p = 0`` is the
random walker.

Randomness: one ``python_rng(base_seed, "labels_expert", index=i)`` per task ``i`` of the
given order (the labels job passes ``data_seed``), so the labels are a function of the
catalogue, ``p``, the budget and the seed only.
"""

from __future__ import annotations

from typing import Sequence


def noisy_expert_episode(env, task_id: str, rng, p: float, max_turns: int) -> dict:
    """Play ``task_id`` once in ``env`` (an :class:`AlfworldEnv` with ``policy_commands``)."""
    reset = env.reset(task_id)
    plan_len = len(env.expert_plan())
    admissible = list(reset.admissible_commands)
    won, turns, expert_moves = False, 0, 0
    for _ in range(max_turns):
        plan = env.expert_plan()
        # One draw per turn whatever the branch, so a turn's choice never shifts later draws.
        u = rng.random()
        if plan and u < p:
            cmd, expert_moves = plan[0], expert_moves + 1
        elif admissible:
            cmd = admissible[rng.randrange(len(admissible))]
        else:
            break
        result = env.step(cmd)
        turns += 1
        won, admissible = bool(result.won), list(result.admissible_commands)
        if result.done:
            break
    return {"task_id": task_id, "won": won, "turns": turns, "plan_len": plan_len, "expert_moves": expert_moves}


def noisy_expert_labels(source, task_ids: Sequence[str], base_seed: int, p: float, max_turns: int) -> list[dict]:
    """One noisy-expert episode per task of ``task_ids`` (task ``i`` seeded with index ``i``)."""
    from fedagent.core.seeds import python_rng

    if not 0.0 <= p <= 1.0:
        raise ValueError(f"expert p must be in [0, 1], got {p}")
    env = source.make_env(max_turns=max_turns, policy_commands=True)
    try:
        return [
            noisy_expert_episode(env, tid, python_rng(base_seed, "labels_expert", index=i), p, max_turns)
            for i, tid in enumerate(task_ids)
        ]
    finally:
        env.close()


def catalogue_labels(games_dir, task_ids: Sequence[str], base_seed: int, p: float, max_turns: int) -> list[dict]:
    """:func:`noisy_expert_labels` over the train split of a run's catalogue (``fedagent labels --policy expert``)."""
    from fedagent.envs.alfworld.catalogue import source_from_catalogue

    source, _ = source_from_catalogue(games_dir, "train")
    return noisy_expert_labels(source, task_ids, base_seed, p, max_turns)
