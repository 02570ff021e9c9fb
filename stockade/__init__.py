"""Stockade: contain code written by AI agents."""

__version__ = "0.1.0"
