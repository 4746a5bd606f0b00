"""``ttp``: MindIO TTP dying-gasp checkpoint, saved by a healthy replica when a rank fails.

On MindSpore the framework owns the MindIO wiring (``TrainFaultTolerance``); this feature checks
what that wiring silently depends on: MindIO present, ``MS_ENABLE_TFT`` well-formed with
``TTP:1``, the controller address set. The framework adapter checks the rest (a data-parallel
replica, ``sink_size``) where the training setup is known. PyTorch support comes later.
"""

from __future__ import annotations

import os

from ft_plugins.config import Option
from ft_plugins.features.base import Feature
from ft_plugins.vendors import VendorUnavailable
from ft_plugins.vendors.mindio import TFT_EXAMPLE, TFT_VAR, load_framework_api, missing_controller_vars, tft_switches


class Ttp(Feature):
    name = "ttp"
    summary = "MindIO TTP dying-gasp checkpoint from a healthy replica (MindSpore: via TrainFaultTolerance)"
    options = (
        Option("save_dir", "", "directory for dying-gasp checkpoints (default: where the regular checkpoints go)"),
    )

    def start(self) -> str:
        if self.framework != "ms":
            raise VendorUnavailable("ttp is not available for PyTorch in this version (MindSpore only)")
        switches = tft_switches(os.environ)
        if "1" not in (switches.get("TTP"), switches.get("ARF")):  # MindSpore turns TTP on with ARF
            raise VendorUnavailable(f"{TFT_VAR} does not switch TTP on; launch with {TFT_VAR}={TFT_EXAMPLE} "
                                    "(it must be set before msrun starts, so that msrun wires TaskD too)")
        missing = missing_controller_vars(os.environ)
        if missing:
            raise VendorUnavailable(f"{', '.join(missing)} unset or not a number: MindSpore needs the MindIO "
                                    "controller address (MS_TFT_IP, MS_TFT_PORT) and msrun's MS_WORKER_NUM, MS_NODE_ID")
        self.api = load_framework_api()
        self.saves: list[str] = []
        return f"MindIO TTP found, {TFT_VAR}={os.environ[TFT_VAR]}"

    def activity(self) -> str:
        return f"dying-gasp checkpoints written: {', '.join(self.saves)}" if self.saves else "no dying-gasp save"
