"""`LateFlag`: read a device bool one step late, so the GPU never waits for the host.

Every decoding loop ends when a device flag says so ("no row unfinished"). Reading it at once
would stall the host on the GPU each step; instead the host starts the flag's copy to pinned
memory, queues the next step, and only then waits for the copy. A step queued after the last
one is dropped by the caller (its K/V lands in the call's own blocks, freed at release).
On the CPU (or where a caller needs each step's values at once, e.g. a streamer) the flag is
read first and the next step queued only when the loop goes on.

With a `side` stream the copy runs there, after the work queued so far, so the caller's stream
goes from one step straight to the next (a copy between them kept the GPU idle ~20 us a step on
an H200). The copy may then also see what the step queued after it wrote: only for a flag whose
every later value still reads right (the greedy loop's "finished at column c", set once).
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

T = TypeVar("T")


class LateFlag:
    """One loop's late reads of its stop flag. device: where the flag lives; defer: read late
    (on CUDA only)."""

    def __init__(self, device: torch.device, defer: bool = True, dtype: torch.dtype = torch.bool,
                 side: Optional[torch.cuda.Stream] = None) -> None:
        self.late = torch.device(device).type == "cuda" and defer
        self._side = side
        if self.late:
            self._host = torch.zeros((), dtype=dtype, pin_memory=True)
            self._copied = torch.cuda.Event()
            self._ready = torch.cuda.Event()

    def read_late(self, flag: torch.Tensor, stops: Callable[[object], bool],
                  queue: Callable[[], T]) -> tuple[object, Optional[T]]:
        """(value, result): value is the device scalar `flag` as it was before `queue` ran (or, with
        a side stream, possibly after); result is what `queue()` returned, None where it did not
        run (read at once, and `stops(value)`)."""
        if not self.late:
            value = flag.item()
            return value, None if stops(value) else queue()
        if self._side is None:
            self._host.copy_(flag, non_blocking=True)
            self._copied.record()
        else:
            self._ready.record()
            self._side.wait_event(self._ready)
            with torch.cuda.stream(self._side):
                self._host.copy_(flag, non_blocking=True)
                self._copied.record(self._side)
        result = queue()  # queued before we wait: dropped by the caller if we stop
        self._copied.synchronize()
        return self._host.item(), result

    def queue_unless(self, flag: torch.Tensor, stop_on: bool, queue: Callable[[], T]) -> tuple[bool, Optional[T]]:
        """(stop, result): stop is whether the device bool `flag` (0-dim) equals `stop_on` before
        `queue` runs; result is what `queue()` returned, None where it did not run (read at once
        and stopping)."""
        value, result = self.read_late(flag, lambda v: bool(v) == stop_on, queue)
        return bool(value) == stop_on, result
