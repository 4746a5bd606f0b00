"""Fake of ``mindio_ttp.framework_ttp``: the documented ``tft_*`` signatures, every call recorded.

Like the real module it imports ``torch_npu`` at import time. A controller thread (one per process,
started on first use) serves dump requests as MindIO's controller does after a rank failed: it calls
the registered save handler ``func(step, save_info, args, ctx)`` in a new thread, then the rename
handler: ``func(step, args)`` on PyTorch, ``func(step, ctx)`` with ``MINDIO_FOR_MINDSPORE=1``.
Requests come from ``fake_controller_dying_gasp(step)``, from ``tft_exception_handler`` (an
exception out of the guarded function is reported and the last step reported by ``tft_end_updating_os``
is dumped before the exception goes on: the controller's "dump, then exit") and, on PyTorch once the
processor has started, from a watcher of the other ranks' processes (:func:`arf.watch_peers`): MindIO's
controller asks every survivor for the dump when a process is lost, whatever its training thread is
blocked in (a rank whose collectives never reach the lost one learns of the loss only that way). One dump
per step and process: later requests of the same step get the first one's outcome. Once the guarded function
returned, rank 0 ends its controller and every rank its processor (MindIO's ``ttp_destroy``): a process that ended
its processor is watched no more, its exit is no loss.
``set_mindio_export_version`` switches on MindIO's stop and clean before every dump (it sets
``TTP_STOP_CLEAN_BEFORE_DUMP=1``; the processor's ``StopAndCleanBeforeDump`` then calls the registered stop and
clean handlers first, a failure only logged): recorded as ``fake_before_dump`` with each answer.
Once a dump has started ``tft_start_updating_os`` raises. On PyTorch, registering the save handler
makes SIGTERM and SIGINT do nothing, as MindIO's ``SaveHandler.register`` does.
``FT_FAKE_TTP_INIT=raise`` makes ``tft_init_processor`` raise like a failed processor start.
With ``enable_arf=True`` the controller instead recovers a lost process in place (:mod:`.arf`); with
``enable_zit=True`` too, where no replacement comes, it scales the job in through the ZIT handlers.
"""

import enum
import gc
import os
import queue
import signal
import threading
import time

import torch_npu  # noqa: F401  (the real module imports it at import time)
from fake_record import misbehave, record
from mindio_ttp import arf

handlers = {}
_state = {"step_args": None, "step": 0, "dumping": False, "updating": False, "dumps": {}, "controller": None,
          "arf": False, "arf_controller": False, "zit_controller": False, "rank": 0, "world": 1,
          "stop_clean_before_dump": False}
_lock = threading.Lock()
_updates = threading.Lock()  # an update starting and a dump beginning decide one after the other, never both


class ReportState(enum.Enum):
    RS_NORMAL = "RS_NORMAL"
    RS_UCE = "RS_UCE"
    RS_HCCL_FAILED = "RS_HCCL_FAILED"
    RS_UNKNOWN = "RS_UNKNOWN"
    RS_INIT_FINISH = "RS_INIT_FINISH"


class Action(enum.Enum):
    RETRY = "retry"
    EXIT = "exit"


class RepairType(enum.Enum):
    RT_SEND = "send"
    RT_UCE_HIGHLEVEL = "uce_highlevel"
    RT_UCE_LOWLEVEL = "uce_lowlevel"
    RT_RECV_REPAIR = "recv"
    RT_LOAD_CKPT = "load_ckpt"


class OptimizerType(enum.Enum):
    ATTENTION = 0
    MOE = 1


def tft_init_controller(rank, world_size, enable_local_copy, enable_arf=False, enable_zit=False):
    record("tft_init_controller", rank, world_size, enable_local_copy, enable_arf=enable_arf, enable_zit=enable_zit)
    _state.update(arf_controller=enable_arf, zit_controller=enable_zit, world=world_size)


def tft_start_controller(bind_ip, port, enable_tls=True, tls_info=''):
    record("tft_start_controller", bind_ip, port, enable_tls, tls_info)
    if _state["arf_controller"]:
        arf.start_controller(bind_ip, port, _state["world"], _state["zit_controller"])


def tft_init_processor(rank, world_size, enable_local_copy, enable_tls=True, tls_info='',
                       enable_uce=True, enable_arf=False, enable_zit=False):
    record("tft_init_processor", rank, world_size, enable_local_copy, enable_tls, tls_info,
           enable_uce=enable_uce, enable_arf=enable_arf, enable_zit=enable_zit)
    misbehave("FT_FAKE_TTP_INIT")
    _state.update(arf=enable_arf, rank=rank, world=world_size)


def tft_start_processor(master_ip, port, local_ip=''):
    record("tft_start_processor", master_ip, port, local_ip)
    if _state["arf"]:
        arf.start_processor(master_ip, port, _state["rank"], _state["world"])
    elif os.environ.get("MINDIO_FOR_MINDSPORE") != "1":
        arf.watch_peers(port, _state["rank"], _state["world"], _dump_on_loss)


def tft_destroy_processor():
    record("tft_destroy_processor")
    arf.ended()


def tft_destroy_controller():
    record("tft_destroy_controller")
    arf.stop_controller()


def tft_is_reboot_node():
    return _state["arf"] and arf.is_reboot_node()


def tft_set_optimizer_replica(rank, replica_info):
    record("tft_set_optimizer_replica", rank, replica_info)
    if _state["arf"]:
        arf.report_replicas(replica_info)


def tft_set_dp_group_info(rank, dp_rank_list):
    record("tft_set_dp_group_info", rank, dp_rank_list)
    if _state["arf"]:
        arf.report_data_parallel(dp_rank_list)


def tft_set_step_args(args):
    record("tft_set_step_args", type(args).__name__)
    _state["step_args"] = args


def tft_start_updating_os(backup_step=-1):
    record("tft_start_updating_os", backup_step)
    with _updates:
        if _state["dumping"]:
            raise RuntimeError("tft_start_updating_os: a dump has started, the optimizer must not update")
        _state["updating"] = True


def tft_end_updating_os(step):
    if step < 1:
        raise ValueError(f"tft_end_updating_os: step must be >= 1, got {step}")
    record("tft_end_updating_os", step)
    _state.update(step=step, updating=False)
    if _state["arf"]:
        arf.updated(step)


def tft_pause_train(cur_step):
    record("tft_pause_train", cur_step)


def tft_report_error(state):
    record("tft_report_error", state)


def tft_get_repair_type():
    return "dump"


def set_mindio_export_version(version):
    record("set_mindio_export_version", version)
    _state["stop_clean_before_dump"] = True  # MindIO's TTP_STOP_CLEAN_BEFORE_DUMP=1, set here


def tft_exception_handler(func):
    record("tft_exception_handler", getattr(func, "__name__", repr(func)))

    def guarded(*args, **kwargs):
        _state["step_args"] = args
        while True:
            try:
                result = func(*args, **kwargs)
                if _state["rank"] == 0:  # MindIO's ttp_destroy once training returned
                    tft_destroy_controller()
                tft_destroy_processor()
                return result
            except RuntimeError as exc:
                if not _state["arf"]:
                    _dump_and_raise(exc)
                state = "RS_PREREPAIR_FINISH" if "ARF FINISH" in str(exc) else ReportState.RS_UNKNOWN.value
                record("tft_report_error", state, type(exc).__name__)
            except Exception as exc:
                if _state["arf"]:
                    record("tft_report_error", ReportState.RS_UNKNOWN.value, type(exc).__name__)
                    raise
                _dump_and_raise(exc)
            gc.collect()  # the exception is let go before the wait, as MindIO's wrapper does
            arf.report(state)
            if arf.wait_next() != "retry":
                raise RuntimeError("MindIO ends this process: the recovery failed and the dump was taken")

    return guarded


def _dump_and_raise(exc):
    record("tft_report_error", ReportState.RS_UNKNOWN.value, type(exc).__name__)
    if _state["step"] >= 1 and "save_ckpt" in handlers:
        fake_controller_dying_gasp(_state["step"])
    raise exc


def _register(kind):
    def register(func, ctx=None):
        record(f"tft_register_{kind}_handler", getattr(func, "__name__", repr(func)))
        handlers[kind] = (func, ctx)
        pytorch = os.environ.get("MINDIO_FOR_MINDSPORE") != "1"
        if kind == "save_ckpt" and pytorch and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, signal.SIG_IGN)

    register.__name__ = f"tft_register_{kind}_handler"
    return register


for _kind in ("save_ckpt", "rename", "exit", "stop", "clean", "repair", "rollback", "rebuild_group",
              "stream_sync", "zit_downgrade_rebuild", "zit_upgrade_rebuild", "zit_upgrade_repair",
              "zit_upgrade_rollback"):
    globals()[f"tft_register_{_kind}_handler"] = _register(_kind)


def _dump_on_loss():
    """A peer's process is gone: once this rank's update (if any) has ended, dump its last step."""
    deadline = time.monotonic() + 10
    while True:
        with _updates:  # the step dumped stays the last completed: no update starts once the dump is decided
            if not _state["updating"] or time.monotonic() >= deadline:
                step = _state["step"]
                if step >= 1 and "save_ckpt" in handlers:
                    _state["dumping"] = True
                break
        time.sleep(0.01)
    if step >= 1 and "save_ckpt" in handlers:
        try:
            fake_controller_dying_gasp(step)
        except Exception as exc:  # the controller logs it; the training thread goes on to fail
            record("fake_controller_dump_failed", type(exc).__name__, str(exc))


def _dump(step, save_info):
    """The controller's dump on this rank, once per step: save in a new thread, then rename."""
    if step in _state["dumps"]:
        return _state["dumps"][step]
    errors = _state["dumps"][step] = []
    if _state["stop_clean_before_dump"]:
        _stop_and_clean()

    def run():
        try:
            save, save_ctx = handlers["save_ckpt"]
            record("fake_controller_save", step)
            save(step, save_info or [{"type": 1, "ranks": [0]}], _state["step_args"], save_ctx)
            rename, rename_ctx = handlers["rename"]
            record("fake_controller_rename", step)
            mindspore = os.environ.get("MINDIO_FOR_MINDSPORE") == "1"
            rename(step, rename_ctx if mindspore else _state["step_args"])
        except BaseException as exc:  # reported to the caller, as the controller would log it
            errors.append(exc)

    _state["dumping"] = True
    thread = threading.Thread(target=run, name="mindio-save")
    thread.start()
    thread.join()
    return errors


def _stop_and_clean():
    """MindIO's ``Processor::StopAndCleanBeforeDump``: the stop handler, then the clean handler; a failure is only
    logged, and the dump follows."""
    for kind in ("stop", "clean"):
        if kind not in handlers:
            continue
        func, ctx = handlers[kind]
        try:
            answer = func(_state["step_args"], ctx) if kind == "stop" else func(False, _state["step_args"], ctx)
        except Exception as exc:
            answer = f"{type(exc).__name__}: {exc}"
        record("fake_before_dump", kind, answer if answer is None or isinstance(answer, (int, str)) else repr(answer))


def _serve(requests):
    while True:
        step, save_info, done = requests.get()
        done.put(_dump(step, save_info))


def fake_controller_dying_gasp(step, save_info=None):
    """Ask the controller thread to make this (healthy) rank dump ``step``: save, then rename."""
    with _lock:
        if _state["controller"] is None:
            _state["controller"] = queue.Queue()
            threading.Thread(target=_serve, args=(_state["controller"],), name="mindio-controller",
                             daemon=True).start()
    done = queue.Queue()
    _state["controller"].put((step, save_info, done))
    errors = done.get()
    if errors:
        raise errors[0]
