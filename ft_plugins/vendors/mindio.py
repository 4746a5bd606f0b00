"""Thin adapter over MindIO TTP (``mindio_ttp``, shipped inside MindCluster) and MindSpore's switch for it.

On PyTorch ft_plugins drives MindIO itself, as MindSpeed-LLM does natively: :class:`TorchProcess`
starts the controller (rank 0, unless MindCluster's TaskD runs it: ``MINDX_TASK_ID`` set) and the
processor before ``init_process_group``, then reports replicas, registers handlers and brackets updates.

MindSpore drives MindIO itself (``TrainFaultTolerance``); what this adapter adds is what users got
wrong by hand: a present and current ``mindio_ttp.framework_ttp``, and an ``MS_ENABLE_TFT`` value
that MindSpore actually understands. MindSpore matches exact substrings such as ``TTP:1``, so
``{TTP: 1}`` or ``{TTP:on}`` silently leave fault tolerance off; here they are errors.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from types import ModuleType
from collections import namedtuple
from typing import Any, Callable, Mapping

from ft_plugins.vendors import VendorUnavailable, versions

FRAMEWORK_MODULE = "mindio_ttp.framework_ttp"
TFT_VAR = "MS_ENABLE_TFT"
TFT_SWITCHES = ("TTP", "UCE", "ARF", "TSP", "HCCE", "RSC", "TRE")
TFT_EXAMPLE = "'{TTP:1}' or '{TTP:1,TSP:1}'"
# what MindSpore's TftHandle reads to reach the MindIO controller (msrun sets the last two)
CONTROLLER_VARS = ("MS_TFT_IP", "MS_TFT_PORT", "MS_WORKER_NUM", "MS_NODE_ID")
_REQUIRED = ("tft_init_processor", "tft_start_processor", "tft_register_save_ckpt_handler",
             "tft_register_rename_handler", "tft_set_optimizer_replica", "tft_end_updating_os")
# the addresses MindSpeed-LLM reads, first set wins; port 8000 as in MindCluster's job templates
CONTROLLER_ADDR_VARS = ("CONTROLLER_ADDR", "TTP_ADDR")
PROCESSOR_ADDR_VARS = ("PROCESSOR_ADDR", "TTP_ADDR")
DEFAULT_PORT = 8000
PORT_VAR = "TTP_PORT"  # MindCluster's job templates set it beside port 8000 (`ttp-port`)
TASK_ID_VAR = "MINDX_TASK_ID"
EXPORT_VERSION = "MindSpeed-LLM"  # one of the two values MindIO accepts; selects the Megatron-style dump
HANDLERS = ("save_ckpt", "rename", "exit", "stop", "clean", "repair", "rollback", "rebuild_group", "stream_sync")
# MindCluster's elastic-training strategy (MindIO's ZIT): registered where given
ZIT_HANDLERS = ("zit_downgrade_rebuild", "zit_upgrade_rebuild", "zit_upgrade_repair", "zit_upgrade_rollback")
RET_OK, RET_ERROR = 0, 1  # what MindIO's handlers answer (clean returns it; the others raise for RET_ERROR)
ARF_FINISH = "ARF FINISH"  # a replacement raises it from train: MindIO then rebuilds, repairs, rolls back
ZIT_SWITCH = "enable_zit"  # tft_init_processor's (and tft_init_controller's) keyword for it
_ITEM = r"^([A-Z]+):([0-9])$"  # compiled on first use (re caches it), not at import


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
        match = re.match(_ITEM, item.strip())
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
        raise VendorUnavailable(f"the installed mindio_ttp has no {FRAMEWORK_MODULE} ({exc}); install the "
                                f"mindio_ttp wheel of MindCluster {versions.MINDIO_TFT_API} or newer") from None
    missing = [name for name in _REQUIRED if not hasattr(module, name)]
    if missing and hasattr(module, "ttp_init_processor"):
        raise VendorUnavailable("the installed mindio_ttp has the old ttp_* API, which neither MindSpore nor "
                                "ft_plugins drives; "
                                f"install the mindio_ttp wheel of MindCluster {versions.MINDIO_TFT_API} or newer "
                                "(tft_* API)")
    if missing:
        raise VendorUnavailable(f"{FRAMEWORK_MODULE} lacks {', '.join(missing)}: unsupported MindIO version")
    return module


# collections' namedtuple, not typing.NamedTuple: that compiles each field's annotation when the class is made
class Endpoint(namedtuple("Endpoint", ("controller", "processor", "port", "tls_info"), defaults=("",))):
    """Where the controller listens and the processors connect; TLS only when ``tls_info`` is given."""

    __slots__ = ()
    controller: str
    processor: str
    port: int
    tls_info: str  # default ""


def endpoint(env: Mapping[str, str], addr: str = "", port: int = 0, tls_info: str = "") -> Endpoint:
    """The addresses as MindSpeed-LLM reads them (``CONTROLLER_ADDR`` / ``PROCESSOR_ADDR`` / ``TTP_ADDR``),
    overridden by ``addr`` and ``port``; VendorUnavailable when no address is known."""
    def first(names: tuple[str, ...]) -> str:
        return addr or next((env[name].strip() for name in names if env.get(name, "").strip()), "")

    controller, processor = first(CONTROLLER_ADDR_VARS), first(PROCESSOR_ADDR_VARS)
    if not controller or not processor:
        raise VendorUnavailable("no MindIO controller address: set TTP_ADDR (or CONTROLLER_ADDR and PROCESSOR_ADDR) "
                                "to the master node's IP, or FT_PLUGINS_TTP_ADDR")
    raw = env.get(PORT_VAR, "").strip()
    if not port and raw:
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            raise VendorUnavailable(f"{PORT_VAR}={raw!r} is not a port number; set it to the controller's port "
                                    "(MindCluster's templates use 8000) or set FT_PLUGINS_TTP_PORT")
        port = int(raw)
    return Endpoint(controller, processor, port or DEFAULT_PORT, tls_info)


def zit_lacking(api: ModuleType) -> str:
    """What this MindIO lacks of ZIT, MindCluster's ``elastic-training`` ("" when it has all of it): the switch
    ``tft_init_processor`` takes and the registration of each ZIT handler (a MindIO before them)."""
    registrations = (f"tft_register_{kind}_handler" for kind in ZIT_HANDLERS)
    missing = [name for name in registrations if not hasattr(api, name)]
    try:
        parameters = inspect.signature(api.tft_init_processor).parameters
    except (TypeError, ValueError):  # no signature to read (a compiled function): its registrations tell
        parameters = None
    if parameters is not None and ZIT_SWITCH not in parameters and not any(
            parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        missing.insert(0, f"tft_init_processor's {ZIT_SWITCH}")
    return ", ".join(missing)


class TorchProcess:
    """One training process's side of MindIO TTP on PyTorch; every ``tft_*`` call ft_plugins makes."""

    def __init__(self, api: ModuleType, where: Endpoint) -> None:
        self.api = api
        self.where = where
        self.zit = False  # ZIT switched on (:meth:`start`): its handlers are registered

    def start(self, rank: int, world_size: int, env: Mapping[str, str], arf: bool = False, zit: bool = False) -> None:
        """Before ``init_process_group``: the controller (rank 0 without TaskD), then this rank's processor;
        ``arf``: MindIO replaces a lost process and drives the repair handlers (the ``recover`` strategy); ``zit``:
        where none replaces it, the survivors scale in through the ZIT handlers (``elastic-training``), where this
        MindIO has them (:func:`zit_lacking`; :attr:`zit` says)."""
        tls = bool(self.where.tls_info)
        self.zit = zit and not zit_lacking(self.api)
        zit_switch = {ZIT_SWITCH: True} if self.zit else {}  # named only when on: a MindIO before ZIT lacks it
        if rank == 0 and not env.get(TASK_ID_VAR, "").strip():
            self.api.tft_init_controller(rank, world_size, False, enable_arf=arf, **zit_switch)
            self.api.tft_start_controller(self.where.controller, self.where.port, tls, self.where.tls_info)
        self.api.tft_init_processor(rank, world_size, False, enable_tls=tls, tls_info=self.where.tls_info,
                                    enable_arf=arf, **zit_switch)
        self.api.tft_start_processor(self.where.processor, self.where.port)

    def rebooted(self) -> bool:
        """Whether MindIO started this process to replace a lost one (it then joins through the handlers)."""
        return bool(self.api.tft_is_reboot_node())

    def wire(self, rank: int, replica_info: list[dict[str, object]], dp_ranks: list[int],
             handlers: Mapping[str, Callable[..., Any]]) -> None:
        """Once the model and optimizer exist: replicas, data-parallel group, every handler, export version."""
        self.report_layout(rank, replica_info, dp_ranks)
        for kind in (*HANDLERS, *(ZIT_HANDLERS if self.zit else ())):
            getattr(self.api, f"tft_register_{kind}_handler")(handlers[kind])
        self.api.set_mindio_export_version(EXPORT_VERSION)

    def report_layout(self, rank: int, replica_info: list[dict[str, object]], dp_ranks: list[int]) -> None:
        """This rank's optimizer replicas and data-parallel group, in MindIO's numbering: at the start, and again
        after a downgrade (MindIO picks the ranks of its dump and of its repairs from them)."""
        self.api.tft_set_optimizer_replica(rank, replica_info)
        self.api.tft_set_dp_group_info(rank, dp_ranks)

    def guarded(self, train: Callable[..., Any]) -> Callable[..., Any]:
        """``train`` under MindIO's exception handler (it reports the failure and waits for the controller)."""
        return self.api.tft_exception_handler(train)

    def start_update(self) -> None:
        self.api.tft_start_updating_os(-1)

    def end_update(self, step: int) -> None:
        self.api.tft_end_updating_os(step)

    def pause(self, step: int) -> None:
        self.api.tft_pause_train(step)


def repair_type(name: str) -> Any:
    """The value of MindIO's ``RepairType.<name>`` (e.g. ``RT_SEND``), as the repair context carries it."""
    return load_framework_api().RepairType[name].value


def optimizer_type(name: str) -> Any:
    """The value of MindIO's ``OptimizerType.<name>`` (``ATTENTION``: the dense optimizer, ``MOE``: experts')."""
    return load_framework_api().OptimizerType[name].value


def npu_device() -> Any:
    """torch_npu's device module where it offers MindIO's device stop and restart, else None (CPU, CUDA)."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    npu = importlib.import_module("torch_npu").npu
    return npu if hasattr(npu, "stop_device") and hasattr(npu, "restart_device") else None


def stop_device() -> bool:
    """Stop this process's NPU (its pending work then fails in the training thread); False without one."""
    npu = npu_device()
    if npu is None:
        return False
    npu.stop_device(npu.current_device())
    return True


def restart_device() -> bool:
    """Restart this process's NPU after a stop (its memory is kept); False without one."""
    npu = npu_device()
    if npu is None:
        return False
    npu.restart_device(npu.current_device(), rebuild_all_resources=False)
    return True
