"""Vendor runtimes, one thin adapter each. The adapters are imported with the features; the vendor libraries
they wrap only when a feature starts, or later (MindIO's wheel, which imports torch_npu, at distributed init)."""


class VendorUnavailable(RuntimeError):
    """A vendor runtime is missing or unusable; the message says which and how to fix it."""
