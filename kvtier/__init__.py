"""kvtier: an LLM inference server for long contexts on small GPUs."""

__version__ = "0.1.0"
