"""Running a model: loading and its cache, placement over devices, batching, the generation
loop that feeds the archive, and the parent run that derived runs replay."""
