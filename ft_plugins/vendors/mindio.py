"""Thin adapter over MindIO TTP (``mindio_ttp``, shipped inside MindCluster) and MindSpore's switch for it.

MindSpore drives MindIO itself (``TrainFaultTolerance``); what this adapter adds is what users got
wrong by hand: a present and current ``mindio_ttp.framework_ttp``, and an ``MS_ENABLE_TFT`` value
that MindSpore actually understands. MindSpore matches exact substrings such as ``TTP:1``, so
``{TTP: 1}`` or ``{TTP:on}`` silently leave fault tolerance off; here they are errors.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from types import ModuleType
from typing import Mapping

from ft_plugins.vendors import VendorUnavailable

FRAMEWORK_MODULE = "mindio_ttp.framework_ttp"
TFT_VAR = "MS_ENABLE_TFT"
TFT_SWITCHES = ("TTP", "UCE", "ARF", "TSP", "HCCE", "RSC", "TRE")
TFT_EXAMPLE = "'{TTP:1}' or '{TTP:1,TSP:1}'"
# what MindSpore's TftHandle reads to reach the MindIO controller (msrun sets the last two)
CONTROLLER_VARS = ("MS_TFT_IP", "MS_TFT_PORT", "MS_WORKER_NUM", "MS_NODE_ID")
_REQUIRED = ("tft_init_processor", "tft_start_processor", "tft_register_save_ckpt_handler",
             "tft_register_rename_handler", "tft_set_optimizer_replica", "tft_end_updating_os")
_ITEM = re.compile(r"^([A-Z]+):([0-9])$")


def tft_switches(env: Mapping[str, str]) -> dict[str, str]:
    """``MS_ENABLE_TFT`` as ``{switch: value}``; VendorUnavailable naming the fault when MindSpore would misread it."""
    raw = env.get(TFT_VAR, "")
    body = raw.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    if not body.strip():
        return {}
    switches: dict[str, str] = {}
    for item in body.split(","):
        match = _ITEM.match(item.strip())
        if match is None or match.group(1) not in TFT_SWITCHES:
            raise VendorUnavailable(
                f"{TFT_VAR}={raw!r} is not valid: {item.strip()!r} is not SWITCH:DIGIT with SWITCH one of "
                f"{', '.join(TFT_SWITCHES)} (no spaces around ':'); MindSpore only recognises the exact "
                f"spelling, e.g. {TFT_VAR}={TFT_EXAMPLE}"
            )
        switches[match.group(1)] = match.group(2)
    return switches


def import_blocker(env: Mapping[str, str]) -> str | None:
    """Why ``import mindspore`` will abort (MindSpore 2.7 splits every ``MS_ENABLE_TFT`` item on ':'), or None."""
    raw = env.get(TFT_VAR, "")
    items = [item.strip() for item in raw.strip().strip("{}").split(",") if item.strip()]
    if all(":" in item for item in items):
        return None
    return (f"{TFT_VAR}={raw!r} makes MindSpore abort while importing (every item must be SWITCH:DIGIT); "
            f"write it as {TFT_VAR}={TFT_EXAMPLE}")


def missing_controller_vars(env: Mapping[str, str]) -> list[str]:
    """The variables MindSpore needs to reach the MindIO controller that are unset or not numbers."""
    missing = [name for name in CONTROLLER_VARS if not env.get(name, "").strip()]
    return missing + [name for name in CONTROLLER_VARS[1:]
                      if name not in missing and not env[name].strip().isdigit()]


def load_framework_api() -> ModuleType:
    """Import ``mindio_ttp.framework_ttp``, or raise VendorUnavailable saying what is installed instead."""
    if importlib.util.find_spec("mindio_ttp") is None:
        raise VendorUnavailable("MindIO TTP is not installed (install the mindio_ttp wheel shipped with MindCluster)")
    try:
        module = importlib.import_module(FRAMEWORK_MODULE)
    except ImportError as exc:
        raise VendorUnavailable(f"the installed mindio_ttp has no {FRAMEWORK_MODULE} ({exc}); "
                                "install the mindio_ttp wheel of MindCluster 6.0 or newer") from None
    missing = [name for name in _REQUIRED if not hasattr(module, name)]
    if missing and hasattr(module, "ttp_init_processor"):
        raise VendorUnavailable("the installed mindio_ttp has the old ttp_* API, which MindSpore does not drive; "
                                "install the mindio_ttp wheel of MindCluster 6.0 or newer (tft_* API)")
    if missing:
        raise VendorUnavailable(f"{FRAMEWORK_MODULE} lacks {', '.join(missing)}: unsupported MindIO version")
    return module
