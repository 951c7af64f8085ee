"""CompiledFunction: the hit, the miss lifecycle, the cache table, staleness, planning, degrading."""
