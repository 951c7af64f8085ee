"""The on-disk capture cache: fingerprints, entries, restore."""
