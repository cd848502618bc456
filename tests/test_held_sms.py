"""CPU: benchmarks/held_sms.py's checks, which guard a device call that has no second chance.

An estimate on fewer SMs is scaled by the SM count asked for; if the green context's partition differs (rounded to its
granularity), the scaling would be silently wrong, so it must refuse. The SM count is read from the driver's
CUdevResource at a fixed offset: the test builds one as the CUDA 12.4 header lays it out.
"""
import ctypes
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import held_sms  # noqa: E402


class _SmResource(ctypes.Structure):  # cuda.h (12.4+): CUdevResource with its `sm` member
    _fields_ = [("type", ctypes.c_int), ("_internal_padding", ctypes.c_ubyte * 92), ("smCount", ctypes.c_uint),
                ("_oversize", ctypes.c_ubyte * 44)]


def test_sm_count_offset_matches_the_driver_struct():
    assert _SmResource.smCount.offset == held_sms._SM_COUNT_OFFSET
    assert ctypes.sizeof(_SmResource) <= held_sms._DEV_RESOURCE_BYTES


def test_sms_out_of_range_named():
    with pytest.raises(ValueError, match="sms=0"):
        held_sms.median_ms_on_sms(lambda: None, 0, 132)
    with pytest.raises(ValueError, match="sms=133"):
        held_sms.median_ms_on_sms(lambda: None, 133, 132)


def test_a_partition_of_another_size_is_refused(monkeypatch):
    import contextlib

    @contextlib.contextmanager
    def rounded(sms):
        yield None, sms + 8

    monkeypatch.setattr(held_sms, "green_stream", rounded)
    with pytest.raises(RuntimeError, match="green context of 96 SMs has 104"):
        held_sms.median_ms_on_sms(lambda: None, 96, 132)
