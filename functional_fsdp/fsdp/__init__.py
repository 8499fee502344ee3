"""The FSDP engine: units, policy, plans, the per-call runtime and memory accounting."""
