"""The cross-key rule machinery: :class:`CrossRule` (registered with :func:`cross_rule` in
:data:`CROSS_RULES`) and :class:`Requirement` (a feature needs a setting).

Its own module, importing nothing of the config, so that an environment's spec
(:mod:`fedagent.core.envs`) can declare its rules without importing the schema it extends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping


@dataclass(frozen=True)
class CrossRule:
    """A constraint over several keys: ``check(get)`` returns what is wrong, or None.

    ``key`` is the key the message names; ``needs`` every key ``check`` reads (``key``
    included); ``violation`` a set of overrides (dotted keys) of the default config that breaks
    the rule and nothing else (the tests derive their bad configs from it).
    """

    key: str
    needs: tuple[str, ...]
    check: Callable[[Callable[[str], Any]], str | None]
    violation: Mapping[str, Any]


CROSS_RULES: list[CrossRule] = []
# Rules over keys no job carries (only planning reads them: the base model's source, the GPU jobs'
# Snakemake resources), so planning alone applies them.
PLAN_ONLY_RULES: set[str] = {"model"}


def cross_rule(key: str, needs: Iterable[str], violation: Mapping[str, Any]):
    """Register a :class:`CrossRule` (decorator over its ``check``)."""

    def register(check):
        CROSS_RULES.append(CrossRule(key, tuple(needs), check, dict(violation)))
        return check

    return register


@dataclass(frozen=True)
class Requirement:
    """A feature needs a setting: when ``when_key``'s value passes ``when``, ``need_key`` must be ``need``.

    ``key`` is the key the message names; ``message`` is formatted with ``value`` (``key``'s value)
    and ``got`` (``need_key``'s value); ``violation`` as in :class:`CrossRule`.
    """

    key: str
    when_key: str
    when: Callable[[Any], bool]
    need_key: str
    need: Any
    message: str
    violation: Mapping[str, Any]

    def check(self, get: Callable[[str], Any]) -> str | None:
        """The message when the feature is on and the setting is not what it needs, else None."""
        if self.when(get(self.when_key)) and get(self.need_key) != self.need:
            return self.message.format(value=get(self.key), got=get(self.need_key))
        return None
