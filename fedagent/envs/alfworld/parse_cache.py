"""Memoized TextWorld grammar parsing and PDDL translation for ALFWorld's engine.

TextWorld's PDDL env builds each step's text (the feedback and every admissible command) by
deriving grammar templates, and ``ContextSensitiveGrammar.derive`` re-parses its template string
with a TatSu PEG parser on every call; the logic layer likewise re-parses the same rule and query
strings (``Rule.parse_conjunctive_query``) each step. The strings come from a fixed grammar, so
most of a step's CPU went to TatSu parsing the same few hundred strings again (memoized, a step
costs 3.2× less: ``bench/alfworld_env.py --parse-cache both``). TextWorld has no cache of its own;
this module wraps the two module-level ``_parse_and_convert`` functions with a bounded
``functools.lru_cache`` and hands each caller a deep copy of the cached parse: ``derive`` and
``replace`` set a context on the symbols they are given (each before it reads one, so sharing
them played the same in the test, but a copy keeps any caller from seeing another's). The parse
is a pure function of its arguments, so a copy of a cached result equals a fresh parse: the games
play out byte for byte as before (pinned in ``tests/test_alfworld_games.py``).

The PDDL translation (``fast_downward.pddl2sas``, twice per state: plain and ``optimize=True``) runs
at a game's load and again at every reset, on the same domain and problem text: more than half of
a load + reset. It is a pure function of its arguments too (it sets the translator's module options
it reads on every call), so it is memoized the same way (a few games per process; the task object
deep-copied out, the SAS text is a string).
"""

from __future__ import annotations

import copy
import functools
import threading

CACHE_SIZE = 8192  # distinct template/query strings kept per parser (ALFWorld's grammar: hundreds)
# Translations kept per process: ≈ 0.2–1.5 MB each on the matrix's games (tracemalloc), ≈ 11 MB in all.
PDDL_CACHE_SIZE = 16
_LOCK = threading.Lock()
_INSTALLED: dict[str, object] = {}
_ENABLED = [True]  # set_enabled(False): TextWorld's own parsing in this process (benchmarks, tests)


def _memoized(parse, size: int = CACHE_SIZE):
    @functools.lru_cache(maxsize=size)
    def cached(args: tuple, kwargs: tuple):
        return parse(*args, **dict(kwargs))

    @functools.wraps(parse)
    def wrapper(*args, **kwargs):
        try:
            key = (args, tuple(sorted(kwargs.items())))
            hash(key)
        except TypeError:  # an unhashable argument: parse it as TextWorld would
            return parse(*args, **kwargs)
        return copy.deepcopy(cached(*key))

    wrapper.cache_info = cached.cache_info
    wrapper.uncached = parse
    return wrapper


def _targets():
    """(name, module, attribute, cache size) of each wrapped function. TextWorld's PDDL state calls
    ``fast_downward.pddl2sas`` through the module, so the module attribute is the one to wrap."""
    import fast_downward
    import textworld.envs.pddl.textgen as textgen
    import textworld.logic as logic

    return (
        ("textgen", textgen, "_parse_and_convert", CACHE_SIZE),
        ("logic", logic, "_parse_and_convert", CACHE_SIZE),
        ("pddl2sas", fast_downward, "pddl2sas", PDDL_CACHE_SIZE),
    )


def install() -> None:
    """Wrap TextWorld's template and logic parsers and the PDDL translation (once per process;
    idempotent; a no-op after ``set_enabled(False)``). :func:`fedagent.envs.alfworld.env.open_game`
    calls it."""
    with _LOCK:
        if _INSTALLED or not _ENABLED[0]:
            return
        for name, module, attr, size in _targets():
            wrapped = _memoized(getattr(module, attr), size)
            setattr(module, attr, wrapped)
            _INSTALLED[name] = wrapped


def set_enabled(enabled: bool) -> None:
    """Memoize (True: installed now) or parse as TextWorld does (False: uninstalled, and
    :func:`install` does nothing until enabled again)."""
    _ENABLED[0] = bool(enabled)
    (install if enabled else _uninstall)()


def _uninstall() -> None:
    with _LOCK:
        for name, module, attr, _size in _targets():
            wrapped = _INSTALLED.pop(name, None)
            if wrapped is not None:
                setattr(module, attr, wrapped.uncached)


def stats() -> dict[str, tuple[int, int]]:
    """(hits, misses) per wrapped parser."""
    return {name: (w.cache_info().hits, w.cache_info().misses) for name, w in _INSTALLED.items()}
