"""Rollout: prompts, action parsing and the policy-agnostic episode loop."""
