"""moebench: measure how mixture-of-experts language models train."""

__version__ = "0.1.0"
