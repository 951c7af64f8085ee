"""What a graph baked: the weights and the Python state it read, and their per-call checks."""
