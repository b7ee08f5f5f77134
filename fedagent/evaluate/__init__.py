"""Scoring a policy on tasks: the validation eval (local and vLLM) and the hardness labels."""
