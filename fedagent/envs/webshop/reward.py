"""WebShop's purchase score, with the option comparison corrected (FACTS §4).

score = (attribute matches + option matches + r_price) / (|attributes| + |goal options| + 1),
times r_type. Attribute match: fuzzy token-set ratio > 85 against the product's attributes,
else a substring hit in Title / BulletPoints / Description. Option match: ratio > 85 of a
goal option *value* against the clicked *values*, both sides colour-normalised. r_price:
price <= price_upper. Fuzzy matching is ``rapidfuzz`` with ``default_process`` (what
``thefuzz``'s full_process did for the reference).

The reference compared the clicked values against the goal's ``(name, value)`` tuples and
normalised the clicked side only, which capped 458 of 6725 option goals below 1.0. Here
:func:`option_values` turns goal options (a dict name → value, or a list of values) into
values, and :func:`normalize_color` refuses anything that is not a string, so that shape
can never come back silently.

r_type follows ``get_type_reward``: 1, or 0.5 if neither the query, >= 2 category levels
nor > 20% of the goal title's nouns match, 0.1 below 10%, 0 at none. The reference found the
nouns with spaCy's ``en_core_web_sm`` (a model-hub download, not available here); we use
the title's alphabetic words that are not stop words — the same for the target product, so
the oracle score is unaffected, and documented in docs/explanation/webshop.md.
"""

from __future__ import annotations

import re

from rapidfuzz import fuzz, utils

MATCH_THRESHOLD = 85
COLOR_SET = [
    "alabaster",
    "apricot",
    "aqua",
    "ash",
    "asphalt",
    "azure",
    "banana",
    "beige",
    "black",
    "blue",
    "blush",
    "bordeaux",
    "bronze",
    "brown",
    "burgundy",
    "camel",
    "camo",
    "caramel",
    "champagne",
    "charcoal",
    "cheetah",
    "chestnut",
    "chocolate",
    "christmas",
    "coffee",
    "cognac",
    "copper",
    "coral",
    "cranberry",
    "cream",
    "crystal",
    "dark",
    "denim",
    "eggplant",
    "elephant",
    "espresso",
    "fuchsia",
    "gold",
    "granite",
    "grape",
    "graphite",
    "grass",
    "gray",
    "green",
    "grey",
    "heather",
    "indigo",
    "ivory",
    "ivy",
    "khaki",
    "lavender",
    "lemon",
    "leopard",
    "light",
    "lilac",
    "lime",
    "magenta",
    "maroon",
    "mauve",
    "merlot",
    "mint",
    "mocha",
    "multicolor",
    "mustard",
    "natural",
    "navy",
    "nude",
    "olive",
    "orange",
    "peach",
    "pewter",
    "pink",
    "plum",
    "purple",
    "rainbow",
    "red",
    "rose",
    "royal",
    "rust",
    "sand",
    "sapphire",
    "silver",
    "skull",
    "slate",
    "steel",
    "stone",
    "sunset",
    "tan",
    "teal",
    "tiger",
    "turquoise",
    "violet",
    "walnut",
    "wheat",
    "white",
    "wine",
    "yellow",
]
_STOP = frozenset(
    """a an and the of for with to in on by from or at as is it its this that these those
    set pack count inch inches ft oz fl ounce x""".split()
)
_WORD = re.compile(r"[a-z]+")


def normalize_color(value: str) -> str:
    """WebShop's colour normaliser (first colour name contained in the text); strings only."""
    if not isinstance(value, str):
        raise TypeError(f"option values must be strings, got {type(value).__name__} {value!r}")
    for color in COLOR_SET:
        if color in value:
            return color
    return value


def option_values(goal_options) -> list[str]:
    """Goal options as a list of values: a dict's values (never its items) or a list as is."""
    if isinstance(goal_options, dict):
        return list(goal_options.values())
    if isinstance(goal_options, (list, tuple)):
        return list(goal_options)
    raise TypeError(f"goal options must be a dict or a list, got {type(goal_options).__name__}")


def _ratio(a: str, b: str) -> float:
    return fuzz.token_set_ratio(a, b, processor=utils.default_process)


def attribute_matches(product: dict, goal_attributes: list[str]) -> int:
    """How many goal attributes the product has (fuzzy attribute match or a text hit)."""
    title = product["Title"].lower()
    bullets = " ".join(product["BulletPoints"]).lower()
    description = product["Description"].lower()
    n = 0
    for g in goal_attributes:
        if any(_ratio(p, g) > MATCH_THRESHOLD for p in product["Attributes"]):
            n += 1
        elif g in title or g in bullets or g in description:
            n += 1
    return n


def option_matches(clicked_values: list[str], goal_values: list[str]) -> int:
    """How many goal option values match a clicked value (both colour-normalised)."""
    clicked = [normalize_color(v) for v in clicked_values]
    wanted = [normalize_color(v) for v in goal_values]
    return sum(1 for g in wanted if any(_ratio(p, g) > MATCH_THRESHOLD for p in clicked))


def _nouns(title: str) -> set[str]:
    return {w for w in _WORD.findall(title.lower()) if w not in _STOP and len(w) > 1}


def type_reward(product: dict, goal: dict) -> float:
    """r_type of ``get_type_reward`` (nouns approximated, see the module docstring)."""
    query_match = product["query"] == goal["query"]
    p_cat = {x.strip() for x in product["product_category"].split("›")}
    g_cat = {x.strip() for x in goal["product_category"].split("›")}
    category_match = len(p_cat & g_cat) >= 2
    desired = _nouns(goal["name"])
    title_score = 0.2 if not desired else len(_nouns(product["name"]) & desired) / len(desired)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type


def score(product: dict, goal: dict, price: float, clicked_options: dict[str, str]) -> dict:
    """The graded purchase score of buying ``product`` at ``price`` with ``clicked_options``."""
    goal_values = option_values(goal["goal_options"])
    r_price = 1 if price <= goal["price_upper"] else 0
    n_attr = attribute_matches(product, goal["attributes"])
    n_opt = option_matches(list(clicked_options.values()), goal_values)
    r_type = type_reward(product, goal)
    total = (n_attr + n_opt + r_price) / (len(goal["attributes"]) + len(goal_values) + 1) * r_type
    return {
        "score": total,
        "r_type": r_type,
        "r_price": r_price,
        "attribute_matches": n_attr,
        "option_matches": n_opt,
        "n_attributes": len(goal["attributes"]),
        "n_options": len(goal_values),
    }
