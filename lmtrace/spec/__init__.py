"""What a user writes: the run spec, prompt files and their metadata, step ranges, sweep specs."""
