"""ft_plugins: fault tolerance for Ascend training clusters, switched on instead of hand-edited.

The top-level package is framework-neutral and cheap to import: it is loaded into every training
process. Framework adapters live in :mod:`ft_plugins.torch` and :mod:`ft_plugins.mindspore`.
"""

__version__ = "0.1.0"
