"""The queue: job store, scheduling policy, executors, cost ledger and the control plane."""
