"""Meshes, collectives (the only c10d caller), simulated meshes and the process launcher."""
