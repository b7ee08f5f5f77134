"""Where a PPO critic lives beside an actor: the ``critic/`` subdirectory of each model-like dir.

The global model of a round, a client update and an aggregate each hold the critic's
counterpart (an HF dir, a delta, server state) in ``critic/``, under the parent's manifest.
Aggregate, merge and verify treat it by this layout alone, never by the algorithm: a ``critic/``
beside the previous global model means every client update must carry one too. GRPO dirs have
none, and are written exactly as before.

Every critic/ sits in a folder of the same name, so its path says nothing about whose it is: a
client update's metrics.json records the sha256 of each file of the critic it trained
(:data:`CRITIC_RECORD`, :func:`critic_digests`), which ``fedagent verify`` compares with the
files found there (through the update's manifest).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

# The folder, and the metrics.json key of a PPO client update ({path relative to critic/: sha256} of its
# own critic): the update's names (fedagent.model.update_layout), importable from here.
from fedagent.model.update_layout import CRITIC_DIR, CRITIC_RECORD  # noqa: F401


class CriticLayoutError(ValueError):
    """The critic path of a round is inconsistent (a client lacks one, or prev does)."""


def critic_of(d: Path) -> Path:
    """``d/critic``."""
    return Path(d) / CRITIC_DIR


def has_critic(d: Path) -> bool:
    """Whether ``d`` carries a critic subdirectory."""
    return critic_of(d).is_dir()


def critic_pairs(prev_dir: Path, client_dirs: Sequence[Path]) -> tuple[Path, list[Path]] | None:
    """``(prev/critic, [client/critic...])`` when prev has a critic, None when nobody has one.

    A critic in prev but not in some client (the round would silently drop critic training) or
    in a client but not in prev (no delta base) is a :class:`CriticLayoutError` naming the dir.
    """
    lacking = [Path(d) for d in client_dirs if not has_critic(d)]
    if not has_critic(prev_dir):
        having = [Path(d) for d in client_dirs if has_critic(d)]
        if having:
            raise CriticLayoutError(f"client {having[0]}: carries a critic/ but prev {prev_dir} has none")
        return None
    if lacking:
        raise CriticLayoutError(
            f"client {lacking[0]}: no critic/ although prev {prev_dir} has one "
            "(a PPO round needs every client's critic)"
        )
    return critic_of(prev_dir), [critic_of(d) for d in client_dirs]


def critic_digests(d: Path) -> dict[str, str]:
    """``{path relative to d/critic: sha256}`` of every file of ``d``'s critic (sorted)."""
    from fedagent.core.atomic import sha256_file

    root = critic_of(d)
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}
