"""Data shipped with dejavu-sdk: a sample of the Azure LLM inference trace 2023 (CC-BY-4.0, see README.md)."""
