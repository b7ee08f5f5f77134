"""Snakemake's Slurm executor with status checks at most `seconds-between-status-checks` apart.

snakemake-executor-plugin-slurm (2.8) waits `init_seconds_before_status_checks` after a status
check that saw a job finish, then 10 s longer after every check that saw none, up to a
hard-coded 180 s: checks come 1, 12, 33, 64 ... s after the last finish, so a job that ends 35 s
after it was submitted is noticed 29 s late, and a round of fedagent's graph pays that on each
of its steps (docs/how-to/slurm.md, "Status checks"). This executor is that one, unchanged in everything else
(submission, resources, squeue/sacct, cancel, logs), except that every wait is capped at
Snakemake's own `--seconds-between-status-checks`. Used as `executor: slurm-paced` in
profiles/slurm; its settings are the Slurm plugin's, spelled `slurm-paced-...`.
"""

from __future__ import annotations

from dataclasses import dataclass

from snakemake_executor_plugin_slurm import Executor as SlurmExecutor
from snakemake_executor_plugin_slurm import ExecutorSettings as SlurmExecutorSettings
from snakemake_executor_plugin_slurm import common_settings  # noqa: F401  (read by Snakemake's plugin registry)


@dataclass
class ExecutorSettings(SlurmExecutorSettings):
    """The Slurm plugin's settings (status command, init wait, account, logs ...)."""


class Executor(SlurmExecutor):
    async def check_active_jobs(self, active_jobs):
        async for job in super().check_active_jobs(active_jobs):
            yield job
        cap = self.workflow.remote_execution_settings.seconds_between_status_checks
        self.next_seconds_between_status_checks = min(self.next_seconds_between_status_checks, cap)
