"""Prometheus metrics: one table of names (families.py), one recorder, one exposition."""
