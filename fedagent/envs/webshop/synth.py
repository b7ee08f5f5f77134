"""A deterministic synthetic WebShop catalogue in the standard raw schema.

``generate_raw(data_seed, n_products)`` returns ``(items, ins)`` shaped exactly like
``items_shuffle.json`` and ``items_ins_v2.json`` (see :mod:`.catalog`): products over
WebShop's five top-level categories with titles, descriptions, bullet points, product
information, prices, customisation options (colour/size/flavour ...) and attributes, plus
a human-style instruction per product. Product ``i`` depends only on
``derive_seed(data_seed, "webshop_product", index=i)``, so a catalogue of n products is
the prefix of any larger one with the same seed.

Option values include colours that WebShop's colour normaliser maps onto a colour hidden
inside a longer word ("multi-colored" → "red"): exactly the values that the reference's
tuple-vs-value option reward could never match (FACTS §4), so the oracle test bites.
"""

from __future__ import annotations

from fedagent.core.seeds import python_rng

_COLORS = [
    "black",
    "white",
    "navy blue",
    "light grey",
    "burgundy",
    "multi-colored",
    "rose gold",
    "olive green",
    "beige",
    "coral",
    "charcoal",
    "sky blue",
    "hot pink",
    "tan",
    "ivory",
    "teal",
    "mustard yellow",
    "dark brown",
    "silver",
    "lavender",
]

# category → product kinds: (query/name, category path tail, title nouns, attribute pool, option spec)
_SIZES_CLOTHES = ["small", "medium", "large", "x-large", "xx-large", "3x-large"]
_SIZES_SHOES = ["6", "6.5", "7", "7.5", "8", "8.5", "9", "9.5", "10", "11", "12 wide"]
_KINDS = {
    "beauty": {
        "path": "Beauty & Personal Care",
        "kinds": [
            (
                "shampoo",
                "Hair Care › Shampoo & Conditioner",
                {
                    "size": ["8 fl oz", "12 fl oz", "16 fl oz", "33.8 fl oz"],
                    "scent": ["lavender", "coconut", "argan oil", "unscented"],
                },
            ),
            ("lipstick", "Makeup › Lips › Lipstick", {"color": _COLORS}),
            ("face moisturizer", "Skin Care › Face › Moisturizers", {"size": ["1.7 oz", "2.5 oz", "pack of 2"]}),
            ("nail polish", "Foot, Hand & Nail Care › Nail Polish", {"color": _COLORS}),
            (
                "hair extension",
                "Hair Care › Hair Extensions",
                {"color": _COLORS, "size": ["14 inch", "18 inch", "22 inch"]},
            ),
            ("eau de parfum", "Fragrance › Women's › Eau de Parfum", {"size": ["1 fl oz", "1.7 fl oz", "3.4 fl oz"]}),
        ],
        "attributes": [
            "paraben free",
            "cruelty free",
            "long lasting",
            "sensitive skin",
            "natural ingredients",
            "travel size",
            "dermatologist tested",
            "hyaluronic acid",
            "alcohol free",
            "easy apply",
        ],
    },
    "electronics": {
        "path": "Electronics",
        "kinds": [
            ("wireless headphones", "Headphones, Earbuds & Accessories › Headphones › Over-Ear", {"color": _COLORS}),
            (
                "phone case",
                "Cell Phones & Accessories › Cases › Basic Cases",
                {"color": _COLORS, "size": ["iphone 13", "iphone 14 pro", "galaxy s22", "pixel 7"]},
            ),
            (
                "usb c cable",
                "Computers & Accessories › Cables › USB Cables",
                {"size": ["3 ft", "6 ft", "10 ft"], "color": ["black", "white", "rose gold"]},
            ),
            ("bluetooth speaker", "Portable Audio & Video › Portable Speakers", {"color": _COLORS}),
            (
                "power bank",
                "Cell Phones & Accessories › Chargers & Power Adapters › Power Banks",
                {"style": ["10000mah", "20000mah", "26800mah"]},
            ),
            (
                "hdmi cable",
                "Television & Video › Accessories › Cables › HDMI Cables",
                {"size": ["3 ft", "6 ft", "15 ft", "25 ft"]},
            ),
        ],
        "attributes": [
            "fast charging",
            "noise cancelling",
            "high definition",
            "easy use",
            "water resistant",
            "long battery life",
            "aluminum alloy",
            "plug play",
            "usb port",
            "high speed",
        ],
    },
    "fashion": {
        "path": "Clothing, Shoes & Jewelry",
        "kinds": [
            ("men's t-shirt", "Men › Clothing › Shirts › T-Shirts", {"color": _COLORS, "size": _SIZES_CLOTHES}),
            (
                "women's jeans",
                "Women › Clothing › Jeans",
                {"color": ["light wash", "dark wash", "black", "white"], "size": ["24", "26", "28", "30", "32"]},
            ),
            ("running shoes", "Men › Shoes › Athletic › Running", {"color": _COLORS, "size": _SIZES_SHOES}),
            ("women's dress", "Women › Clothing › Dresses › Casual", {"color": _COLORS, "size": _SIZES_CLOTHES}),
            (
                "pullover hoodie",
                "Men › Clothing › Fashion Hoodies & Sweatshirts",
                {"color": _COLORS, "size": _SIZES_CLOTHES},
            ),
            (
                "ankle socks",
                "Women › Clothing › Socks & Hosiery › Socks",
                {"color": _COLORS, "size": ["one size", "large"]},
            ),
        ],
        "attributes": [
            "machine wash",
            "slim fit",
            "long sleeve",
            "moisture wicking",
            "button closure",
            "cotton spandex",
            "elastic waist",
            "rubber sole",
            "short sleeve",
            "hand wash",
        ],
    },
    "food": {
        "path": "Grocery & Gourmet Food",
        "kinds": [
            (
                "ground coffee",
                "Beverages › Coffee, Tea & Cocoa › Coffee › Ground Coffee",
                {
                    "flavor": ["french roast", "mocha", "hazelnut", "vanilla"],
                    "size": ["12 ounce", "24 ounce", "pack of 3"],
                },
            ),
            (
                "protein bar",
                "Snack Foods › Bars › Protein Bars",
                {
                    "flavor": ["chocolate peanut butter", "sea salt caramel", "cookies and cream", "birthday cake"],
                    "size": ["12 count", "24 count"],
                },
            ),
            (
                "herbal tea",
                "Beverages › Coffee, Tea & Cocoa › Tea › Herbal",
                {"flavor": ["chamomile", "peppermint", "ginger", "hibiscus"]},
            ),
            ("snack mix", "Snack Foods › Trail Mix", {"size": ["1.5 ounce (pack of 12)", "26 ounce", "pack of 6"]}),
            (
                "extra virgin olive oil",
                "Pantry Staples › Cooking Oils › Olive Oils",
                {"size": ["16.9 fl oz", "33.8 fl oz", "1 gallon"]},
            ),
            (
                "dark chocolate",
                "Candy & Chocolate › Chocolate › Bars",
                {"flavor": ["70% cacao", "sea salt", "orange", "mint"]},
            ),
        ],
        "attributes": [
            "gluten free",
            "sugar free",
            "non gmo",
            "low carb",
            "keto friendly",
            "high protein",
            "natural ingredients",
            "dairy free",
            "ready eat",
            "individually wrapped",
        ],
    },
    "furniture": {
        "path": "Home & Kitchen › Furniture",
        "kinds": [
            ("office chair", "Home Office Furniture › Home Office Desk Chairs", {"color": _COLORS}),
            (
                "bookshelf",
                "Living Room Furniture › Bookcases",
                {"color": ["walnut", "white", "black", "oak"], "size": ["3-tier", "5-tier"]},
            ),
            (
                "coffee table",
                "Living Room Furniture › Tables › Coffee Tables",
                {"color": ["walnut", "white", "black", "rustic brown"]},
            ),
            (
                "bed frame",
                "Bedroom Furniture › Beds, Frames & Bases › Bed Frames",
                {"size": ["twin", "full", "queen", "king"]},
            ),
            ("storage cabinet", "Kitchen Furniture › Storage Cabinets", {"color": _COLORS}),
            (
                "bar stool",
                "Game & Recreation Room Furniture › Home Bar Furniture › Barstools",
                {"color": _COLORS, "size": ["24 inch", "26 inch", "30 inch", "set of 2"]},
            ),
        ],
        "attributes": [
            "easy assembly",
            "solid wood",
            "living room",
            "metal legs",
            "space saving",
            "height adjustable",
            "engineered wood",
            "storage space",
            "faux leather",
            "non slip",
        ],
    },
}
_BRANDS = [
    "Amberly",
    "Norvik",
    "Calloway",
    "Zentro",
    "Pinecrest",
    "Lumio",
    "Harbor & Co",
    "Vantly",
    "Oaken",
    "Brightway",
    "Solace",
    "Kestrel",
    "Marlowe",
    "Tidewell",
    "Quorra",
    "Everpine",
    "Rivanti",
    "Nimbus",
    "Halden",
    "Juniper Lane",
    "Orlo",
    "Stellan",
    "Copperfield",
    "Wrenly",
]
_ADJECTIVES = [
    "premium",
    "classic",
    "ultra",
    "compact",
    "deluxe",
    "everyday",
    "professional",
    "lightweight",
    "heavy duty",
    "modern",
    "vintage",
    "essential",
    "advanced",
    "soft",
    "durable",
]
_TEMPLATES = [
    "i'm looking for {name} that is {attrs}",
    "i need {name} that is {attrs}",
    "i want to buy {name}, and it should be {attrs}",
    "find me {name} which is {attrs}",
    "i am searching for {attrs} {name}",
]
_REVIEW_WORDS = ["great", "works as described", "good value", "fast shipping", "would buy again", "nice quality"]


def _cap(text: str) -> str:
    """Capitalise each word's first letter only ("men's t-shirt" → "Men's T-shirt")."""
    return " ".join(w[:1].upper() + w[1:] for w in text.split())


def _asin(rng) -> str:
    return "B0" + "".join(rng.choice("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(8))


def _product(data_seed: int, i: int) -> tuple[dict, dict]:
    rng = python_rng(data_seed, "webshop_product", index=i)
    category = sorted(_KINDS)[i % len(_KINDS)]  # balanced over the five categories
    spec = _KINDS[category]
    query, path_tail, option_spec = spec["kinds"][rng.randrange(len(spec["kinds"]))]
    brand, adjective = rng.choice(_BRANDS), rng.choice(_ADJECTIVES)
    attributes = rng.sample(spec["attributes"], rng.randint(2, 4))
    options = {}
    for name in sorted(option_spec):
        pool = option_spec[name]
        options[name] = rng.sample(pool, min(len(pool), rng.randint(2, 5)))
    title_attrs = ", ".join(_cap(a) for a in attributes[:2])
    title = f"{brand} {_cap(adjective)} {_cap(query)} - {title_attrs}"
    price = round(rng.uniform(4.0, 250.0)) - 0.01
    description = (
        f"The {brand} {adjective} {query} is built for everyday use. "
        f"It is {attributes[0]} and {attributes[-1]}. "
        f"Available in {len(next(iter(options.values())))} {next(iter(options))} options."
    )
    bullets = [f"{a.upper()}: this {query} is {a}." for a in attributes]
    bullets.append(f"WHAT YOU GET: 1 x {brand} {query}, worry-free support.")
    raw = {
        "asin": _asin(rng),
        "name": title,
        "full_description": description,
        "small_description": bullets,
        "pricing": [f"${price:.2f}"],
        "images": [],
        "product_category": f"{spec['path']} › {path_tail}",
        "query": query,
        "category": category,
        "page": 1,
        "product_information": {"Brand": brand, "Item model number": f"{brand[:3].upper()}-{rng.randint(100, 999)}"},
        "average_rating": f"{rng.randint(30, 50) / 10:.1f} out of 5 stars",
        "reviews": [
            {"score": rng.randint(3, 5), "title": rng.choice(_REVIEW_WORDS), "body": rng.choice(_REVIEW_WORDS)}
        ],
        "customization_options": {k: [{"value": v, "image": None} for v in vals] for k, vals in options.items()},
    }
    goal_attrs = rng.sample(attributes, rng.randint(1, min(2, len(attributes))))
    template = rng.choice(_TEMPLATES)
    instruction = template.format(name=f"{query}", attrs=" and ".join(goal_attrs))
    ins = {"attributes": attributes, "instruction": instruction, "instruction_attributes": goal_attrs}
    return raw, ins


def generate_raw(data_seed: int, n_products: int) -> tuple[list[dict], dict]:
    """``(items, ins)`` in the shape of ``items_shuffle.json`` / ``items_ins_v2.json``."""
    if n_products < len(_KINDS):
        raise ValueError(f"n_products must be at least {len(_KINDS)} (one per category), got {n_products}")
    items, ins, seen = [], {}, set()
    i = 0
    while len(items) < n_products:
        raw, entry = _product(data_seed, i)
        i += 1
        if raw["asin"] in seen:  # 36^8 asins: practically never, but never silently twice
            continue
        seen.add(raw["asin"])
        items.append(raw)
        ins[raw["asin"]] = entry
    return items, ins
