"""The config's error type (its own module: the schema, the env registry and the rules all raise it)."""


class ConfigError(ValueError):
    """An invalid configuration; the message names the key."""
