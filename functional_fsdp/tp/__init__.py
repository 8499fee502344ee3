"""Tensor parallelism: ops (Megatron's conjugate collectives), styles and plans."""
