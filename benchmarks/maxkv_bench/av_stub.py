"""A stand-in for PyAV on the GPU study's machine: MAX imports ``av`` for video
inputs at start; the study feeds text only, so any use raises."""


class _Absent:
    def __getattr__(self, name: str) -> "_Absent":
        return _Absent()

    def __call__(self, *args: object, **kwargs: object) -> "_Absent":
        raise RuntimeError("PyAV is not installed on this machine")


def __getattr__(name: str) -> _Absent:
    return _Absent()
