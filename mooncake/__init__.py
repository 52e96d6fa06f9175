"""mooncake: composable scheduling and caching primitives for KVCache-centric,
prefill/decode-disaggregated LLM serving, after the Mooncake paper.

Subpackages are imported on demand (``import mooncake.cache``); see
docs/architecture.md for the map.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
