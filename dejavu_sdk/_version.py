"""The package version, kept apart so that packaging can read it without importing torch."""

__version__ = "0.1.0"
