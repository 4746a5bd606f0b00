"""``ttp``: dying-gasp checkpoint, saved by the survivors when a rank fails.

On MindSpore the framework owns the MindIO wiring (``TrainFaultTolerance``); this feature checks
what that wiring silently depends on: MindIO present, ``MS_ENABLE_TFT`` well-formed with
``TTP:1``, the controller address set. The framework adapter checks the rest (a data-parallel
replica, ``sink_size``) where the training setup is known. Where ``MS_ENABLE_TFT`` does not switch
TTP on, the built-in engine (:mod:`ft_plugins.mindspore.dump`) runs when ``ttp`` is asked for by name.

On PyTorch there are two engines (option ``engine``): MindIO TTP where ``mindio_ttp`` is installed
(wired as MindSpeed-LLM does it natively: :mod:`ft_plugins.torch.megatron.mindio`), and the built-in engine
(:mod:`ft_plugins.torch.megatron.ttp`: dump on a fatal error or SIGTERM) elsewhere.
The built-in engine changes signal handling and exit codes, so ``FT_PLUGINS=auto`` never turns it
on: it runs only when ``ttp`` is asked for by name or with ``all``. Where MindSpeed-LLM's native
high availability or MindSpeed's own TTP is on, this feature steps aside.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Mapping, Sequence

from ft_plugins.config import Option, parse_positive_int, parse_seconds_or_off
from ft_plugins.features.base import Feature
from ft_plugins.vendors import VendorUnavailable
from ft_plugins.vendors.mindio import (DEFAULT_PORT, TFT_EXAMPLE, TFT_VAR, endpoint, load_framework_api,
                                       missing_controller_vars, tft_switches)

ENGINES = ("auto", "mindio", "builtin")
HIGH_AVAILABILITY_VAR = "HIGH_AVAILABILITY"
NATIVE_FLAGS = ("--enable-high-availability", "--ttp-enabled")
MINDSPEED_LLM = "mindspeed_llm"


def native_high_availability(env: Mapping[str, str], argv: Sequence[str]) -> str | None:
    """Which native dying-gasp wiring is on (MindSpeed-LLM's high availability, MindSpeed's TTP), or None.

    ``HIGH_AVAILABILITY`` counts only where MindSpeed-LLM is installed: MindCluster's operator sets it for
    every PyTorch job with a recover strategy, and plain Megatron has nothing that would read it."""
    if env.get(HIGH_AVAILABILITY_VAR, "").strip() and importlib.util.find_spec(MINDSPEED_LLM) is not None:
        return f"MindSpeed-LLM's native high availability ({HIGH_AVAILABILITY_VAR}={env[HIGH_AVAILABILITY_VAR]})"
    flag = next((arg for arg in argv if arg in NATIVE_FLAGS), None)
    if flag == NATIVE_FLAGS[0]:
        return f"MindSpeed-LLM's native high availability ({flag})"
    return f"MindSpeed's own TTP ({flag})" if flag else None


def _parse_replicas(raw: str) -> int | str:
    """``FT_PLUGINS_TTP_REPLICAS``; the replica layout module is imported only when the option is given."""
    from ft_plugins.replicas import parse_replicas

    return parse_replicas(raw)


class Ttp(Feature):
    name = "ttp"
    summary = "dying-gasp checkpoint by the survivors (MindIO TTP; PyTorch also a built-in engine)"
    options = (
        Option("save_dir", "", "directory for dying-gasp checkpoints (default: where the regular checkpoints go)"),
        Option("engine", "auto", "dying-gasp engine: auto (MindIO TTP when mindio_ttp is installed, on MindSpore "
               "when MS_ENABLE_TFT switches TTP on; else built-in), mindio or builtin", choices=ENGINES),
        Option("replicas", "auto", "optimizer state replicas with megatron's distributed optimizer: auto (2 where "
               "data parallel allows, else 1) or a count dividing the data-parallel size", _parse_replicas),
        Option("addr", "", "PyTorch MindIO engine: controller and processor address (default: CONTROLLER_ADDR / "
               "PROCESSOR_ADDR / TTP_ADDR)"),
        Option("port", 0, f"PyTorch MindIO engine: controller port (default: TTP_PORT, else {DEFAULT_PORT})",
               parse_positive_int),
        Option("tls_info", "", "PyTorch MindIO engine: MindIO's TLS settings; TLS stays off while empty"),
        Option("device_wait", 30.0, "PyTorch on a GPU or NPU: seconds the dump waits for the device to finish the "
               "last completed step's work, then copies it on a stream of its own (not behind a blocked "
               "collective); 0: copies on the current stream, as torch.save does", parse_seconds_or_off),
    )

    def start(self) -> str:
        if self.framework == "pt":
            return self._start_torch()
        wanted = self.settings["engine"]
        switches = tft_switches(os.environ)
        self.saves: list[str] = []
        mindio = "1" in (switches.get("TTP"), switches.get("ARF"))  # MindSpore turns TTP on with ARF too
        if not mindio:
            off = (f"{TFT_VAR} does not switch TTP on; launch with {TFT_VAR}={TFT_EXAMPLE} (it must be set before "
                   "msrun starts, so that msrun wires TaskD too)")
            if wanted == "mindio":
                raise VendorUnavailable(off)
            if not self.requested:
                raise VendorUnavailable(f"{off}, or ask for the built-in engine by name (FT_PLUGINS=ttp,resume)")
        if wanted == "builtin" or not mindio:
            self.engine = "builtin"
            why = "asked for" if wanted == "builtin" else f"{TFT_VAR} does not switch MindIO TTP on"
            return f"engine builtin ({why}): dump of the last completed step on a lost peer, a stalled step or SIGTERM"
        self.engine = "mindio"
        missing = missing_controller_vars(os.environ)
        if missing:
            raise VendorUnavailable(f"{', '.join(missing)} unset or not a number: MindSpore needs the MindIO "
                                    "controller address (MS_TFT_IP, MS_TFT_PORT) and msrun's MS_WORKER_NUM, MS_NODE_ID")
        self.api = load_framework_api()
        return f"MindIO TTP found, {TFT_VAR}={os.environ[TFT_VAR]}"

    def _start_torch(self) -> str:
        """Choose the engine; ``mindio_ttp`` imports torch_npu, so it is located here and imported later."""
        native = native_high_availability(os.environ, sys.argv)
        if native:
            raise VendorUnavailable(f"{native} is on: its own dying-gasp wiring runs, ttp steps aside")
        self.saves = []
        unread = (f"; {HIGH_AVAILABILITY_VAR}={os.environ[HIGH_AVAILABILITY_VAR]} is set, but without MindSpeed-LLM "
                  "nothing else wires a dump" if os.environ.get(HIGH_AVAILABILITY_VAR, "").strip() else "")
        wanted = self.settings["engine"]
        mindio = importlib.util.find_spec("mindio_ttp") is not None
        unconfigured = ""
        if wanted == "mindio" or (wanted == "auto" and mindio):
            try:
                return self._start_mindio(wanted, mindio) + unread
            except VendorUnavailable as exc:
                if wanted == "mindio":
                    raise
                # it would fail at start: the built-in engine serves, the launcher and the workers deciding alike
                unconfigured = (f"MindIO TTP is installed but not configured: {exc}; FT_PLUGINS_TTP_ENGINE=mindio "
                                "insists on it")
        if not self.requested:
            raise VendorUnavailable(f"{unconfigured or 'MindIO TTP is not installed'}, and the built-in engine runs "
                                    "only when ttp is asked for (FT_PLUGINS=ttp,... or all): it takes over SIGTERM "
                                    "and exit codes")
        self.engine = "builtin"
        why = "asked for" if wanted == "builtin" else unconfigured or "MindIO TTP is not installed"
        return f"engine builtin ({why}): dump on a fatal error or SIGTERM{unread}"

    def _start_mindio(self, wanted: str, installed: bool) -> str:
        if not installed:
            raise VendorUnavailable("engine mindio asked for, but MindIO TTP is not installed (install the mindio_ttp "
                                    "wheel shipped with MindCluster, or use FT_PLUGINS_TTP_ENGINE=builtin)")
        self.where = endpoint(os.environ, self.settings["addr"], self.settings["port"], self.settings["tls_info"])
        self.engine = "mindio"
        why = "asked for" if wanted == "mindio" else "mindio_ttp is installed"
        return (f"engine mindio ({why}): MindIO TTP controller {self.where.controller}:{self.where.port}, "
                f"TLS {'on' if self.where.tls_info else 'off'}")

    def activity(self) -> str:
        return f"dying-gasp checkpoints written: {', '.join(self.saves)}" if self.saves else "no dying-gasp save"
