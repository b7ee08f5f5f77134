"""WebShop product data: the standard raw files → normalised products, with a sha256 manifest.

The standard WebShop release ships (names as in ``web_agent_site/utils.py``):

- ``items_shuffle.json`` (or ``items_shuffle_1000.json``): a list of raw products
  ``{asin, name, full_description, small_description, pricing, customization_options,
  product_category, query, category, product_information, average_rating, reviews, ...}``;
- ``items_ins_v2.json`` (or ``items_ins_v2_1000.json``): ``{asin: {attributes,
  instruction, instruction_attributes}}``;
- optionally ``items_human_ins.json``: ``{asin: [{instruction, instruction_attributes,
  instruction_options}, ...]}``.

:func:`normalise_products` turns them into the engine's product dicts (the keys WebShop's
engine uses: ``Title``, ``Description``, ``BulletPoints``, ``Attributes``, ``options``,
``Price``, ``query``, ``name``, ``product_category``, ``category`` ...). The synthetic
catalogue (:mod:`.synth`) is written in the same raw shape and read by the same code.

Manifest: ``data_manifest(dir)`` = {file name: sha256} of the files used; a given
manifest (``--data-manifest``) must match exactly, or loading fails naming the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from fedagent.core.atomic import sha256_file

CATEGORIES = ("beauty", "electronics", "fashion", "food", "furniture")
PRODUCT_FILES = ("items_shuffle.json", "items_shuffle_1000.json")
ATTRIBUTE_FILES = ("items_ins_v2.json", "items_ins_v2_1000.json")
HUMAN_GOALS_FILE = "items_human_ins.json"
_PRICE = re.compile(r"\$?\s*([0-9][0-9,]*(?:\.[0-9]+)?)")


class WebShopDataError(ValueError):
    """The WebShop data files are missing, malformed or do not match their manifest."""


def _first_existing(root: Path, names) -> Path:
    for name in names:
        if (root / name).is_file():
            return root / name
    raise WebShopDataError(f"{root}: none of {list(names)} found")


def data_files(root: str | Path) -> dict[str, Path]:
    """The standard files under ``root``: products, attributes, and human goals if present."""
    root = Path(root)
    if not root.is_dir():
        raise WebShopDataError(f"WebShop data path {root} is not a directory")
    files = {"products": _first_existing(root, PRODUCT_FILES), "attributes": _first_existing(root, ATTRIBUTE_FILES)}
    if (root / HUMAN_GOALS_FILE).is_file():
        files["human_goals"] = root / HUMAN_GOALS_FILE
    return files


def data_manifest(files: dict[str, Path]) -> dict[str, str]:
    """{file name: sha256} of the data files, sorted by name."""
    return {p.name: sha256_file(p) for p in sorted(files.values(), key=lambda p: p.name)}


def check_manifest(files: dict[str, Path], expected: dict[str, str]) -> dict[str, str]:
    """Compare the files' sha256 with ``expected``; raise naming the first mismatch."""
    actual = data_manifest(files)
    for name, digest in sorted(expected.items()):
        if name not in actual:
            raise WebShopDataError(f"manifest lists {name} but it is not among the loaded files {sorted(actual)}")
        if actual[name] != digest:
            raise WebShopDataError(f"{name}: sha256 {actual[name]} does not match the manifest ({digest})")
    for name in actual:
        if name not in expected:
            raise WebShopDataError(f"{name} is used but not listed in the manifest")
    return actual


DEFAULT_PRICE = 100.0  # WebShop's price of a product without pricing


def parse_price(pricing) -> float:
    """The price of a raw ``pricing`` field: a "$x" string, "$x - $y" / "$x$y" (a range: its low
    end), a list of such strings (the first), or a number; missing or empty → $100 as in WebShop.

    WebShop itself charges a uniform draw from a price range (global RNG); fedagent charges the low
    end, so the price is a pure function of the data and the goal's price cap (drawn above the low
    end, as in WebShop) always admits the oracle purchase.
    """
    if pricing is None or pricing == "" or pricing == []:
        return DEFAULT_PRICE
    if isinstance(pricing, (int, float)) and not isinstance(pricing, bool):
        return float(pricing)
    if isinstance(pricing, list):
        pricing = pricing[0]
    if not isinstance(pricing, str):
        raise WebShopDataError(f"unreadable pricing {pricing!r}")
    m = _PRICE.search(pricing)
    if m is None:
        raise WebShopDataError(f"unreadable pricing {pricing!r}")
    return float(m.group(1).replace(",", ""))


def _options(raw) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, values in (raw or {}).items():
        vals = []
        for v in values:
            value = v.get("value") if isinstance(v, dict) else v
            if not isinstance(value, str):
                raise WebShopDataError(f"option {name!r} has a non-string value {value!r}")
            value = value.strip().lower()
            if value and value not in vals:
                vals.append(value)
        if vals:
            out[str(name).strip().lower()] = vals
    return out


def normalise_product(raw: dict, ins: dict | None) -> dict:
    """One raw product (+ its items_ins entry) → the engine's product dict."""
    asin = raw.get("asin")
    if not isinstance(asin, str) or not asin:
        raise WebShopDataError(f"product without an asin: {str(raw)[:120]}")
    bullets = raw.get("small_description") or []
    if isinstance(bullets, str):
        bullets = [bullets]
    info = raw.get("product_information") or {}
    features = [f"{k}: {v}" for k, v in info.items()] if isinstance(info, dict) else [str(x) for x in info]
    category = str(raw.get("category", "")).strip().lower()
    title = str(raw.get("name") or raw.get("Title") or "").strip()
    ins = ins or {}
    return {
        "asin": asin.upper(),
        "name": title,
        "Title": title,
        "Description": str(raw.get("full_description") or "").strip(),
        "BulletPoints": [str(b).strip() for b in bullets if str(b).strip()],
        "features": features,
        "Attributes": [str(a).strip().lower() for a in ins.get("attributes", [])],
        "options": _options(raw.get("customization_options")),
        "Price": parse_price(raw.get("pricing")),
        "query": str(raw.get("query", "")).strip().lower(),
        "product_category": str(raw.get("product_category", "")).strip(),
        "category": category,
        "Rating": raw.get("average_rating"),
        "Reviews": list(raw.get("reviews") or []),
        "instruction_text": ins.get("instruction"),
        "instruction_attributes": [str(a).strip().lower() for a in ins.get("instruction_attributes", [])],
    }


def normalise_products(raw_items: list, ins: dict, max_products: int | None = None) -> list[dict]:
    """Raw products (file order) → product dicts; duplicate asins keep the first (as WebShop)."""
    if not isinstance(raw_items, list):
        raise WebShopDataError("the products file must hold a JSON list")
    out, seen = [], set()
    for raw in raw_items:
        p = normalise_product(raw, ins.get(raw.get("asin")) if isinstance(ins, dict) else None)
        if p["asin"] in seen:
            continue
        seen.add(p["asin"])
        out.append(p)
        if max_products is not None and len(out) >= max_products:
            break
    if not out:
        raise WebShopDataError("no products")
    return out


def load_raw(root: str | Path, manifest: dict[str, str] | None = None):
    """(raw products, items_ins dict, human goals dict or None, {file: sha256}) from a data dir."""
    files = data_files(root)
    digests = check_manifest(files, manifest) if manifest is not None else data_manifest(files)
    items = json.loads(files["products"].read_text())
    ins = json.loads(files["attributes"].read_text())
    human = json.loads(files["human_goals"].read_text()) if "human_goals" in files else None
    if not isinstance(ins, dict):
        raise WebShopDataError(f"{files['attributes']}: expected an object keyed by asin")
    return items, ins, human, digests
