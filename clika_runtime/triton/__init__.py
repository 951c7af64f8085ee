"""A graph as a Triton model repository: the writer, the rules it shares with the checker, the checker, pbtxt."""
