"""Benchmark commands: each writes a JSON result and prints a table."""
