"""Time a kernel on part of the GPU's SMs: a card with more memory bandwidth per SM (an H200 estimated on an H100).

An H100 SXM (3.02 TB/s measured copy rate, 132 SMs) running on 96 of its SMs gives each of them the bytes per cycle an
H200 (4.18 TB/s, 132 SMs, the same 1,980 MHz clock) gives each of its SMs. A kernel's time there, times 96 / 132,
estimates its H200 time, whether it is bound by its compute (per SM, the same work per tile) or by memory (the same
bytes at the H100's whole rate, 3.02 / 4.18 = 95.4 / 132). Issue 12's targets are H200 times, and the lent machine has
been an H100 for fifteen sessions. What the estimate leaves out: the H200's other memory latency and its clock under
load. It also assumes that 96 SMs still draw the card's whole copy rate: `python benchmarks/held_sms.py 132 96`
measures that first.

The SMs are partitioned by a CUDA green context (CUDA 12.4+, `torch.cuda.green_contexts`): kernels launched on its
stream run on its SMs only, and the rest of the card stays idle. (Holding the other SMs with a co-resident kernel of
sleeping CTAs was tried first and does not work: the kernels on the free SMs ran 1.6-14x slower, docs/performance.md,
thirtieth session.) The green path has not yet run on a GPU.

    python benchmarks/held_sms.py 132 96    # the device-to-device copy rate on each number of SMs
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import sys

_CU_DEV_RESOURCE_TYPE_SM = 1
_DEV_RESOURCE_BYTES = 1024  # a CUdevResource is 144 bytes in CUDA 12.4; room for any later growth
_SM_COUNT_OFFSET = 96  # CUdevResource.sm.smCount: after the type (4 bytes) and 92 bytes of internal padding


def _current_context_sms() -> int:
    """The SMs of the current CUDA context (cuCtxGetDevResource): a green context's partition."""
    driver = ctypes.CDLL("libcuda.so.1")
    current, resource = ctypes.c_void_p(), ctypes.create_string_buffer(_DEV_RESOURCE_BYTES)
    for name, args in (("cuCtxGetCurrent", (ctypes.byref(current),)),
                       ("cuCtxGetDevResource", (current, resource, _CU_DEV_RESOURCE_TYPE_SM))):
        rc = getattr(driver, name)(*args)
        if rc != 0:
            raise RuntimeError(f"held_sms: {name} returned CUDA driver error {rc}")
    return ctypes.c_uint.from_buffer(resource, _SM_COUNT_OFFSET).value


@contextlib.contextmanager
def green_stream(sms: int):
    """A stream whose kernels run on `sms` SMs only: a green context, current inside the block. Yields (stream, the
    SMs the driver gave it: a partition may be rounded up to its granularity)."""
    import torch
    from torch.cuda.green_contexts import GreenContext

    context = GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
    context.set_context()
    try:
        yield context.Stream(), _current_context_sms()
    finally:
        context.pop_context()


def time_on_stream(call, stream, warmup: int = 10, reps: int = 40) -> list[float]:
    """Milliseconds of each of `reps` calls of `call` on `stream`, after `warmup` calls, timed by CUDA events."""
    import torch

    with torch.cuda.stream(stream):
        for _ in range(warmup):
            call()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for start, end in zip(starts, ends):
            start.record()
            call()
            end.record()
    ends[-1].synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def median_ms_on_sms(call, sms: int, device_sms: int) -> float:
    """Median milliseconds of `call` (a launch sized for `sms` SMs) on `sms` of the device's `device_sms` SMs."""
    import torch

    if not 0 < sms <= device_sms:
        raise ValueError(f"sms={sms}: expected 1 .. {device_sms} (this device's SMs)")
    if sms == device_sms:
        return statistics.median(time_on_stream(call, torch.cuda.Stream()))
    with green_stream(sms) as (stream, given):
        if given != sms:  # rounded to the partition granularity, or a driver whose CUdevResource reads otherwise
            raise RuntimeError(f"held_sms: a green context of {sms} SMs has {given}: pick a count the partition "
                               f"granularity allows (a multiple of 8 on Hopper)")
        return statistics.median(time_on_stream(call, stream))


def copy_rate_tbps(time_ms, kernel: bool = False) -> float:
    """Read + write bytes per second, in TB/s, of a 1 GiB device-to-device copy timed by `time_ms` (a function of the
    call to time, returning its milliseconds): bench_forward's floor rate, and this module's check on N SMs. `kernel`:
    copy by an elementwise kernel (x 1.0 in fp32) instead of `Tensor.copy_` (a driver memcpy, which a green context's
    partition may not confine)."""
    import torch

    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms((lambda: torch.mul(src, 1.0, out=dst)) if kernel else (lambda: dst.copy_(src)))
    return 2 * (1 << 30) / (ms * 1e-3) / 1e12


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sms", type=int, nargs="+", help="numbers of SMs to measure the copy rate on")
    args = parser.parse_args(argv)
    import torch

    device_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: {device_sms} SMs")
    for n in args.sms:
        rates = [copy_rate_tbps(lambda call: median_ms_on_sms(call, n, device_sms), kernel) for kernel in (False, True)]
        print(f"copy rate on {n} SMs: {rates[0]:.3f} TB/s by copy_, {rates[1]:.3f} TB/s by a kernel", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
