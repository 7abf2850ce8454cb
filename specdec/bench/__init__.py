"""Benchmark helpers: prompt sets and running the roles as processes."""
