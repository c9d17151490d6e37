"""geserve: a Triton-compatible inference server whose GE backend runs compiled graphs on any accelerator."""

__version__ = "0.1.0"
