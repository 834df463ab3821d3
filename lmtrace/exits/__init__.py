"""How a command ends: one-line errors with their exit codes, and signals (exit 3)."""
