"""Time a kernel on part of the GPU's SMs while the rest are held idle: a card with more memory bandwidth per SM.

An H100 SXM (3.02 TB/s measured copy rate, 132 SMs) running on 95 of its SMs gives each of them the bytes per cycle
an H200 (4.18 TB/s, 132 SMs, the same 1,980 MHz clock) gives each of its SMs. A kernel's time there, times 95 / 132,
estimates its H200 time, whether it is bound by its compute (per SM, the same work per tile) or by memory (the same
bytes at the H100's whole rate, 3.02 / 4.18 = 95.4 / 132). Issue 12's targets are H200 times, and the lent machine has
been an H100 for fifteen sessions. What the estimate leaves out: the H200's other memory latency and its larger HBM.

How the SMs are held: `hold_sms` launches, on its own stream, one CTA per held SM of a kernel that takes more than half
of an SM's shared memory (so no two share an SM, and no fused CTA of 116 KB fits beside one) and sleeps until
released. Each records its %smid in pinned host memory; the holder waits until all have started (so they are
resident before the timed kernel is launched) and checks that they sit on distinct SMs; a holder still unreleased
after HOLD_LIMIT_S ends and says so (the block then raises: something in it waited for the whole device). The kernel is PTX, loaded
through the CUDA driver with ctypes (no compiler on the GPU machine): `tests/test_held_sms.py` assembles it with ptxas
on the CPU machine.

    with hold_sms(132 - 95):
        times = time_on_stream(call)      # the timed kernel, persistent over 95 x CTAs per SM

    python benchmarks/held_sms.py 132 95 110    # the device-to-device copy rate on each number of SMs
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import sys
import time

HOLD_PTX = r"""
.version 8.0
.target sm_90
.address_size 64

.extern .shared .align 16 .b8 held_shared[];

.visible .entry hold_sm(.param .u64 release, .param .u64 smids, .param .u64 limit_ns, .param .u64 ended)
{
    .reg .pred  %p<3>;
    .reg .b32   %r<6>;
    .reg .b64   %rd<11>;

    mov.u32         %r1, %tid.x;
    setp.ne.u32     %p1, %r1, 0;
    @%p1 bra        DONE;
    ld.param.u64    %rd1, [release];
    ld.param.u64    %rd2, [smids];
    ld.param.u64    %rd3, [limit_ns];
    mov.u32         %r2, %smid;
    mov.u32         %r3, %ctaid.x;
    mul.wide.u32    %rd4, %r3, 4;
    add.u64         %rd4, %rd2, %rd4;
    st.relaxed.sys.global.u32 [%rd4], %r2;
    mov.u64         %rd5, %globaltimer;
WAIT:
    nanosleep.u32   2000;
    ld.relaxed.sys.global.u32 %r4, [%rd1];
    setp.ne.u32     %p2, %r4, 0;
    @%p2 bra        DONE;
    mov.u64         %rd6, %globaltimer;
    sub.u64         %rd7, %rd6, %rd5;
    setp.lt.u64     %p2, %rd7, %rd3;
    @%p2 bra        WAIT;
    ld.param.u64    %rd8, [ended];
    mov.u32         %r5, 1;
    st.relaxed.sys.global.u32 [%rd8], %r5;
DONE:
    ret;
}
"""
HOLD_SHARED_BYTES = 160 * 1024  # > half of an SM's 228 KiB, and 228 - 160 - 1 KiB leaves no room for a 116 KiB CTA
HOLD_LIMIT_S = 120.0  # a holder releases itself after this long, whatever happens to the process
_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class _Driver:
    """The few CUDA driver calls the holder needs, on torch's current context."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.function = None

    def check(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"held_sms: {name} returned CUDA driver error {rc}")

    def hold_function(self) -> ctypes.c_void_p:
        if self.function is None:
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            self.check("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(HOLD_PTX.encode()))
            self.check("cuModuleGetFunction", ctypes.byref(function), module, b"hold_sm")
            self.check("cuFuncSetAttribute", function, _FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED, HOLD_SHARED_BYTES)
            self.function = function
        return self.function

    def launch(self, function, ctas: int, stream: int, *pointers: int) -> None:
        values = [ctypes.c_uint64(p) for p in pointers]
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        self.check("cuLaunchKernel", function, ctas, 1, 1, 32, 1, 1, HOLD_SHARED_BYTES, ctypes.c_void_p(stream),
                   params, None)


_DRIVER: _Driver | None = None


@contextlib.contextmanager
def hold_sms(count: int, start_timeout_s: float = 10.0):
    """Hold `count` SMs of the current device idle inside the block (none when 0); yields their %smid values."""
    import torch

    if count <= 0:
        yield []
        return
    global _DRIVER
    torch.zeros(1, device="cuda")  # the runtime's context is current from here on
    _DRIVER = _DRIVER or _Driver()
    function = _DRIVER.hold_function()
    release = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    timed_out = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # a holder sets it if it ends unreleased
    smids = torch.full((count,), -1, dtype=torch.int32, pin_memory=True)
    stream = torch.cuda.Stream()
    _DRIVER.launch(function, count, stream.cuda_stream, release.data_ptr(), smids.data_ptr(),
                   int(HOLD_LIMIT_S * 1e9), timed_out.data_ptr())
    try:
        deadline = time.monotonic() + start_timeout_s
        while (smids < 0).any():
            if time.monotonic() > deadline:
                raise RuntimeError(f"held_sms: only {int((smids >= 0).sum())} of {count} holders started in "
                                   f"{start_timeout_s} s")
            time.sleep(0.001)
        held = smids.tolist()
        if len(set(held)) != count:
            raise RuntimeError(f"held_sms: {count} holders share SMs: {sorted(held)}")
        yield held
        if int(timed_out[0]):  # e.g. the block synchronized the device, which waits for the holders
            raise RuntimeError(f"held_sms: the holders ended after {HOLD_LIMIT_S} s, before the block did: its "
                               f"timings ran partly on every SM")
    finally:
        release[0] = 1
        stream.synchronize()


_CU_DEV_RESOURCE_TYPE_SM = 1
_DEV_RESOURCE_BYTES = 1024  # a CUdevResource is 144 bytes in CUDA 12.4; room for any later growth
_SM_COUNT_OFFSET = 96  # CUdevResource.sm.smCount: after the type (4 bytes) and 92 bytes of internal padding


@contextlib.contextmanager
def green_stream(sms: int):
    """A stream whose kernels run on `sms` SMs only: a CUDA green context (torch.cuda.green_contexts), current inside
    the block. Yields (stream, the SMs the driver gave it: a partition may be rounded up)."""
    import torch
    from torch.cuda.green_contexts import GreenContext

    global _DRIVER
    torch.zeros(1, device="cuda")
    _DRIVER = _DRIVER or _Driver()
    context = GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
    context.set_context()
    try:
        current, resource = ctypes.c_void_p(), ctypes.create_string_buffer(_DEV_RESOURCE_BYTES)
        _DRIVER.check("cuCtxGetCurrent", ctypes.byref(current))
        _DRIVER.check("cuCtxGetDevResource", current, resource, _CU_DEV_RESOURCE_TYPE_SM)
        given = ctypes.c_uint.from_buffer(resource, _SM_COUNT_OFFSET).value
        yield context.Stream(), given
    finally:
        context.pop_context()


def time_on_stream(call, warmup: int = 10, reps: int = 40, stream=None) -> list[float]:
    """Milliseconds of each of `reps` calls of `call` on `stream` (default: a fresh one), after `warmup` calls, timed
    by CUDA events (no device-wide synchronisation, which would wait for any holders)."""
    import torch

    stream = stream or torch.cuda.Stream()
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


SM_METHODS = ("green", "hold")


def median_ms_on_sms(call, sms: int, device_sms: int, method: str = "green") -> float:
    """Median milliseconds of `call` (a launch sized for `sms` SMs) on `sms` of the device's SMs: by a green context
    ("green") or with the other SMs held idle ("hold"); on all of them plainly."""
    if not 0 < sms <= device_sms:
        raise ValueError(f"sms={sms}: expected 1 .. {device_sms} (this device's SMs)")
    if method not in SM_METHODS:
        raise ValueError(f"method={method!r}: expected one of {SM_METHODS}")
    if sms == device_sms:
        return statistics.median(time_on_stream(call))
    if method == "hold":
        with hold_sms(device_sms - sms):
            return statistics.median(time_on_stream(call))
    with green_stream(sms) as (stream, given):
        if given != sms:  # rounded to the partition granularity, or a driver whose CUdevResource reads otherwise
            print(f"held_sms: WARNING: a green context of {sms} SMs reports {given}", flush=True)
        return statistics.median(time_on_stream(call, stream=stream))


def copy_rate_tbps(sms: int, device_sms: int, method: str = "green", gib: float = 2.0) -> float:
    """Device-to-device copy rate (read + write bytes per second, TB/s) of a `gib` GiB tensor on `sms` SMs."""
    import torch

    src = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms_on_sms(lambda: dst.copy_(src), sms, device_sms, method)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e12


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sms", type=int, nargs="+", help="numbers of SMs to measure the copy rate on")
    parser.add_argument("--method", choices=SM_METHODS, default="green",
                        help="green: a green context of N SMs (default); hold: the other SMs held idle")
    args = parser.parse_args(argv)
    import torch

    device_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: {device_sms} SMs")
    for n in args.sms:
        print(f"copy rate on {n} SMs ({args.method}): {copy_rate_tbps(n, device_sms, args.method):.3f} TB/s",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
