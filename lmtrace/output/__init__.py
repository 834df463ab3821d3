"""What every command writes for people and scripts: strict JSON, progress events, tables fitted
to the terminal, and the probability colour scale."""
