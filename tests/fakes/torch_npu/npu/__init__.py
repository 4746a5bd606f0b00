from torch_npu.npu import mstx  # noqa: F401


class Stream:
    def __repr__(self) -> str:
        return "<fake npu stream 0>"


_STREAM = Stream()


def current_stream() -> Stream:
    return _STREAM


def is_available() -> bool:
    return True
