"""The shipped artefact: ModelGraph, the torch-free ServedGraph, describing, inspecting and validating saved graphs."""
