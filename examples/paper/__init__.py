"""The paper's experiments on the simulated cluster, a module each; `examples/experiments.py` runs them."""
