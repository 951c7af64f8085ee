"""What every other package stands on: errors, process-wide limits, specs, turn-taking, memory, the version."""
