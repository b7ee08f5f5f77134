"""RL environments served over HTTP: protocol, pooled sessions, retrying client, games."""
