"""A graph as a Triton model repository: the writer, the rules it shares with its checker, pbtxt."""
