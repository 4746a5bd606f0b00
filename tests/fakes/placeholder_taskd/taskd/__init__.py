"""Shaped like the PyPI placeholder 'taskd' 0.0.0.1: a Python interface for TaskC and TaskD, no taskd.api."""
