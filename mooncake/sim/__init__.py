"""The simulator: a disaggregated cluster and a coupled baseline on a virtual clock (no torch).

Import the submodules you use; `import mooncake.sim` imports nothing heavy.
"""

__all__: list[str] = []
