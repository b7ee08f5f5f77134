"""TextWorld for fedagent (``env.kind: textworld``, the default): games generated with ``tw-make``.

- :mod:`.games`   ``fedagent games``: the train/val game pools (plan/games) and the TaskSource
- :mod:`.env`     one env instance (TextWorld's own env, observations cleaned)
- :mod:`.prompt`  the ``textworld`` prompt family
- :mod:`.spec`    the :class:`~fedagent.core.envs.EnvSpec` the registry names

Nothing here imports ``textworld`` at import time.
"""
