"""eyas: train EAGLE-3 speculative-decoding draft models."""

__version__ = "0.1.0"
