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
(save handler, then rename) and their training threads raise.

With ZIT on (``enable_zit=True``, MindCluster's ``elastic-training``), the ranks lost within a second are one fault
(a node's), and where no replacement comes within ``MINDIO_WAIT_MINDX_TIME`` seconds (standing in for ClusterD's
``wait-reschedule-timeout`` and its ``changeStrategy downgrade``), the controller scales in as MindIO's
``DowngradeRepairCallback`` does: it isolates the ranks at the lost ranks' indices in every data-parallel group
(``tft_set_dp_group_info``), refuses where rank 0 is among them or a lost rank's optimizer state has no replica
outside them, tells the healthy isolated ranks to end (ClusterD's ``faultNodesExit``), calls
``zit_downgrade_rebuild(new_dp_ranks, new_world_ranks, train_args, params)`` on every rank that goes on, and lets
their training threads retry (no rollback: MindIO has none after a downgrade). A new fault after it is met by the
dump only (``ZitHandleNewFault``). Each action is recorded as
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
SETTLE = 1.0  # seconds in which ranks lost are one fault (a node's processes end one after the other)
DOWNGRADE_PARAMS = '{"scale-in-strategy": "DP"}'  # what ClusterD's changeStrategy carries


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


def wait_for_replacement():
    """ZIT on: how long the controller waits for a replacement before it scales in."""
    return float(os.environ.get("MINDIO_WAIT_MINDX_TIME", "30"))


def _store(port):
    import tempfile
    from datetime import timedelta

    from torch.distributed import FileStore

    record_file = os.environ.get("FT_FAKE_RECORD")  # beside the calls' record (a test's own directory), else /tmp
    folder = os.path.dirname(os.path.abspath(record_file)) if record_file else tempfile.gettempdir()
    # one launcher's channel; FT_FAKE_MINDIO_CHANNEL names one shared by the launchers of several nodes
    channel = os.environ.get("FT_FAKE_MINDIO_CHANNEL") or str(os.getppid())
    store = FileStore(os.path.join(folder, f"fake_mindio_{channel}_{port}.store"), -1)
    store.set_timeout(timedelta(seconds=limit()))
    return store


def start_controller(bind_ip, port, world_size, zit=False):
    """Rank 0's process: host the channel, then watch the processors."""
    store = _store(port)
    _arf["controlling"].set()
    _start("controller", _control, store, world_size, zit)
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
        elif kind == "zit_downgrade_rebuild":  # MindIO's execute_zit_downgrade_rebuild: no ctx
            new_dp_ranks, new_world_ranks, params = payload
            answer = func(new_dp_ranks, new_world_ranks, args, params) or RET_OK
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


def _control(store, world, zit):
    counts, gone = {}, set()  # gone: the ranks a downgrade left out
    while _arf["controlling"].is_set():
        time.sleep(POLL)
        lost = _lost(store, world, gone)
        if lost and zit:
            time.sleep(SETTLE)
            lost = _lost(store, world, gone)
        if lost and not _recover(store, world, lost if zit else lost[:1], counts, zit, gone):
            return  # the survivors dumped and end: nothing left to control


def _lost(store, world, gone):
    return [rank for rank, pid in _watched(store, world).items() if not _alive(pid) and rank not in gone]


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


def _recover(store, world, lost_ranks, counts, zit, gone):
    """One fault: ``lost_ranks`` (one without ZIT); ``gone``: the ranks a downgrade left out before."""
    record("fake_controller_fault", *lost_ranks)
    lost = lost_ranks[0]  # the rank a replacement repairs
    survivors = [rank for rank in range(world) if rank not in lost_ranks and rank not in gone]
    for rank in lost_ranks:
        counts.pop(rank, None)
    steps = {rank: int(store.get(f"step/{rank}")) if store.check([f"step/{rank}"]) else 0 for rank in survivors}
    step = max(steps.values())
    ok = (not gone  # after a downgrade only the dump (ZitHandleNewFault)
          and _act(store, counts, survivors, "stop", lambda rank: None)
          and _act(store, counts, survivors, "clean", lambda rank: None))
    if ok and zit and not _replacement(store, lost, wait_for_replacement()):
        if _downgrade(store, world, lost_ranks, survivors, counts, gone):
            return True
        ok = False
    ok = ok and (zit or _replacement(store, lost))
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


def _downgrade(store, world, lost, survivors, counts, gone):
    """MindIO's DowngradeRepairCallback: isolate the lost ranks' model replicas; the others go on."""
    groups = [eval(store.get(f"dp/{rank}")) for rank in range(world) if store.check([f"dp/{rank}"])]
    places = {group.index(rank) for group in groups for rank in lost if rank in group}
    isolated = {*lost, *(group[place] for group in groups for place in places if place < len(group))}
    everyone = sorted({*survivors, *lost})
    unserved = [rank for rank in sorted(isolated) if not set(_replicas(store, everyone, rank)) - isolated]
    why = ("rank 0 is among the isolated ranks" if 0 in isolated else
           f"no complete duplication of ranks {unserved}' optimizer data outside them" if unserved else "")
    if why:
        record("fake_controller_downgrade_refused", sorted(isolated), why)
        return False
    going = sorted(set(survivors) - isolated)
    new_dp = {rank: [peer for peer in next(group for group in groups if rank in group) if peer not in isolated]
              for rank in going}
    if not _act(store, counts, going, "zit_downgrade_rebuild", lambda rank: (new_dp[rank], going, DOWNGRADE_PARAMS)):
        return False
    leaving = sorted(isolated & set(survivors))
    if leaving:  # ClusterD's faultNodesExit: their agents end them
        record("fake_controller_fault_nodes_exit", leaving)
        _go(store, leaving, "exit")
    gone.update(isolated)
    _go(store, going, "retry")
    return True


def report_data_parallel(ranks):
    """The processor's data-parallel group (``tft_set_dp_group_info``), for the controller's isolation."""
    _arf["store"].set(f"dp/{_arf['rank']}", repr(list(ranks)))


def _replacement(store, lost, wait=None):
    """The lost rank's replacement has started and reported ``ARF FINISH`` within ``wait`` s (the limit)."""
    deadline = time.monotonic() + (limit() if wait is None else wait)
    while time.monotonic() < deadline:
        life = store.add(f"starts/{lost}", 0)
        if life > 1 and store.check([f"reported/{lost}/{life}"]):
            finished = store.get(f"reported/{lost}/{life}").decode() == "RS_PREREPAIR_FINISH"
            record("fake_controller_replacement", lost, finished)
            return finished
        time.sleep(POLL)
    record("fake_controller_replacement", lost, "timeout")
    return False
