"""GPU: non-finite inputs, gates outside the safe range and unchecked cu_seqlens stay inside their tile.

Issue 11, parts 2 and 4; the reach rules are docs/numerics.md "Non-finite and out-of-range inputs".
Every comparison is bitwise against a clean run of the same inputs. Run with `pytest -m gpu`; under
`compute-sanitizer --tool memcheck` the cu_seqlens test also proves that no read leaves its tensor.
"""
import time

import pytest
import torch

import kdajit
from kdajit import reference
from test_gpu_forward import OUTPUTS, poisoned_out, run, seed  # noqa: F401  (seed: fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENGTHS = [70, 130, 1, 64, 100]  # sequence 1: chunks of 64, 64 and 2 rows
HEADS = 3
SEQ, HEAD, COLUMN = 1, 2, 5  # where values are injected
WIDTH = {"Aqk": 64, "Akk": 64, "w": 128, "u": 128, "kg": 128, "qg": 128}


def packed_inputs(lower_bound=-5.0):
    cu = torch.tensor([0] + LENGTHS, device="cuda").cumsum(0).to(torch.int32)
    x = reference.make_inputs(1, sum(LENGTHS), HEADS, cu_seqlens=cu, lower_bound=lower_bound, device="cuda")
    return x, cu


def forward_any(x, cu):
    """forward into NaN-poisoned buffers, without run()'s all-finite check."""
    out = poisoned_out(1, x["q"].shape[1], HEADS)
    kdajit.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=True, out=out)
    torch.cuda.synchronize()
    return out


def reach(name, i0, v):
    """Per output, the [v, width] entries of the tile that a non-finite `name` at tile row i0 may reach."""
    def rows(where):
        return {out: where[:, None].expand(v, WIDTH[out]).clone() for out in OUTPUTS}

    r = torch.arange(v, device="cuda")
    own, later, every, none = rows(r == i0), rows(r >= i0), rows(r >= 0), rows(r < 0)
    # Akk (and U = Akk Vp): a non-finite L row reaches the earlier rows of its own 16-row block through the
    # inverse's merge products (0 x inf), except in block 0, which no merge writes.
    akk_rows = rows(r >= (i0 // 16) * 16 if i0 >= 16 else r >= i0)
    # The token as a key: Aqk column i0, rows >= i0.
    column = (r[:, None] >= i0) & (torch.arange(64, device="cuda")[None, :] == i0)
    # The gate of a block's first row is the reference of that whole 16-row block row.
    block = rows((r >= i0) & (r < i0 + 16)) if i0 % 16 == 0 else own
    table = {
        "q": dict(Aqk=own["Aqk"], qg=own["qg"]),
        "k": dict(Aqk=column, Akk=akk_rows["Akk"], w=every["w"], u=akk_rows["u"], kg=own["kg"]),
        "v": dict(u=every["u"]),
        "beta": dict(Akk=akk_rows["Akk"], w=every["w"], u=every["u"]),
        "gk": dict(Aqk=block["Aqk"] | column, Akk=akk_rows["Akk"], w=every["w"], u=akk_rows["u"],
                   kg=(every if i0 == v - 1 else own)["kg"], qg=own["qg"]),
    }
    return {out: table[name].get(out, none[out]) for out in OUTPUTS}


def tile_masks(cu, chunk, v, masks):
    """The reach masks placed at (sequence SEQ, chunk `chunk`, head HEAD) in full-size output masks."""
    T = int(cu[-1])
    row0 = int(cu[SEQ]) + 64 * chunk
    full = {}
    for out in OUTPUTS:
        m = torch.zeros(1, T, HEADS, WIDTH[out], dtype=torch.bool, device="cuda")
        m[0, row0:row0 + v, HEAD] = masks[out]
        full[out] = m
    return full


def assert_outside_equal_and_finite(clean, dirty, allowed, what):
    for out in OUTPUTS:
        a, b, m = getattr(clean, out).view(torch.int16), getattr(dirty, out).view(torch.int16), allowed[out]
        changed = (a != b) & ~m
        assert not changed.any(), f"{what}: {out} changed outside the documented reach at {changed.nonzero()[0]}"
        assert torch.isfinite(getattr(dirty, out)[~m]).all(), f"{what}: {out} non-finite outside the reach"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", ["q", "k", "v", "gk", "beta"])
def test_non_finite_input_reaches_only_its_documented_outputs(seed, name, value):
    x, cu = packed_inputs()
    clean = run(x, cu)  # every element written and finite
    # (chunk of sequence SEQ, row in that chunk, valid rows): a plain row, a reference row, the last
    # row of a full chunk (KG's g_last), and the last row of a 2-row partial chunk.
    for chunk, i0, v in ((1, 37, 64), (1, 16, 64), (1, 63, 64), (2, 1, 2), (0, 0, 64)):
        dirty_x = {n: t.clone() for n, t in x.items()}
        token = int(cu[SEQ]) + 64 * chunk + i0
        if name == "beta":
            dirty_x["beta"][0, token, HEAD] = value
        else:
            dirty_x[name][0, token, HEAD, COLUMN] = value
        dirty = forward_any(dirty_x, cu)
        masks = reach(name, i0, v)
        what = f"{name}={value} at chunk {chunk} row {i0}"
        assert_outside_equal_and_finite(clean, dirty, tile_masks(cu, chunk, v, masks), what)
        row0 = int(cu[SEQ]) + 64 * chunk
        hit = [out for out in OUTPUTS
               if not torch.isfinite(getattr(dirty, out)[0, row0:row0 + v, HEAD][masks[out]]).all()]
        assert hit, f"{what}: the injected value reached no output (test is not exercising anything)"


def test_gate_40x_steeper_than_safe_stays_in_its_tiles(seed):
    x, cu = packed_inputs()
    clean = run(x, cu)
    steep, _ = packed_inputs(lower_bound=-200.0)  # per-token log-gate down to -200 (safe bound: -5)
    dirty_x = {n: t.clone() for n, t in x.items()}
    a, b = int(cu[SEQ]), int(cu[SEQ + 1])
    dirty_x["gk"][0, a:b, HEAD] = steep["gk"][0, a:b, HEAD]
    out = poisoned_out(1, x["q"].shape[1], HEADS)
    kdajit.forward(dirty_x["q"], dirty_x["k"], dirty_x["v"], dirty_x["gk"], dirty_x["beta"], cu_seqlens=cu,
                   output_qg=True, out=out)
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + 30
    while not done.query():  # a kernel that spins would fail here instead of hanging the suite
        assert time.monotonic() < deadline, "forward did not finish within 30 s"
        time.sleep(0.01)
    allowed = {}
    for name in OUTPUTS:
        m = torch.zeros(1, x["q"].shape[1], HEADS, WIDTH[name], dtype=torch.bool, device="cuda")
        m[0, a:b, HEAD] = True
        allowed[name] = m
    assert_outside_equal_and_finite(clean, out, allowed, "steep gate")
    counts = {name: int((~torch.isfinite(getattr(out, name)[0, a:b, HEAD])).sum()) for name in OUTPUTS}
    print(f"non-finite values in the steep (sequence, head): {counts}")


HOSTILE_CU = [[0, 1000000, 300], [0, 200, 100, 300], [-50, 100, 300], [0, 300, 2**31 - 1], [400, 500],
              [300, 0], [0, 0, 0], [-2**31, 2**31 - 1, 300]]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("values", HOSTILE_CU, ids=str)
def test_unchecked_cu_seqlens_never_leave_the_tensors(monkeypatch, values, dtype):
    # KDAJIT_VALIDATE=shapes skips the cu_seqlens values. Outputs are interior views of guarded buffers:
    # any write outside an output's bytes shows in its guards. Reads out of bounds need compute-sanitizer.
    monkeypatch.setenv("KDAJIT_VALIDATE", "shapes")
    T, guard = 300, 4096
    x = reference.make_inputs(1, T, HEADS, device="cuda")
    before = {n: t.clone() for n, t in x.items()}
    cu = torch.tensor(values, dtype=dtype, device="cuda")
    buffers, fields = [], {}
    for name in OUTPUTS:
        shape = (1, T, HEADS, WIDTH[name])
        buf = torch.full((guard + torch.Size(shape).numel() + guard,), 7.0, dtype=torch.bfloat16, device="cuda")
        fields[name] = buf[guard:guard + torch.Size(shape).numel()].view(shape)
        buffers.append((name, buf))
    kdajit.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=True,
                   out=kdajit.ForwardOutput(**fields))
    torch.cuda.synchronize()  # raises on an illegal address
    for name, buf in buffers:
        for side, g in (("before", buf[:guard]), ("after", buf[-guard:])):
            assert (g == 7.0).all(), f"cu_seqlens={values}: a kernel wrote {side} out.{name}"
    for name, t in before.items():
        assert torch.equal(t, x[name]), f"cu_seqlens={values}: input {name} was modified"
