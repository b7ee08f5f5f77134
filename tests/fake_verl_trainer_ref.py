"""tests/fake_verl_trainer.py, then verl 0.9.1's real KL reference worker built on CPU from the same
overrides (tests/verl_cpu_ref.py), in the process where the fake trainer ran our Ray worker hook with
the launch's runtime-env variables: the job's log gets whatever verl's reference worker prints.

``FEDAGENT_VERL_TRAINER=fake_verl_trainer_ref``.
"""

from __future__ import annotations

import sys

import fake_verl_trainer
import verl_cpu_ref


def main() -> int:
    rc = fake_verl_trainer.main()  # runs ray_hook.setup() with the launch's env vars
    if rc:
        return rc
    verl_cpu_ref.use_cpu_platform()
    from verl_helpers import compose_ppo

    verl_cpu_ref.build_reference(compose_ppo(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
