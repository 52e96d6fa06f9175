"""Scheduling: cost models, routers, decode selection, load prediction, admission and the Conductor.

Pure logic: no I/O, no threads, no clock reads. Time comes in as `now`,
randomness from seeded generators.
"""

__all__: list[str] = []
