"""Run-scoped verl engines (``train.verl.engines: run``; docs/explanation/verl-engines.md "Run-scoped verl
engines"): a verl engine set — Ray, the FSDP actor/reference/critic, the vLLM replicas, the agent-loop
workers — started by the first ``train-client`` job of a slot and kept alive for the later jobs, each of
which resets the engines to its own start (``fedagent.train.verl.refit.reset_trainer``) instead of
starting them. Each ``train_client`` stays its own Snakemake job: it builds its rows, env service and
agent-loop job file, sends one request, and converts and commits the checkpoint itself.

- :mod:`.keys`: which of a job's verl overrides shape the engines (the set's key) and which are per job.
- :mod:`.serve`: the set's request loop (socket, one job at a time, the job's log range, a watchdog that
  stops the set when its job's connection closes mid-fit, idle exit), generic over a fitter.
- :mod:`.server`: ``python -m fedagent.train.verl.engines.server``: verl's Hydra main whose TaskRunner
  builds the engines once and runs :func:`.serve.serve` with verl's trainer as the fitter.
- :mod:`.client`: the job's side: a slot (file lock), the set's start when none runs, the request.
- :mod:`.stop`: every set of a results dir stopped (the Snakefile's onsuccess/onerror).
"""
