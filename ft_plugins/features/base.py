"""The one shape every feature has: declared options, a runtime probe, and a report of its work."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

from ft_plugins.config import Option


class Feature:
    """A fault-tolerance feature, framework-neutral.

    ``start()`` loads the vendor runtime (raising :class:`ft_plugins.vendors.VendorUnavailable`
    with the reason when it is absent) and returns a short description of what it found.
    Framework adapters call the feature's own methods, and reach a vendor runtime only through its
    adapter in :mod:`ft_plugins.vendors` (e.g. the MindIO engine's ``TorchProcess``).
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    # features this one works on top of: where one is off, this one is off too, decided at activation, so that
    # every process of a job (the launcher's included) reaches the same answer
    requires: ClassVar[tuple[str, ...]] = ()
    requested = False  # asked for by name or ``all`` (set before ``start``), not merely found under ``auto``

    def __init__(self, framework: str, options: Mapping[str, Any]) -> None:
        self.framework = framework
        self.settings = dict(options)

    def start(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        """Release what ``start`` took; the default holds nothing."""

    def activity(self) -> str:
        """One line saying what the feature did in this process, for reports."""
        return ""
