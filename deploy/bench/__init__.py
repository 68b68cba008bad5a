"""Benchmarks behind ``tide bench ...``: each prints one JSON object."""
