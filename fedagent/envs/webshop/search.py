"""BM25 product search over a catalogue, with the ``bm25s`` library (no hand-written BM25).

A :class:`SearchIndex` indexes the concatenation of some product fields (default: all five
the reference indexed: name, Title, description, features, BulletPoints) with Lucene's BM25
(k1, b). Tokenizer: lowercase word split, no stemming, no stop words (FACTS §3). ``search``
scores every document (``BM25.get_scores``) and returns the top ``k`` ASINs with a positive
score, ties broken by catalogue position, so a result never depends on a partial sort.
The index is read-only after construction and shared by every env of a service.
"""

from __future__ import annotations

from typing import Sequence

import bm25s
import numpy as np
from bm25s.tokenization import Tokenizer

ALL_FIELDS = ("name", "Title", "description", "features", "BulletPoints")


def field_text(product: dict, field: str) -> str:
    """The text of one indexable field of a product."""
    if field in ("name", "Title"):
        return str(product.get(field, ""))
    if field == "description":
        return str(product.get("Description", ""))
    if field == "features":
        return " ".join(product.get("features", []))
    if field == "BulletPoints":
        return " ".join(product.get("BulletPoints", []))
    raise ValueError(f"unknown search field {field!r} (one of {ALL_FIELDS})")


class SearchIndex:
    """BM25 over ``products`` (any list of product dicts; position = tie-break order)."""

    def __init__(
        self, products: Sequence[dict], *, fields: Sequence[str] = ALL_FIELDS, k1: float = 1.2, b: float = 0.75
    ):
        """Tokenize and index the chosen fields of every product."""
        if not products:
            raise ValueError("cannot index an empty catalogue")
        self.fields, self.k1, self.b = tuple(fields), float(k1), float(b)
        for f in self.fields:
            field_text({}, f)  # unknown field names fail here
        self.asins = [p["asin"] for p in products]
        texts = [" ".join(field_text(p, f) for f in self.fields) for p in products]
        self._tokenizer = Tokenizer(lower=True, stopwords=None, stemmer=None)
        corpus = self._tokenizer.tokenize(texts, return_as="ids", update_vocab=True, show_progress=False)
        self._bm25 = bm25s.BM25(k1=self.k1, b=self.b, method="lucene")
        self._bm25.index(corpus, show_progress=False)
        self._empty_id = self._tokenizer.get_vocab_dict().get("")

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every indexed product for ``query`` (zeros when no term is known)."""
        ids = self._tokenizer.tokenize([query], return_as="ids", update_vocab=False, show_progress=False)[0]
        ids = [i for i in ids if i != self._empty_id]
        if not ids:
            return np.zeros(len(self.asins), dtype=np.float32)
        return np.asarray(self._bm25.get_scores(ids))

    def search(self, query: str, k: int) -> list[str]:
        """ASINs of the top ``k`` products with a positive score, best first."""
        s = self.scores(query)
        order = np.lexsort((np.arange(len(s)), -s))  # score desc, then catalogue position
        return [self.asins[i] for i in order[:k] if s[i] > 0]
