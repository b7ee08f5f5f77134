"""Reading a run from its output files: summary and curves, status, the effective config."""
