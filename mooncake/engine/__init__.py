"""The real engines, the only torch users.

`config` (a model's shape and the presets, without torch), `model` (the dummy
LLaMA), `attention` (the kernels), `kv` (KV pages), `prefill` with `layerwise`
(its prefix loads and KV stores overlapped with the layers), `decode`
(continuous batching), `sampling`, `pipeline` (chunked pipeline parallelism).

Import the submodules you use; `import mooncake.engine` imports nothing heavy.
"""

__all__: list[str] = []
