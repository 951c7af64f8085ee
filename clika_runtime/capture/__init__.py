"""One capture: the target, the plan values, export, assembly, the hot-path closures, fusing, hints, verify."""
