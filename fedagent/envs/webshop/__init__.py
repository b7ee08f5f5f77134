"""WebShop for fedagent (``env.kind: webshop``): the standard data or a synthetic catalogue.

- :mod:`.catalog`  the standard raw files → normalised products; sha256 manifest
- :mod:`.synth`    a deterministic synthetic catalogue in the same raw schema
- :mod:`.goals`    goals from products in one fixed construction order
- :mod:`.build`    ``fedagent webshop-catalog``: the task directory (plan/games)
- :mod:`.search`   BM25 search (``bm25s``)
- :mod:`.reward`   the purchase score with the corrected option comparison
- :mod:`.env`      the text environment (pages, actions, observation formatting)
- :mod:`.arms`     the five environment-heterogeneity arms
- :mod:`.source`   the TaskSource the env service serves

See docs/explanation/webshop.md.
"""
