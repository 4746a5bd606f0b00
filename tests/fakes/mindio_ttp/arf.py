"""The fake MindIO's process-level online recovery (ARF, MindCluster's ``recover`` strategy), on when
``tft_init_controller`` / ``tft_init_processor`` get ``enable_arf=True``.

As in MindIO, the controller runs in rank 0's process (``tft_start_controller``) and every processor
connects to it (``tft_start_processor``); here the channel is a ``FileStore`` named after the launcher's
pid and the controller's port, beside ``FT_FAKE_RECORD`` (no socket of its own: one host, and nothing a
process group could mistake for its connections). The controller watches every registered processor's
pid until the processor ends (``tft_destroy_processor``). When one dies it drives the handlers in MindIO's
order, each in the processor's own thread while the training thread waits inside ``tft_exception_handler``:

1. ``stop(args, ctx)`` on every survivor, then it waits for that rank's training thread to report
   its failure (MindIO's stop waits for the same);
2. ``clean(uce_error, args, ctx)`` on every survivor (it returns MindIO's code, 0 = done);
3. it waits for the replacement: a new processor of the lost rank (``tft_is_reboot_node()`` True there)
   whose train raised ``RuntimeError("ARF FINISH")``;
4. ``rebuild_group(fault_ranks, args, ctx)`` on every rank, the replacement included;
5. ``repair(step, need_rebuild, error_ranks, repair_info, args, ctx)`` on each source (``RT_SEND``) and
   on each rank that lacks the state (``RT_RECV_REPAIR``): the step is the newest one the survivors
   reported through ``tft_end_updating_os``, each receiving rank's own source: the lowest survivor at that
   step holding the same optimizer state (the replica layouts of ``tft_set_optimizer_replica``: under
   pipeline, tensor or expert parallelism the rank at the same place of another data-parallel replica);
6. ``rollback(step, args, ctx)`` on every rank; then every training thread calls train again.

A handler that raises (or a clean that returns non-zero), or a replacement that does not come within
``TTP_NORMAL_ACTION_TIME_LIMIT`` seconds (180), ends the recovery: the survivors dump the newest step
(save handler, then rename) and their training threads raise. Each action is recorded as
``fake_controller_<action>`` with the rank, its arguments and the answer.

``tft_destroy_processor`` and ``tft_destroy_controller`` end their threads and wait for them, as MindIO's do: a
daemon thread still polling the store at the interpreter's finalization is ended inside the store's C++ call
(the GIL taken back there) and aborts the process ("terminate called without an active exception").
"""

import os
import sys
import threading
import time
import traceback

from fake_record import record

RET_OK, RET_ERROR = 0, 1
POLL = 0.02
ORDER = ("stop", "clean", "rebuild_group", "repair", "rollback")
_arf = {"store": None, "rank": None, "world": 0, "reboot": False, "reported": threading.Event(), "wait": 0,
        "controlling": threading.Event(), "serving": threading.Event(), "threads": {}}
JOIN = 10.0  # seconds a destroy call waits for its thread (one poll, unless an action is under way)


def _start(role, target, *args):
    """The fake's ``role`` thread ("controller" or "processor"), ended by :func:`_end`."""
    _arf["threads"][role] = thread = threading.Thread(target=target, args=args, name=f"mindio-{role}", daemon=True)
    thread.start()


def _end(role, running):
    """Stop the ``role`` thread (its ``running`` event cleared) and wait for it."""
    running.clear()
    thread = _arf["threads"].pop(role, None)
    if thread is not None and thread is not threading.current_thread():
        thread.join(JOIN)


def limit():
    return float(os.environ.get("TTP_NORMAL_ACTION_TIME_LIMIT", "180"))


def _store(port):
    import tempfile
    from datetime import timedelta

    from torch.distributed import FileStore

    record_file = os.environ.get("FT_FAKE_RECORD")  # beside the calls' record (a test's own directory), else /tmp
    folder = os.path.dirname(os.path.abspath(record_file)) if record_file else tempfile.gettempdir()
    store = FileStore(os.path.join(folder, f"fake_mindio_{os.getppid()}_{port}.store"), -1)
    store.set_timeout(timedelta(seconds=limit()))
    return store


def start_controller(bind_ip, port, world_size):
    """Rank 0's process: host the channel, then watch the processors."""
    store = _store(port)
    _arf["controlling"].set()
    _start("controller", _control, store, world_size)
    _arf["controller_store"] = store  # kept alive with the process


def stop_controller():
    _end("controller", _arf["controlling"])


def start_processor(master_ip, port, rank, world_size):
    """Register this process as ``rank``'s processor; serve the controller's actions in a thread."""
    store = _store(port)
    _arf.update(store=store, rank=rank, world=world_size)
    life = store.add(f"starts/{rank}", 1)
    _arf["reboot"] = life > 1
    store.set(f"pid/{rank}", str(os.getpid()))
    _arf["serving"].set()
    _start("processor", _serve, store, rank, life)


def watch_peers(port, rank, world_size, on_loss):
    """Dump mode: register this process, then call ``on_loss`` (in a thread) once another rank's
    registered process is gone."""
    store = _store(port)
    _arf.update(store=store, rank=rank, world=world_size)
    store.set(f"pid/{rank}", str(os.getpid()))
    _arf["serving"].set()

    def watch():
        while _arf["serving"].is_set():
            time.sleep(0.1)
            peers = _watched(store, world_size)
            if any(not _alive(pid) for pid in peers.values()):
                on_loss()
                return

    _start("processor", watch)


def ended():
    """This process ended its processor (training returned): its exit is no loss."""
    if _arf["store"] is not None:
        _arf["store"].set(f"ended/{_arf['rank']}", str(os.getpid()))
    _end("processor", _arf["serving"])


def _watched(store, world):
    """Each rank's registered process, but one that ended its processor."""
    pids = {}
    for rank in range(world):
        if store.check([f"pid/{rank}"]):
            pid = store.get(f"pid/{rank}")
            if not (store.check([f"ended/{rank}"]) and store.get(f"ended/{rank}") == pid):
                pids[rank] = int(pid)
    return pids


def is_reboot_node():
    return _arf["reboot"]


def updated(step):
    if _arf["store"] is not None:
        _arf["store"].set(f"step/{_arf['rank']}", str(step))


def report(state):
    """The training thread failed (``state`` as MindIO classifies it); the controller learns it."""
    store, rank = _arf["store"], _arf["rank"]
    store.set(f"reported/{rank}/{store.add(f'starts/{rank}', 0)}", state)
    _arf["reported"].set()


def wait_next():
    """The training thread, its exception let go: wait for the controller's word (retry or exit)."""
    store, rank = _arf["store"], _arf["rank"]
    _arf["wait"] += 1
    name = f"go/{rank}/{store.add(f'starts/{rank}', 0)}/{_arf['wait']}"
    deadline = time.monotonic() + 2 * limit() + 30
    while not store.check([name]):
        if time.monotonic() > deadline:
            return "exit"
        time.sleep(POLL)
    _arf["reported"].clear()
    return store.get(name).decode()


# -- the processor's side --------------------------------------------------------------------------
def _serve(store, rank, life):
    """Actions are numbered per process of the rank (a replacement serves none sent to the process it replaces)."""
    from mindio_ttp import framework_ttp as api

    served = 0
    while _arf["serving"].is_set():
        name = f"action/{rank}/{life}/{served + 1}"
        if not store.check([name]):
            time.sleep(POLL)
            continue
        served += 1
        kind, _, payload = store.get(name).decode().partition(" ")
        store.set(f"result/{rank}/{life}/{served}", str(_run(api, kind, eval(payload) if payload else None)))


def _run(api, kind, payload):
    """One action on this rank: MindIO's own wrapping of the handler (an exception answers RET_ERROR)."""
    args = api._state["step_args"]
    try:
        if kind == "dump":
            errors = api._dump(payload, None)
            return RET_ERROR if errors else RET_OK
        func, ctx = api.handlers[kind]
        if kind == "stop":
            func(args, ctx)
            if not _arf["reported"].wait(limit()):  # the training thread never reported its failure: where is it?
                main = sys._current_frames().get(threading.main_thread().ident)
                record("fake_processor_stop_failed", "the training thread did not fail",
                       "".join(traceback.format_stack(main)) if main else "no main thread")
                return RET_ERROR
            answer = RET_OK
        elif kind == "clean":
            answer = func(False, args, ctx)
        elif kind == "rebuild_group":
            answer = func(payload, args, ctx) or RET_OK
        elif kind == "repair":
            step, need_rebuild, error_ranks, repair_info = payload
            answer = func(step, need_rebuild, error_ranks, repair_info, args, ctx) or RET_OK
        else:
            answer = func(payload, args, ctx) or RET_OK
    except Exception as exc:  # MindIO logs it and answers the failure code
        record(f"fake_processor_{kind}_failed", type(exc).__name__, str(exc))
        return RET_ERROR
    return answer


# -- the controller --------------------------------------------------------------------------------
def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _control(store, world):
    counts = {}
    while _arf["controlling"].is_set():
        time.sleep(POLL)
        lost = [rank for rank, pid in _watched(store, world).items() if not _alive(pid)]
        if lost and not _recover(store, world, lost[0], counts):
            return  # the survivors dumped and end: nothing left to control


def _act(store, counts, ranks, kind, payloads):
    """Send ``kind`` to ``ranks`` at once (payload per rank), wait for every answer; True when all are 0."""
    sent = {}
    for rank in ranks:
        counts[rank] = counts.get(rank, 0) + 1
        payload = payloads(rank)
        number = f"{store.add(f'starts/{rank}', 0)}/{counts[rank]}"
        store.set(f"action/{rank}/{number}", f"{kind} {payload!r}" if payload is not None else kind)
        sent[rank] = number
    answers = {}
    deadline = time.monotonic() + limit() + 5
    while len(answers) < len(sent) and time.monotonic() < deadline:
        for rank, number in sent.items():
            if rank not in answers and store.check([f"result/{rank}/{number}"]):
                answers[rank] = int(store.get(f"result/{rank}/{number}"))
        time.sleep(POLL)
    for rank in ranks:
        record(f"fake_controller_{kind}", rank, repr(payloads(rank)), answers.get(rank, "timeout"))
    return all(answers.get(rank) == RET_OK for rank in ranks)


def _go(store, ranks, word):
    for rank in ranks:
        life = store.add(f"starts/{rank}", 0)
        waits = store.add(f"waits/{rank}/{life}", 1)
        store.set(f"go/{rank}/{life}/{waits}", word)


def _recover(store, world, lost, counts):
    record("fake_controller_fault", lost)
    survivors = [rank for rank in range(world) if rank != lost]
    counts.pop(lost, None)
    steps = {rank: int(store.get(f"step/{rank}")) if store.check([f"step/{rank}"]) else 0 for rank in survivors}
    step = max(steps.values())
    ok = (_act(store, counts, survivors, "stop", lambda rank: None)
          and _act(store, counts, survivors, "clean", lambda rank: None)
          and _replacement(store, lost))
    everyone = sorted([*survivors, lost])
    if ok:
        receivers = [lost, *(rank for rank in survivors if steps[rank] < step)]
        sources = {rank: min((peer for peer in _replicas(store, everyone, rank) if steps.get(peer) == step),
                             default=None) for rank in receivers}
        ok = None not in sources.values()
    if ok:
        info = {}
        for source in sorted(set(sources.values())):
            dst = [rank for rank in receivers if sources[rank] == source]
            info[source] = (step, False, receivers, {"type": [0] * len(dst), "repair_type": "send",
                                                     "src": [source] * len(dst), "dst": dst,
                                                     "rank_list": sorted([source, *dst])})
            info.update({rank: (step, False, receivers, {"type": [0], "repair_type": "recv", "src": [source],
                                                         "dst": [rank], "rank_list": sorted([source, *dst])})
                         for rank in dst})
        ok = (_act(store, counts, everyone, "rebuild_group", lambda rank: [lost])
              and _act(store, counts, sorted(info), "repair", info.get)
              and _act(store, counts, everyone, "rollback", lambda rank: step))
    if ok:
        _go(store, everyone, "retry")
        return True
    record("fake_controller_dump", step)
    _act(store, counts, survivors, "dump", lambda rank: step)
    _go(store, survivors, "exit")
    if store.check([f"reported/{lost}/2"]):
        _go(store, [lost], "exit")
    return False


def _replicas(store, everyone, rank):
    """The ranks holding the same optimizer state as ``rank``, from the replica layouts the processors reported
    (``tft_set_optimizer_replica``, each rank its own data-parallel group: with tensor, pipeline or expert
    parallelism the ranks at the same place in the other groups). ``rank_list`` is ``replica_cnt`` copies of the
    state one after the other, so the ranks at the same place of each copy hold the same shard. The lowest rank's
    report naming ``rank`` counts (the lost rank's own report stays); every rank when none names it."""
    for peer in everyone:
        reported = store.get(f"replicas/{peer}") if store.check([f"replicas/{peer}"]) else None
        for entry in eval(reported) if reported else ():
            ranks, copies = entry["rank_list"], entry["replica_cnt"]
            if rank in ranks:
                size = len(ranks) // copies
                return [peer for index, peer in enumerate(ranks) if index % size == ranks.index(rank) % size]
    return list(everyone)


def report_replicas(replica_info):
    """The processor's replica layout, for the controller's choice of a repair source."""
    _arf["store"].set(f"replicas/{_arf['rank']}", repr(replica_info))


def _replacement(store, lost):
    """The lost rank's replacement has started and reported ``ARF FINISH`` within the limit."""
    deadline = time.monotonic() + limit()
    while time.monotonic() < deadline:
        life = store.add(f"starts/{lost}", 0)
        if life > 1 and store.check([f"reported/{lost}/{life}"]):
            finished = store.get(f"reported/{lost}/{life}").decode() == "RS_PREREPAIR_FINISH"
            record("fake_controller_replacement", lost, finished)
            return finished
        time.sleep(POLL)
    record("fake_controller_replacement", lost, "timeout")
    return False
