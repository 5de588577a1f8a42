"""`LateFlag`: read a device bool one step late, so the GPU never waits for the host.

Every decoding loop ends when a device flag says so ("no row unfinished"). Reading it at once
would stall the host on the GPU each step; instead the host starts the flag's copy to pinned
memory, queues the next step, and only then waits for the copy. A step queued after the last
one is dropped by the caller (its K/V lands in the call's own blocks, freed at release).
On the CPU (or where a caller needs each step's values at once, e.g. a streamer) the flag is
read first and the next step queued only when the loop goes on.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

T = TypeVar("T")


class LateFlag:
    """One loop's late reads of its stop flag. device: where the flag lives; defer: read late
    (on CUDA only)."""

    def __init__(self, device: torch.device, defer: bool = True) -> None:
        self.late = torch.device(device).type == "cuda" and defer
        if self.late:
            self._host = torch.zeros((), dtype=torch.bool, pin_memory=True)
            self._copied = torch.cuda.Event()

    def queue_unless(self, flag: torch.Tensor, stop_on: bool, queue: Callable[[], T]) -> tuple[bool, Optional[T]]:
        """(stop, result): stop is whether the device bool `flag` (0-dim) equals `stop_on` before
        `queue` runs; result is what `queue()` returned, None where it did not run (read at once
        and stopping)."""
        if not self.late:
            stop = bool(flag) == stop_on
            return stop, None if stop else queue()
        self._host.copy_(flag, non_blocking=True)
        self._copied.record()
        result = queue()  # queued before we wait: dropped by the caller if we stop
        self._copied.synchronize()
        return bool(self._host) == stop_on, result
