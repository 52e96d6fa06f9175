"""The example cluster's parts: config, tokenizer, metrics, workers, gateway, backends.

Assembled by `examples/cluster.py`; nothing in `mooncake/` imports it.
"""
