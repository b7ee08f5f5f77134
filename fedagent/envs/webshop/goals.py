"""WebShop goals from products, in one fixed construction order.

Synthetic goals follow WebShop's ``get_synthetic_goals``: per product with an instruction,
option combinations (``goals_per_product`` of them, drawn without replacement), a price cap
drawn from the two-of-the-next-four price steps above the product's price, and the
instruction text ``<instruction> with <name>: <value>, and ... , and price lower than X
dollars``. Human goals (``items_human_ins.json``) follow ``get_human_goals``. The goal list
is then shuffled once with a local RNG from ``data_seed``.

Everything is a pure function of (products, data_seed, knobs): no global RNG, no thread or
pool-size dependence. The reference built goals inside every pooled env under a shared
global seed and raced (FACTS §4); here they are built once, at plan time, and written to
``goals.json``, which every env of every service reads.
"""

from __future__ import annotations

import itertools

from fedagent.core.seeds import python_rng

PRICE_RANGE = [10.0 * i for i in range(1, 100)]
NO_PRICE_CAP = 1_000_000.0


def price_clause(price: float, rng) -> tuple[float, str]:
    """(price_upper, text) as WebShop draws it; no cap when fewer than two steps lie above."""
    steps = [p for p in PRICE_RANGE if p > price][:4]
    if len(steps) < 2:
        return NO_PRICE_CAP, ""
    _, upper = sorted(rng.sample(steps, 2))
    return upper, f", and price lower than {upper:.2f} dollars"


def _goal(product: dict, instruction: str, attributes: list[str], options, price_upper: float) -> dict:
    return {
        "asin": product["asin"],
        "category": product["category"],
        "query": product["query"],
        "name": product["name"],
        "product_category": product["product_category"],
        "instruction_text": instruction,
        "attributes": list(attributes),
        "price_upper": price_upper,
        "goal_options": options,
    }


def synthetic_goals(products: list[dict], data_seed: int, goals_per_product: int = 2) -> list[dict]:
    """Goals of every product with an instruction, in product order (before the shuffle)."""
    goals = []
    for i, product in enumerate(products):
        if not product.get("instruction_text") or not product.get("instruction_attributes"):
            continue
        rng = python_rng(data_seed, "webshop_goal", index=i)
        price_upper, price_text = price_clause(product["Price"], rng)
        names = sorted(product["options"])
        combos = list(itertools.product(*(product["options"][n] for n in names)))
        picked = sorted(rng.sample(range(len(combos)), min(goals_per_product, len(combos))))
        per_product = []
        for c in picked:
            options = {n: v for n, v in zip(names, combos[c])}
            option_text = ", and ".join(f"{k}: {v}" for k, v in options.items())
            option_text = f" with {option_text}" if option_text else ""
            per_product.append(
                _goal(
                    product,
                    f"{product['instruction_text']}{option_text}{price_text}",
                    product["instruction_attributes"],
                    options,
                    price_upper,
                )
            )
        for g in per_product:
            g["weight"] = 1.0 / len(per_product)
        goals += per_product
    return goals


def human_goals(products: list[dict], human: dict, data_seed: int) -> list[dict]:
    """Goals of ``items_human_ins.json`` for the loaded products (option values as a list)."""
    goals = []
    for i, product in enumerate(products):
        entries = human.get(product["asin"]) or []
        for j, entry in enumerate(entries):
            attributes = entry.get("instruction_attributes") or []
            if not attributes:
                continue
            rng = python_rng(data_seed, "webshop_human_goal", index=i, epoch=j)
            price_upper, price_text = price_clause(product["Price"], rng)
            options = [str(o).strip().lower() for o in entry.get("instruction_options") or []]
            instruction = str(entry.get("instruction", "")).strip().strip(".")
            g = _goal(
                product, f"{instruction}{price_text}", [a.strip().lower() for a in attributes], options, price_upper
            )
            g["weight"] = 1.0
            goals.append(g)
    return goals


def order_goals(goals: list[dict], data_seed: int) -> list[dict]:
    """The fixed goal order: one seeded shuffle, then ids ``ws<position>``."""
    order = list(range(len(goals)))
    python_rng(data_seed, "webshop_goal_order").shuffle(order)
    width = max(5, len(str(len(goals))))
    out = []
    for pos, k in enumerate(order):
        g = dict(goals[k])
        g["goal_id"] = f"ws{pos:0{width}d}"
        out.append(g)
    return out
