from torch_npu.npu import mstx  # noqa: F401


class Stream:
    def __repr__(self) -> str:
        return "<fake npu stream 0>"


_STREAM = Stream()


def current_stream() -> Stream:
    return _STREAM


def is_available() -> bool:
    return True


def current_device() -> int:
    return 0


def stop_device(device_id):
    """MindIO's stop: the device's pending work fails (nothing runs on this fake device: only recorded)."""
    from fake_record import record

    record("torch_npu.npu.stop_device", device_id)


def restart_device(device_id, rebuild_all_resources=False):
    from fake_record import record

    record("torch_npu.npu.restart_device", device_id, rebuild_all_resources=rebuild_all_resources)
