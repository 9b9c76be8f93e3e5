"""The busy experts of a stats page copy in one pass (moescope/_page_busy.c)."""

def busy(buf: bytes | bytearray | memoryview, layers: int, experts: int, floor: float, written: int,
         now_bucket: int, /) -> tuple[dict[tuple[int, int], float], list[tuple[int, int]], bool]: ...

def read_busy(fd: int, buf: bytearray, layers: int, experts: int, floor: float, now_bucket: int, held: bool,
              version: int, updates: int, /) -> (
        None | tuple[int, int, dict[tuple[int, int], float], list[tuple[int, int]], bool] | tuple[int, ...]): ...
