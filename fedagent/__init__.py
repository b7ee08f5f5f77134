"""fedagent: federated reinforcement learning of LLM agents, as a Snakemake round graph."""

__version__ = "0.1.0"
