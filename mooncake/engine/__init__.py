"""The real engines (the only torch users): model, attention, KV pages, prefill, decode, pipeline.

Import the submodules you use; `import mooncake.engine` imports nothing heavy
(`mooncake.engine.config`, the model presets, needs no torch).
"""

__all__: list[str] = []
