"""The vLLM fleet router assembly (`examples/vllm_router.py`): its config, its view of the fleet, its HTTP proxy."""
