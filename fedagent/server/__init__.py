"""The server's step of a round: aggregate client updates, merge with a server optimizer, verify, drop records."""
