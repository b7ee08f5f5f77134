"""Offline ALFWorld games built from the floor plans that the ``alfworld`` package ships.

The PyPI package has the ALFRED PDDL domain, the text grammar and, per floor plan, the
object classes present (``FloorPlan<N>-objects.json``) and every receptacle instance with
the agent pose to reach it (``FloorPlan<N>-openable.json``), but no games. A generated game
is a PDDL problem over one floor plan for one of the six task types: the target object(s)
and a few distractors are placed in receptacles that can hold them (ALFRED's
``VAL_RECEPTACLE_OBJECTS``), and the goal is ALFRED's own goal formula for that task type
(``alfworld.gen.goal_library``). Each game is checked by following the planner's policy
commands until it is won; the plan is stored as the game's walkthrough.

Layout written (same as real data, so :mod:`.data` / :mod:`.source` load it)::

    <out>/<split>/<task_type>-<Obj>-None-<Recep|Lamp>-<plan no>/trial_G_<split>_<i>/game.tw-pddl
    <out>/<split>/.../traj_data.json      task type, targets, floor plan, goal text
    <out>/manifests/<split>.json          sorted game list + sha256

Determinism: game ``i`` of ``split`` uses only a local RNG seeded by
``derive_seed(base_seed, "alfworld_gen_<split>", index=i, epoch=attempt)``; task types cycle
through the six types in a fixed order, so every split has all of them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from fedagent.envs.alfworld import assets, data
from fedagent.core.seeds import python_rng

# Fixed cycle of task types (FACTS §4 numbering 1..6).
TASK_TYPE_CYCLE = tuple(data.TASK_TYPES)
LAMPS = ("DeskLamp", "FloorLamp")
OPENABLE = frozenset({"Fridge", "Cabinet", "Microwave", "Drawer", "Safe", "Box"})
# Types the domain names as constants in action preconditions: always declared.
DOMAIN_CONSTANTS = {"otype": ("Knife", "ButterKnife"), "rtype": ("SinkBasin", "Microwave", "Fridge")}
# Where each state-changing task type must go first (receptacle type the action needs).
TOOL_RECEPTACLE = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
TOOL_PROPERTY = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
DEFAULT_DISTRACTORS = (3, 6)  # inclusive range of extra objects per game
MAX_ATTEMPTS = 50
# How far the planner's address space may grow while it solves one attempt (:func:`solve`). Measured
# on 104 solved attempts (data_seed 42, train[0..60]): 41-77 MiB each but one (307 MiB, 100 s of
# search); the search that never ends (train[83]) passes 128 MiB within half a minute.
PLANNER_MEM_MB = 128


@dataclass
class GameSpec:
    """Everything that defines one generated game (pure data; JSON-serializable)."""

    task_type: str  # ALFRED long name, e.g. pick_heat_then_place_in_recep
    floor_plan: str
    obj: str  # target object class
    recep: str  # target receptacle class, or the lamp class for look
    toggle: str | None
    goal_text: str
    receptacles: dict  # receptacle id -> location name
    objects: list = field(default_factory=list)  # [object id, class, receptacle id]
    lamp: list | None = None  # [lamp id, class, receptacle id]


def _fix(name: str) -> str:
    """ALFRED's mangling of ids into PDDL names (``|`` -> ``_bar_`` ...)."""
    for a, b in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        name = name.replace(a, b)
    return name


def receptacle_class(rid: str) -> str:
    """Class of a receptacle id (``Sink|...|SinkBasin`` -> ``SinkBasin``)."""
    parts = rid.split("|")
    return parts[-1] if len(parts) == 5 else parts[0]


def _scene(plan: str):
    """(object classes, {receptacle id: class}, {receptacle id: location}) of a floor plan."""
    consts = assets.constants()
    objects, poses = assets.floor_plan(plan)
    receps, locs, used = {}, {}, set()
    for rid, (x, z, rot, hor) in poses.items():
        cls = receptacle_class(rid)
        if cls not in consts.VAL_RECEPTACLE_OBJECTS:
            continue
        loc = f"loc|{round(x / 0.25)}|{round(z / 0.25)}|{int(rot) // 90}|{int(hor)}"
        # A location per receptacle: "go to" commands then name exactly one receptacle.
        k, base = 1, loc
        while loc in used:
            k, loc = k + 1, f"{base}|{k}"
        used.add(loc)
        receps[rid], locs[rid] = cls, loc
    return objects, receps, locs


def _holders(consts, receps: dict, obj: str, exclude: Sequence[str] = ()) -> list[str]:
    return [rid for rid, cls in receps.items() if obj in consts.VAL_RECEPTACLE_OBJECTS[cls] and cls not in exclude]


def plan_game(task_type: str, plan: str, rng, n_distractors: int) -> GameSpec | None:
    """Choose targets and placements for ``task_type`` in floor plan ``plan`` (None if impossible)."""
    consts, glib = assets.constants(), assets.goal_library()
    present, receps, locs = _scene(plan)
    rclasses = sorted(set(receps.values()))
    # Objects an agent can carry: present, not a lamp or a fixed receptacle, and storable here.
    fixed = set(consts.VAL_RECEPTACLE_OBJECTS) - set(consts.MOVABLE_RECEPTACLES)
    pickable = sorted(o for o in present if o not in LAMPS and o not in fixed and _holders(consts, receps, o))
    toggle = None
    if task_type == "look_at_obj_in_light":
        lamps = [lp for lp in LAMPS if lp in present]
        stands = sorted(r for r, c in receps.items() if c not in OPENABLE)
        if not lamps or not stands or not pickable:
            return None
        toggle, obj = rng.choice(lamps), rng.choice(pickable)
        recep = toggle
        targets = [obj]
    else:
        tool = TOOL_RECEPTACLE.get(task_type)
        if tool and tool not in rclasses:
            return None
        cands = pickable
        if task_type in TOOL_PROPERTY:
            cands = [o for o in cands if o in consts.VAL_ACTION_OBJECTS[TOOL_PROPERTY[task_type]]]
        pairs = []
        for o in cands:
            for rc in rclasses:
                # Target receptacle must hold o, differ from the tool, and o must start elsewhere.
                if rc == tool or o not in consts.VAL_RECEPTACLE_OBJECTS[rc]:
                    continue
                if _holders(consts, receps, o, exclude=(rc, "Fridge") if tool == "Fridge" else (rc,)):
                    pairs.append((o, rc))
        if not pairs:
            return None
        obj, recep = rng.choice(pairs)
        targets = [obj, obj] if task_type == "pick_two_obj_and_place" else [obj]
    template = rng.choice(glib.gdict[task_type]["templates"])
    goal_text = template.format(obj=obj.lower(), recep=recep.lower(), toggle=(toggle or "").lower(), mrecep="")
    # Targets never start in a receptacle of the goal class (the goal must not hold at reset),
    # and for "cool" never in a fridge (ALFRED counts fridge contents as already cool).
    banned = () if toggle else ((recep, "Fridge") if task_type == "pick_cool_then_place_in_recep" else (recep,))
    distractors = [rng.choice(pickable) for _ in range(n_distractors)]
    spec = GameSpec(task_type, plan, obj, recep, toggle, goal_text, dict(locs))
    counts: dict[str, int] = {}
    for cls in targets + distractors:
        where = _holders(consts, receps, cls, exclude=banned if cls == obj else ())
        if not where:
            continue
        counts[cls] = counts.get(cls, 0) + 1
        spec.objects.append([f"{cls}|{plan[len('FloorPlan') :]}|{counts[cls]:02d}", cls, rng.choice(sorted(where))])
    if toggle:
        stand = rng.choice(sorted(r for r, c in receps.items() if c not in OPENABLE))
        spec.lamp = [f"{toggle}|{plan[len('FloorPlan') :]}|01", toggle, stand]
    return spec


def problem_pddl(spec: GameSpec, name: str) -> str:
    """The PDDL problem text of ``spec`` for ALFWorld's ``alfred`` domain."""
    consts, glib = assets.constants(), assets.goal_library()
    receps = {rid: receptacle_class(rid) for rid in spec.receptacles}
    objs = list(spec.objects) + ([spec.lamp] if spec.lamp else [])
    otypes = sorted({c for _, c, _ in objs} | set(DOMAIN_CONSTANTS["otype"]) | {spec.obj})
    rtypes = sorted(set(receps.values()) | set(DOMAIN_CONSTANTS["rtype"]))
    start = "loc|start"
    decl = ["agent1 - agent"]
    decl += [f"{t}Type - otype" for t in otypes] + [f"{t}Type - rtype" for t in rtypes]
    decl += [f"{_fix(o)} - object" for o, _, _ in objs] + [f"{_fix(r)} - receptacle" for r in sorted(receps)]
    decl += [f"{_fix(loc)} - location" for loc in sorted(set(spec.receptacles.values()) | {start})]
    init = ["(= (total-cost) 0)", f"(atLocation agent1 {_fix(start)})"]
    for rid in sorted(receps):
        cls = receps[rid]
        init.append(f"(receptacleType {_fix(rid)} {cls}Type)")
        init.append(f"(receptacleAtLocation {_fix(rid)} {_fix(spec.receptacles[rid])})")
        if cls in OPENABLE:
            init.append(f"(openable {_fix(rid)})")
    for rc in rtypes:
        for oc in otypes:
            if oc in consts.VAL_RECEPTACLE_OBJECTS.get(rc, ()):
                init.append(f"(canContain {rc}Type {oc}Type)")
    for oid, cls, rid in objs:
        o = _fix(oid)
        init += [
            f"(objectType {o} {cls}Type)",
            f"(inReceptacle {o} {_fix(rid)})",
            f"(objectAtLocation {o} {_fix(spec.receptacles[rid])})",
        ]
        if cls in LAMPS:
            init.append(f"(toggleable {o})")
            continue
        init.append(f"(pickupable {o})")
        for prop, pred in (("Cleanable", "cleanable"), ("Heatable", "heatable"), ("Coolable", "coolable")):
            if cls in consts.VAL_ACTION_OBJECTS[prop]:
                init.append(f"({pred} {o})")
        if cls in consts.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {o})")
    goal = (
        glib.gdict[spec.task_type]["pddl"]
        .format(obj=spec.obj, recep=spec.recep, toggle=spec.toggle or "", mrecep="")
        .replace("#", "-")
    )
    lines = [f"(define (problem {name})", "    (:domain alfred)", "    (:objects"]
    lines += ["        " + d for d in decl] + ["    )", "    (:init"]
    lines += ["        " + f for f in init] + ["    )"]
    return "\n".join(lines) + "\n" + goal.strip() + "\n"


def game_data(spec: GameSpec, name: str) -> dict:
    """The ``game.tw-pddl`` JSON (domain, grammar with the goal text, problem) before solving."""
    return {
        "pddl_domain": assets.domain_text(),
        "grammar": assets.grammar_text().replace("UNKNOWN GOAL", spec.goal_text),
        "pddl_problem": problem_pddl(spec, name),
        "solvable": None,
        "walkthrough": None,
    }


def task_dir_name(spec: GameSpec) -> str:
    """ALFRED-style task folder: ``<type>-<Obj>-None-<Recep or Lamp>-<plan number>``."""
    return f"{spec.task_type}-{spec.obj}-None-{spec.recep}-{spec.floor_plan[len('FloorPlan') :]}"


def solve(game: dict, max_steps: int = 60) -> list[str] | None:
    """The planner's policy commands at reset, if following them (all admissible) wins; else None.

    The planner (fast-downward's lazy search, no bound of its own) runs in a child process whose
    address space may grow by at most :data:`PLANNER_MEM_MB` once it has read the game: on some
    problems its search never ends (train[83] of data_seed 42, two cups into the fridge of a room with
    40 openable receptacles, grew past 3.4 GB in 12 minutes), so such an attempt counts as unsolvable
    and :func:`make_game` draws the next one. Memory, not time, is the bound: the search's memory is a
    function of the problem (and the planner's build), so every machine, loaded or not, gives up on the
    same attempts, but for one whose need lies within a few MiB of the budget on another Python or
    libc (solved games mostly need 41-77 MiB). The child is forked from a zygote that never made a game
    (:mod:`.bounded`), not from this process, so what it finds free does not depend on the games this
    process made before: the same verdicts for any ``--jobs``. Each attempt's planner library is loaded
    in the child and gone with it. Any other error in the child is raised here.
    """
    import os
    import signal
    import sys

    from fedagent.envs.alfworld import bounded

    kind, value, status = bounded.run("solve", {"game": game, "max_steps": max_steps}, PLANNER_MEM_MB)
    if kind is None:
        # Over the budget: bad_alloc -> std::terminate -> SIGABRT, or fast-downward's own
        # out-of-memory exit. Any other death (SIGSEGV, the OOM killer's SIGKILL) is not a verdict
        # on the game: raised, so that no catalogue silently depends on it.
        aborted = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGABRT
        if not (aborted or (os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0)):
            raise RuntimeError(f"solving {_problem_name(game)}: the planner's process died (wait status {status})")
        print(
            f"alfworld-gen: {_problem_name(game)}: the planner went over its {PLANNER_MEM_MB} MiB "
            f"(wait status {status}); next attempt",
            file=sys.stderr,
            flush=True,
        )
        return None
    if kind == "error":
        raise RuntimeError(f"solving {_problem_name(game)}: {value}")
    if kind == "memory":
        print(
            f"alfworld-gen: {_problem_name(game)}: MemoryError within {PLANNER_MEM_MB} MiB; next attempt",
            file=sys.stderr,
            flush=True,
        )
        return None
    return value


def _problem_name(game: dict) -> str:
    head = game["pddl_problem"].split("\n", 1)[0]  # (define (problem NAME)
    return head.split("(problem", 1)[-1].strip(" )") or "?"


def solve_payload(payload: dict) -> list[str] | None:
    """:func:`_solve` on a bounded call's input (``{"game", "max_steps"}``, :mod:`.bounded`)."""
    return _solve(payload["game"], int(payload["max_steps"]))


def _solve(game: dict, max_steps: int) -> list[str] | None:
    """:func:`solve`'s work, in this process, unbounded."""
    from fedagent.envs.alfworld.env import close_game, locked, open_game

    env = open_game(game, policy_commands=True)
    try:
        with locked():
            state = env.reset()
        plan = list(state["policy_commands"] or [])
        if not plan or len(plan) > max_steps or state["won"]:
            return None
        # Plan once, then only execute: replanning after every step would triple the cost.
        env.request_infos.policy_commands = False
        for command in plan:
            if command not in state["admissible_commands"]:
                return None
            with locked():
                state, _, _ = env.step(command)
        return plan if state["won"] else None
    finally:
        close_game(env)


def make_game(
    split: str, index: int, base_seed: int, plans: Sequence[str], n_distractors=DEFAULT_DISTRACTORS
) -> tuple[GameSpec, dict]:
    """Game ``index`` of ``split``: spec + solved game data (retries with ``epoch=attempt``)."""
    task_type = TASK_TYPE_CYCLE[index % len(TASK_TYPE_CYCLE)]
    for attempt in range(MAX_ATTEMPTS):
        rng = python_rng(base_seed, f"alfworld_gen_{split}", index=index, epoch=attempt)
        plan = rng.choice(list(plans))
        spec = plan_game(task_type, plan, rng, rng.randint(*n_distractors))
        if spec is None:
            continue
        game = game_data(spec, f"fedagent_{split}_{index}")
        walkthrough = solve(game)
        if walkthrough:
            game["solvable"], game["walkthrough"] = True, walkthrough
            return spec, game
    raise RuntimeError(f"no solvable {task_type} game for {split}[{index}] after {MAX_ATTEMPTS} attempts")


def _make_game_star(args):
    return make_game(*args)


def _games(split: str, n: int, base_seed: int, plans: list[str], n_distractors, jobs: int):
    """``make_game`` for indices 0..n-1 of ``split``, in index order; ``jobs`` > 1: in that many
    forked processes (each game is a pure function of its index: the same games as one process,
    and each process has its own PDDL lock and planner library). Forked, not spawned: a spawned
    child re-runs the parent's ``__main__``, and the GPU node's ``fedagent`` script (like any
    script without a ``__main__`` guard) would start the whole job again in every child. This
    process has opened no game and started no thread before the pool."""
    args = [(split, i, base_seed, plans, n_distractors) for i in range(int(n))]
    if jobs <= 1 or len(args) <= 1:
        return [make_game(*a) for a in args]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=min(jobs, len(args)), mp_context=multiprocessing.get_context("fork")) as ex:
        return list(ex.map(_make_game_star, args, chunksize=4))


def generate_games(
    out_dir: Path,
    *,
    base_seed: int,
    splits: dict[str, int],
    floor_plans: Sequence[str] | None = None,
    n_distractors=DEFAULT_DISTRACTORS,
    jobs: int = 1,
) -> dict:
    """Write ``splits`` ({split: n games}) under ``out_dir`` with one manifest per split.

    The output is built in a temporary sibling folder and renamed into place, so a killed
    run never leaves a half-written games folder. Returns ``{split: manifest}``. ``jobs``:
    processes solving games at once (the planner is serial within one; same output for any value).
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; generated game folders are written once")
    plans = list(floor_plans or assets.floor_plans())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".partial-alfworld-", dir=out_dir.parent))
    try:
        manifests = {}
        for split, n in sorted(splits.items()):
            rels = []
            for i, (spec, game) in enumerate(_games(split, n, base_seed, plans, n_distractors, jobs)):
                rel = f"{task_dir_name(spec)}/trial_G_{split}_{i:05d}/{data.GAME_FILE}"
                path = staging / split / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(game))
                (path.parent / "traj_data.json").write_text(json.dumps(_traj_data(spec), indent=1) + "\n")
                rels.append(rel)
            manifests[split] = data.write_manifest(staging / data.MANIFEST_DIR / f"{split}.json", split, rels)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifests


def _traj_data(spec: GameSpec) -> dict:
    # The fields ALFWorld's own loaders read, plus where the game came from.
    return {
        "task_type": spec.task_type,
        "scene": {"floor_plan": spec.floor_plan},
        "pddl_params": {
            "object_target": spec.obj,
            "parent_target": "" if spec.toggle else spec.recep,
            "toggle_target": spec.toggle or "",
            "mrecep_target": "",
            "object_sliced": False,
        },
        "task_desc": spec.goal_text,
        "generator": "fedagent.envs.alfworld.generate",
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``fedagent alfworld-games``."""
    parser.add_argument("--out", required=True, type=Path, help="games folder to create")
    parser.add_argument("--seed", required=True, type=int, help="base seed")
    parser.add_argument("--n-train", type=int, default=60)
    parser.add_argument("--n-val", type=int, default=12, help="games of split valid_seen")
    parser.add_argument("--jobs", type=int, default=1, help="processes solving games at once (same games)")


def run(args: argparse.Namespace) -> int:
    """Generate train + valid_seen games; print a one-line summary."""
    manifests = generate_games(
        args.out, base_seed=args.seed, splits={"train": args.n_train, "valid_seen": args.n_val}, jobs=args.jobs
    )
    print(
        "alfworld games: "
        + ", ".join(f"{s} {len(m['games'])} (sha256 {m['sha256'][:12]})" for s, m in manifests.items())
        + f" in {args.out}"
    )
    return 0
