"""Benchmarks behind `dejavu bench ...`: each measures the SDK beside a ceiling in the same run."""
