"""The shipped artefact: ModelGraph, the torch-free ServedGraph, describing and validating saved graphs."""
