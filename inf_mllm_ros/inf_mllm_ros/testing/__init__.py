"""Helpers for the tests and benchmarks, not used by the node: small models of each family with random weights."""
