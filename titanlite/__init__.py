"""titanlite: a compact torchtitan-style framework for pretraining Llama models."""

__version__ = "0.1.0"
