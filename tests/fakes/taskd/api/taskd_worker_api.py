"""Fake of MindCluster TaskD's worker API: same signatures, bool returns, records calls."""

from fake_record import misbehave, record

_state = {"initialized": False}


def init_taskd_worker(rank_id: int, upper_limit_of_disk_in_mb: int = 5000, framework: str = "pt") -> bool:
    record("init_taskd_worker", rank_id, upper_limit_of_disk_in_mb, framework)
    outcome = misbehave("FT_FAKE_TASKD_INIT")
    if outcome is False:
        return False
    _state["initialized"] = True
    return True


def start_taskd_worker() -> bool:
    record("start_taskd_worker")
    if not _state["initialized"]:
        return False  # the real one refuses to start an uninitialized worker
    outcome = misbehave("FT_FAKE_TASKD_START")
    return outcome is not False


def destroy_taskd_worker() -> bool:
    record("destroy_taskd_worker")
    _state["initialized"] = False
    return True
