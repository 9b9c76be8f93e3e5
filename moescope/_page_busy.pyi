"""The busy experts of a stats page copy in one pass (moescope/_page_busy.c)."""

def busy(buf: bytes | bytearray | memoryview, layers: int, experts: int, floor: float, written: int,
         now_bucket: int, /) -> tuple[dict[tuple[int, int], float], list[tuple[int, int]], bool]: ...
