"""Vendor runtimes, one thin adapter each. Nothing here is imported until a feature needs it."""


class VendorUnavailable(RuntimeError):
    """A vendor runtime is missing or unusable; the message says which and how to fix it."""
