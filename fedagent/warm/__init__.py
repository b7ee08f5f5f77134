"""A node-local warm fork server ("zygote"): GPU jobs stop paying the heavy imports each.

A job on the GPU node spends ≈ 12–14 s of its ≈ 25 s importing torch, transformers' model
classes and torch._dynamo before it does any work (``docs/results/cold-start.md``, cold start). The warm
server imports them once; each job is still its own process (own CUDA context, own process
group), but forked from that pre-imported parent instead of started from scratch.

- :mod:`fedagent.warm.protocol`: the wire format (length-prefixed JSON over ``AF_UNIX``, the
  client's fds 0/1/2 passed with ``SCM_RIGHTS``). Stdlib only.
- :mod:`fedagent.warm.client`: what ``fedagent <cmd>`` does when ``FEDAGENT_WARM_SOCKET`` is set —
  send the job, forward signals, return the job's exit code. Stdlib only (no torch, no numpy).
- :mod:`fedagent.warm.preload`: what the server imports, the fork-safety checks, and the guard
  that refuses a job the pre-imported code or environment would run differently from a fresh one.
- :mod:`fedagent.warm.server`: the single-threaded selector loop (forks; never threads).
- :mod:`fedagent.warm.child`: what a forked job does before and after running the command.
- :mod:`fedagent.warm.standby`: ``--standby N``: children forked ahead of their job that start CUDA
  first; a ``train-client``/``eval`` job runs in a ready one (the CUDA start off its clock).
- :mod:`fedagent.warm.cli`: ``fedagent warm-server --socket PATH [--standby N] [--detach | --stop | --ping]``.
"""
