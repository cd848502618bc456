"""CPU: benchmarks/sass_scoreboards.py's listing parsers, on an nvdisasm-style listing (no nvdisasm needed).

`--spills` is the check before timing a kernel change (a register spill refilled every tile cost the fused kernel up
to 9.5%, docs/performance.md): it must find every local-memory load and store, and nothing else, since shared-memory
loads and stores (LDS, STS, LDSM) fill every kernel.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import sass_scoreboards  # noqa: E402


def instruction(address: int, text: str) -> list[str]:
    """The two lines nvdisasm -hex prints per instruction (the encoding's low and high words)."""
    return [f"        /*{address:04x}*/                   {text} ;          /* 0x000000070100a387 */",
            "                                                                 /* 0x000fe40000100800 */"]


LISTING = (instruction(0x00, "MOV R1, c[0x0][0x28]") + instruction(0x10, "STL [R1], R7")
           + [".L_x_1:"]
           + instruction(0x20, "LDS R2, [R3]") + instruction(0x30, "STS [R2], R3")
           + instruction(0x40, "LDSM.16.MT88.4 R8, [R4]") + instruction(0x50, "LDL R46, [R1]")
           + instruction(0x60, "STL.64 [R1+0x8], R4") + instruction(0x70, "@P0 BRA `(.L_x_1)")
           + instruction(0x80, "@!P1 LDL.LU R5, [R1+0x4]") + instruction(0x90, "EXIT"))


def test_spills_are_the_local_memory_instructions_only():
    assert sass_scoreboards.spills(LISTING) == [(0x10, "STL [R1], R7"), (0x50, "LDL R46, [R1]"),
                                                (0x60, "STL.64 [R1+0x8], R4"), (0x80, "@!P1 LDL.LU R5, [R1+0x4]")]


def test_the_refills_inside_the_loop_are_told_from_the_spills_outside_it():
    # the loop: 0x20 .. 0x70, six instructions, label through branch
    assert sass_scoreboards.loops(LISTING) == [(6, 0x20, 0x70)]
    assert [(address, inside) for address, _, inside in sass_scoreboards.spills_by_loop(LISTING)] == [
        (0x10, False), (0x50, True), (0x60, True), (0x80, False)]
