"""``fedagent webshop-catalog``: the WebShop task directory (plan/games) of a run.

From the standard WebShop files (``--data DIR``, checked against ``--data-manifest`` when
given) or from the synthetic generator (:mod:`.synth`, seeded by ``--data-seed``), write
atomically::

    plan/games/
      raw/items_shuffle.json, raw/items_ins_v2.json   synthetic only: the generated raw files
      products.json      normalised products (list, catalogue order)
      goals.json         {"goals": [goal, ...]} in the fixed order; goal_id = "ws<position>"
      games.json         {kind: "webshop", train: [goal ids], val: [goal ids], task_types,
                          source: {...}, data_files: {name: sha256}, sha256}
      manifest.json      sha256 of every file (written last)

val = the first ``--val-goals`` goals, train = the rest (the reference: val = goals[0:500]).
``games.json`` has the same ``train``/``val`` lists every task directory has, so the
partition and val-set steps read it unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from fedagent.core.atomic import atomic_dir, verify_manifest
from fedagent.envs.webshop import catalog, goals as goals_mod, synth

GAMES_JSON = "games.json"
PRODUCTS_JSON = "products.json"
GOALS_JSON = "goals.json"
KIND = "webshop"


def id_lists_sha256(train: list[str], val: list[str]) -> str:
    """sha256 of the ordered train and val id lists (order is part of the contract)."""
    return hashlib.sha256(("\n".join(train) + "\n--val--\n" + "\n".join(val)).encode()).hexdigest()


def _dump(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n")


def build_catalog(
    out: Path,
    *,
    data_seed: int,
    n_products: int = 1000,
    goals_per_product: int = 2,
    val_goals: int = 500,
    data: Path | None = None,
    data_manifest: dict | None = None,
    goal_source: str = "synthetic",
    max_products: int | None = None,
    quarantine_root: Path | None = None,
) -> dict:
    """Build the task directory; return its games.json."""
    if goal_source not in ("synthetic", "human"):
        raise ValueError(f"goal source must be synthetic or human, got {goal_source!r}")
    if data is None:
        if data_manifest is not None:
            raise ValueError("a data manifest needs a data path")
        if goal_source != "synthetic":
            raise ValueError("human goals need the standard WebShop files (a data path)")
        items, ins = synth.generate_raw(data_seed, n_products)
        human, files = None, {}
        source = {"type": "synthetic", "data_seed": data_seed, "n_products": n_products}
    else:
        items, ins, human, files = catalog.load_raw(data, data_manifest)
        source = {"type": "webshop", "path": str(Path(data).resolve()), "max_products": max_products}
        if goal_source == "human" and human is None:
            raise catalog.WebShopDataError(f"{data}: goals=human needs {catalog.HUMAN_GOALS_FILE}")
    products = catalog.normalise_products(items, ins, max_products)
    categories: dict[str, int] = {}
    for p in products:
        categories[p["category"]] = categories.get(p["category"], 0) + 1
    bad = sorted(set(categories) - set(catalog.CATEGORIES))
    if bad and data is None:  # the generator's own guard; real data keeps its labels (recorded)
        raise catalog.WebShopDataError(f"categories {bad} are not WebShop's five {list(catalog.CATEGORIES)}")
    built = (
        goals_mod.synthetic_goals(products, data_seed, goals_per_product)
        if goal_source == "synthetic"
        else goals_mod.human_goals(products, human, data_seed)
    )
    ordered = goals_mod.order_goals(built, data_seed)
    if len(ordered) <= val_goals:
        raise ValueError(f"{len(ordered)} goals leave none for training after val_goals={val_goals}")
    ids = [g["goal_id"] for g in ordered]
    val, train = ids[:val_goals], ids[val_goals:]
    index = {
        "kind": KIND,
        "train": train,
        "val": val,
        "task_types": {g["goal_id"]: g["category"] for g in ordered},
        "source": {**source, "goals": goal_source, "goals_per_product": goals_per_product, "val_goals": val_goals},
        "data_files": files,
        "n_products": len(products),
        "categories": dict(sorted(categories.items())),
        "sha256": id_lists_sha256(train, val),
    }
    with atomic_dir(Path(out), quarantine_root) as staging:
        if data is None:
            (staging / "raw").mkdir()
            _dump(staging / "raw" / catalog.PRODUCT_FILES[0], items)
            _dump(staging / "raw" / catalog.ATTRIBUTE_FILES[0], ins)
        _dump(staging / PRODUCTS_JSON, products)
        _dump(staging / GOALS_JSON, {"goals": ordered})
        (staging / GAMES_JSON).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return index


def load_catalog(games_dir: Path, *, check_hashes: bool = True) -> tuple[dict, list[dict], list[dict]]:
    """(games.json, products, goals) of a verified WebShop task directory."""
    games_dir = Path(games_dir)
    verify_manifest(games_dir, check_hashes=check_hashes)
    index = json.loads((games_dir / GAMES_JSON).read_text())
    if index.get("kind") != KIND:
        raise ValueError(f"{games_dir}: not a WebShop task directory (kind {index.get('kind')!r})")
    if index.get("sha256") != id_lists_sha256(index["train"], index["val"]):
        raise ValueError(f"{games_dir}/{GAMES_JSON}: id-list sha256 does not match its lists")
    products = json.loads((games_dir / PRODUCTS_JSON).read_text())
    goals = json.loads((games_dir / GOALS_JSON).read_text())["goals"]
    return index, products, goals


def add_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``fedagent webshop-catalog``."""
    parser.add_argument("--out", required=True, type=Path, help="task directory to create (plan/games)")
    parser.add_argument("--data-seed", required=True, type=int, help="seed of the catalogue and goal order")
    parser.add_argument("--n-products", type=int, default=1000, help="synthetic catalogue size")
    parser.add_argument("--goals-per-product", type=int, default=2)
    parser.add_argument("--val-goals", type=int, default=500)
    parser.add_argument("--data", type=Path, default=None, help="standard WebShop data dir (else synthetic)")
    parser.add_argument("--data-manifest", type=Path, default=None, help="JSON {file name: sha256} to check")
    parser.add_argument("--goals", choices=["synthetic", "human"], default="synthetic")
    parser.add_argument("--max-products", type=int, default=None, help="use only the first N products")
    parser.add_argument("--quarantine", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent webshop-catalog``."""
    manifest = json.loads(Path(args.data_manifest).read_text()) if args.data_manifest else None
    index = build_catalog(
        args.out,
        data_seed=args.data_seed,
        n_products=args.n_products,
        goals_per_product=args.goals_per_product,
        val_goals=args.val_goals,
        data=args.data,
        data_manifest=manifest,
        goal_source=args.goals,
        max_products=args.max_products,
        quarantine_root=args.quarantine,
    )
    print(
        json.dumps(
            {
                "out": str(args.out),
                "products": index["n_products"],
                "train": len(index["train"]),
                "val": len(index["val"]),
                "sha256": index["sha256"],
            }
        )
    )
    return 0
