"""Optax-style optimizers: transformations, schedules and mesh-aware clipping."""
