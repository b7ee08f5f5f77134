"""The foundation every layer stands on: config and its checks, atomic outputs, seeds, timing, provenance, weight headers."""
