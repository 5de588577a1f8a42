"""`decode.late_flag.LateFlag`: the one "read the stop flag a step late" mechanism of every loop."""

import pytest
import torch

from hf_paged_t5.decode.late_flag import LateFlag

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stop_on", [True, False])
def test_stops_on_the_value_and_queues_as_documented(device, stop_on):
    late = LateFlag(torch.device(device))
    queued = []
    for value in (not stop_on, stop_on):
        flag = torch.tensor(value, device=device)
        stop, result = late.queue_unless(flag, stop_on, lambda: queued.append(value) or len(queued))
        assert stop == (value == stop_on)
        if not stop:
            assert result == len(queued)
    # read at once on the CPU: the step after the last is not queued; late on CUDA: it is (and dropped)
    assert queued == ([not stop_on, stop_on] if late.late else [not stop_on])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reads_the_value_from_before_the_queued_step():
    late = LateFlag(torch.device("cuda"))
    flag = torch.tensor(False, device="cuda")
    stop, _ = late.queue_unless(flag, True, lambda: flag.fill_(True))  # the step changes the flag
    assert not stop and bool(flag)


def test_no_late_read_when_the_caller_needs_each_step():
    assert not LateFlag(torch.device("cpu")).late
    if torch.cuda.is_available():
        assert not LateFlag(torch.device("cuda"), defer=False).late


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_side_stream_copy_sees_the_work_queued_before_it():
    """With a side stream the copy waits for what the caller's stream queued before the read; what
    the queued step writes it may see or not (the flag must read right either way)."""
    late = LateFlag(torch.device("cuda"), dtype=torch.int64, side=torch.cuda.Stream())
    flag = torch.tensor(-1, device="cuda")
    torch.cuda._sleep(10_000_000)  # the caller's stream busy: the copy must wait, not read early
    flag.fill_(3)
    value, result = late.read_late(flag, lambda v: v >= 0, lambda: (flag.fill_(7), "queued")[1])
    assert value in (3, 7) and result == "queued"
    value, _ = late.read_late(flag, lambda v: v >= 0, lambda: None)
    assert value == 7
