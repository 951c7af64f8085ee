"""The guard: what a graph assumes of its inputs, the size-condition language, its shipped JSON form."""
