"""The five WebShop environment-heterogeneity arms (FACTS §3): what one client's env sees.

An :class:`EnvView` is the catalogue plus the search function one service's envs use. The
unperturbed view (arm ``none``) is BM25 over every product, top ``search_return_n`` (50).
Each arm changes exactly one thing:

- ``catalog_split`` (content): the client's catalogue = the targets of its served goals ∪
  the ``round(keep_ratio·D)`` distractors with the lowest ``e = (1-env_div)·u + env_div·v``,
  ``u`` shared by all clients and ``v`` per client (both keyed by ASIN over the sorted ASIN
  list). Search takes the top-K over the full index, then drops non-catalogue items.
- ``bm25_field_subset`` (encoding): only some fields are indexed.
- ``bm25_reweight`` (matching): BM25's (k1, b) change.
- ``lookalike`` (content + matching): clones (new ASINs ``LK…``, never goal targets) of a
  seeded 30% of the products with price $9999 and/or altered colours / nonsense sizes are
  appended before indexing.
- ``rank_wrapper`` (rendering): the top-K is shuffled (first 50), inverted, or with
  probability 0.5 replaced by K random products; the randomness is keyed by (seed, client,
  query), so one client always sees the same page for the same query.

The variant of V2–V5 is fixed per client for the whole run: entry
``numpy_rng(seed, "webshop_env_variant", client=c).integers(variant_n)`` of the arm's pool
(the reference: ``RandomState(42+cid).randint(n)``), unless ``variant`` pins it.
Validation always uses the unperturbed view (the eval job passes no arm).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Callable, Sequence

import numpy as np

from fedagent.envs.webshop.search import ALL_FIELDS, SearchIndex
from fedagent.core.seeds import derive_seed, numpy_rng, python_rng

ARMS = ("none", "catalog_split", "bm25_field_subset", "bm25_reweight", "lookalike", "rank_wrapper")
FIELD_SUBSETS = [
    ALL_FIELDS,
    ("name", "Title"),
    ("description",),
    ("BulletPoints",),
    ("features",),
    ("name", "Title", "BulletPoints"),
    ("description", "features"),
    ("Title", "description", "features", "BulletPoints"),
]
REWEIGHTS = [(1.2, 0.75), (1.2, 0.0), (0.3, 0.75), (5.0, 0.75), (0.1, 0.75), (1.2, 1.0), (2.0, 0.5), (0.3, 0.0)]
LOOKALIKES = ["v_price", "v_color", "v_size", "v_price_color"]
RANK_WRAPPERS = ["v_bm25_default", "v_shuffled_topk", "v_inverted_topk", "v_partial_random"]
POOLS = {
    "bm25_field_subset": FIELD_SUBSETS,
    "bm25_reweight": REWEIGHTS,
    "lookalike": LOOKALIKES,
    "rank_wrapper": RANK_WRAPPERS,
}
LOOKALIKE_FRACTION = 0.3
LOOKALIKE_PRICE = 9999.0
SHUFFLE_TOP = 50
PARTIAL_RANDOM_P = 0.5
_ALT_COLORS = ["chartreuse", "vermilion", "periwinkle", "ochre", "puce", "cerulean", "magenta", "saffron"]
_NONSENSE_SIZES = ["size 0x", "xxxxxxl", "2 inch tall", "one-fourth", "size 99", "micro"]


class ArmError(ValueError):
    """Bad arm configuration."""


@dataclass(frozen=True)
class ArmSpec:
    """One service's environment arm (the ``env.webshop`` knobs that reach the service)."""

    arm: str = "none"
    search_return_n: int = 50
    variant_n: int = 4
    variant: int | None = None  # pin the pool entry (default: seeded per client)
    env_div: float = 0.0
    keep_ratio: float = 0.7
    seed: int = 42  # the run's data seed

    @classmethod
    def from_dict(cls, d: dict | None) -> "ArmSpec":
        """From the JSON the service receives; unknown keys and bad values are errors."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ArmError(f"unknown webshop env key(s) {unknown} (known: {sorted(known)})")
        spec = cls(**d)
        if spec.arm not in ARMS:
            raise ArmError(f"env.webshop.arm {spec.arm!r} is not one of {ARMS}")
        if spec.search_return_n < 1:
            raise ArmError("env.webshop.search_return_n must be >= 1")
        if not 0.0 <= spec.env_div <= 1.0 or not 0.0 <= spec.keep_ratio <= 1.0:
            raise ArmError("env.webshop.env_div and keep_ratio must lie in [0, 1]")
        pool = POOLS.get(spec.arm)
        if pool is not None and not 1 <= spec.variant_n <= len(pool):
            raise ArmError(f"env.webshop.variant_n must be in [1, {len(pool)}] for {spec.arm}")
        if pool is not None and spec.variant is not None and not 0 <= spec.variant < spec.variant_n:
            raise ArmError(f"env.webshop.variant must be in [0, {spec.variant_n})")
        return spec

    def variant_index(self, client: int | None) -> int:
        """The client's fixed pool entry."""
        if self.variant is not None:
            return self.variant
        if client is None:
            raise ArmError(f"arm {self.arm} needs a client id")
        return int(numpy_rng(self.seed, "webshop_env_variant", client=int(client)).integers(self.variant_n))


@dataclass
class EnvView:
    """The catalogue (ASIN → product, incl. any lookalikes) and the search one service uses."""

    products: dict[str, dict]
    search: Callable[[str], list[str]]
    info: dict


def _query_key(query: str) -> int:
    return int(hashlib.sha256(query.encode()).hexdigest()[:15], 16)


def catalog_split(
    asins: Sequence[str], targets: set[str], env_div: float, keep_ratio: float, seed: int, client: int
) -> set[str]:
    """The client's catalogue: every target plus the kept distractors (FACTS §3 steps 3–6)."""
    full = sorted(asins)
    u = dict(zip(full, numpy_rng(seed, "catalog_split_u").random(len(full))))
    v = dict(zip(full, numpy_rng(seed, "catalog_split_v", client=int(client)).random(len(full))))
    distractors = [a for a in full if a not in targets]
    keep = round(keep_ratio * len(distractors))
    ranked = sorted(distractors, key=lambda a: ((1 - env_div) * u[a] + env_div * v[a], a))
    return set(targets) | set(ranked[:keep])


def lookalikes(products: Sequence[dict], kind: str, seed: int, client: int, target_asins: set[str]) -> list[dict]:
    """``LK`` clones of a seeded 30% of the products (deep copies; never goal targets)."""
    rng = python_rng(seed, "webshop_lookalike", client=int(client))
    out = []
    for p in products:
        if rng.random() >= LOOKALIKE_FRACTION:
            continue
        clone = copy.deepcopy(p)
        clone["asin"] = f"LK{p['asin']}"
        changed = False
        if kind in ("v_price", "v_price_color"):
            clone["Price"], changed = LOOKALIKE_PRICE, True
        if kind in ("v_color", "v_price_color") and "color" in clone["options"]:
            clone["options"]["color"] = rng.sample(_ALT_COLORS, len(clone["options"]["color"][: len(_ALT_COLORS)]))
            changed = True
        if kind == "v_size" and "size" in clone["options"]:
            clone["options"]["size"] = rng.sample(_NONSENSE_SIZES, min(3, len(_NONSENSE_SIZES)))
            changed = True
        if changed:
            assert clone["asin"] not in target_asins
            out.append(clone)
    return out


def build_view(
    products: Sequence[dict], spec: ArmSpec, *, client: int | None = None, served_goals: Sequence[dict] = ()
) -> EnvView:
    """The view of one service: ``products`` perturbed by ``spec`` for ``client``."""
    by_asin = {p["asin"]: p for p in products}
    n = spec.search_return_n
    info: dict = {"arm": spec.arm, "search_return_n": n}
    targets = {g["asin"] for g in served_goals}
    missing = sorted(targets - set(by_asin))
    if missing:
        raise ArmError(f"served goals target products not in the catalogue: {missing[:5]}")
    if spec.arm == "none":
        index = SearchIndex(products)
        info["catalog_size"] = len(by_asin)
        return EnvView(by_asin, lambda q: index.search(q, n), info)
    if spec.arm == "catalog_split":
        if client is None:
            raise ArmError("catalog_split needs a client id")
        keep = catalog_split(list(by_asin), targets, spec.env_div, spec.keep_ratio, spec.seed, client)
        index = SearchIndex(products)  # the full index: top-K first
        info.update(
            catalog_size=len(keep),
            n_targets=len(targets),
            env_div=spec.env_div,
            keep_ratio=spec.keep_ratio,
            catalog_sha256=hashlib.sha256("\n".join(sorted(keep)).encode()).hexdigest(),
        )
        view = {a: p for a, p in by_asin.items() if a in keep}
        return EnvView(view, lambda q: [a for a in index.search(q, n) if a in keep], info)
    k = spec.variant_index(client)
    variant = POOLS[spec.arm][k]
    info.update(variant_index=k, variant=list(variant) if isinstance(variant, tuple) else variant)
    if spec.arm == "bm25_field_subset":
        index = SearchIndex(products, fields=variant)
        info["catalog_size"] = len(by_asin)
        return EnvView(by_asin, lambda q: index.search(q, n), info)
    if spec.arm == "bm25_reweight":
        index = SearchIndex(products, k1=variant[0], b=variant[1])
        info["catalog_size"] = len(by_asin)
        return EnvView(by_asin, lambda q: index.search(q, n), info)
    if spec.arm == "lookalike":
        clones = lookalikes(products, variant, spec.seed, 0 if client is None else client, targets)
        all_products = list(products) + clones
        index = SearchIndex(all_products)
        info.update(catalog_size=len(all_products), n_lookalikes=len(clones))
        return EnvView({p["asin"]: p for p in all_products}, lambda q: index.search(q, n), info)
    # rank_wrapper
    index = SearchIndex(products)
    asins = list(by_asin)
    info["catalog_size"] = len(by_asin)
    c = 0 if client is None else int(client)

    def wrapped(query: str) -> list[str]:
        base = index.search(query, n)
        if variant == "v_bm25_default":
            return base
        if variant == "v_inverted_topk":
            return base[::-1]
        rng = np.random.default_rng(derive_seed(spec.seed, "rank_wrapper", client=c, index=_query_key(query)))
        if variant == "v_shuffled_topk":
            head = base[:SHUFFLE_TOP]
            return [head[i] for i in rng.permutation(len(head))] + base[SHUFFLE_TOP:]
        if rng.random() < PARTIAL_RANDOM_P:  # v_partial_random
            return [asins[i] for i in rng.choice(len(asins), size=min(n, len(asins)), replace=False)]
        return base

    return EnvView(by_asin, wrapped, info)


def spec_dict(spec: ArmSpec) -> dict:
    """The spec as plain JSON."""
    return asdict(spec)
