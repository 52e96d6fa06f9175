"""Engines: the simulated ones (no torch) and, from #7, the real ones (the only torch users).

Import the submodules you use; `import mooncake.engine` imports nothing heavy.
"""

__all__: list[str] = []
