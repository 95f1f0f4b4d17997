"""Benchmarks of durable beside the database's own ceiling: ``python bench/run.py``."""
