"""CPU: benchmarks/held_sms.py's holder kernel, whose PTX the GPU machine's driver loads with no compiler there.

A PTX error would surface only in a device call (and cost its start); ptxas on this machine catches it first. Also
the holder's shared-memory size: more than half an SM's, so two holders never share an SM, and too much for the
fused kernel's K = 128 CTA to fit beside one (else the timed kernel would run on the held SMs too).
"""
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import held_sms  # noqa: E402

SMEM_PER_SM = 233_472  # templates/fused_forward.SMEM_PER_SM, without importing the DSL
SMEM_RESERVED_PER_CTA = 1024


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit)")
def test_holder_ptx_assembles_for_sm90(tmp_path):
    ptx = tmp_path / "hold.ptx"
    ptx.write_text(held_sms.HOLD_PTX)
    run = subprocess.run(["ptxas", "-arch=sm_90", str(ptx), "-o", str(tmp_path / "hold.cubin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_holder_takes_an_sm_alone():
    held = held_sms.HOLD_SHARED_BYTES + SMEM_RESERVED_PER_CTA
    assert 2 * held > SMEM_PER_SM
    fused_k128_cta = 115_712 + SMEM_RESERVED_PER_CTA  # templates/fused_forward.py's docstring
    assert held + fused_k128_cta > SMEM_PER_SM


def test_sms_out_of_range_named():
    with pytest.raises(ValueError, match="sms=0"):
        held_sms.median_ms_on_sms(lambda: None, 0, 132)
