"""mooncake: composable scheduling and caching primitives for KVCache-centric LLM serving."""
__version__ = "0.1.0"
