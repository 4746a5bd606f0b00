"""The feature registry: every feature ft_plugins knows, by the name used in CLI, env, config and logs."""

from __future__ import annotations

from ft_plugins.config import Option
from ft_plugins.features.base import Feature
from ft_plugins.features.elastic import Elastic
from ft_plugins.features.hangs import Hangs
from ft_plugins.features.mstx import Mstx
from ft_plugins.features.recover import Recover
from ft_plugins.features.resume import Resume
from ft_plugins.features.taskd import Taskd
from ft_plugins.features.ttp import Ttp

FEATURES: dict[str, type[Feature]] = {feature.name: feature for feature in (Taskd, Mstx, Resume, Ttp, Recover, Elastic, Hangs)}


def declared_options() -> dict[str, tuple[Option, ...]]:
    return {name: feature.options for name, feature in FEATURES.items()}
