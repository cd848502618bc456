"""The SASS of a compiled kernel object with each instruction's dependency scoreboards (CPU, no GPU).

    python benchmarks/sass_scoreboards.py OBJECT [--nvdisasm PATH] [--waits-on SB --after ADDR | --loops | --spills]

OBJECT: a kernel.o of the cache or a `fused_phases.py --export` object. nvdisasm comes from the CUDA toolkit or the
`nvidia-cuda-nvdisasm` wheel (PATH, or --nvdisasm). Each line: address, the scoreboard the instruction sets when its
result lands (wb: a variable-latency load's), the one it sets when its source registers are read (rb), the
scoreboards it waits on before it issues, and the instruction. Hopper keeps these in the top 23 bits of each 128-bit
instruction word: stall (4 bits), yield (1), wb (3), rb (3), wait mask (6), reuse (4); 7 means none.

`--waits-on SB --after ADDR` lists only the instructions past ADDR (hex) that wait on scoreboard SB: e.g. whether
any instruction of a tile waits for loads issued earlier in it (docs/performance.md, fifteenth session: the fused
a1-ge kernel at K = 60, whose next-tile v loads set SB 5 and which nothing waits on before the loop's back edge).

`--loops` lists the backward branches instead, the largest span first: how many instructions lie between each one's
target and itself. The first is a persistent kernel's tile loop, whose size the instruction cache feels
(docs/performance.md, fourteenth and eighteenth sessions).

`--spills` lists the local-memory loads and stores instead (LDL, STL: a register spill and its refills), each marked
inside or outside the largest loop: at the 255-register cap one refill per tile cost a fused kernel 3.5-9.5% of its
time (docs/performance.md, twenty-fourth session), so look here before timing a change. With a directory for OBJECT
(a cache's root, an export directory) it prints one line per object (.o) under it that has any: their counts.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile

from kdajit.cubins import embedded_cubins

_LINE = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;\s*/\*\s*(0x[0-9a-f]+)\s*\*/")
_HIGH = re.compile(r"/\*\s*(0x[0-9a-f]+)\s*\*/")
_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")
_LOCAL = re.compile(r"\b(LDL|STL)\b")


def whole_image(obj: bytes) -> bytes:
    """The first embedded cubin through its program headers and section contents (nvdisasm reads them all)."""
    cubin = embedded_cubins(obj)[0]
    start = obj.find(cubin[:64])
    phoff, = struct.unpack_from("<Q", cubin, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", cubin, 0x36)
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
    for i in range(shnum):
        _, kind, _, _, offset, size, *_ = struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
        if kind != 8:  # SHT_NOBITS occupies no bytes of the file
            end = max(end, offset + size)
    return obj[start:start + end]


def disassembly(obj_path: pathlib.Path, nvdisasm: str) -> list[str]:
    """nvdisasm's listing (with the encodings) of the object's first cubin, line by line."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(whole_image(obj_path.read_bytes()))
        cubin.flush()
        return subprocess.run([nvdisasm, "-c", "-hex", cubin.name], capture_output=True, text=True,
                              check=True).stdout.splitlines()


def loops(lines: list[str]) -> list[tuple[int, int, int]]:
    """(instructions from the target through the branch, target address, branch address) of every backward branch
    of a `disassembly`, the largest first."""
    labels, found = {}, []  # label -> index of the instruction after it; found[i]: (address, branch target) of i
    for line in lines:
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(found)
            continue
        low = _LINE.match(line)
        if not low:
            continue
        branch = _BRANCH.search(low.group(2))
        found.append((int(low.group(1), 16), branch.group(1) if branch else None))
    spans = [(index - labels[target] + 1, found[labels[target]][0], addr) for index, (addr, target) in enumerate(found)
             if target in labels and labels[target] <= index]
    return sorted(spans, reverse=True)


def spills(lines: list[str]) -> list[tuple[int, str]]:
    """(address, instruction) of every local-memory load and store (LDL, STL) of a `disassembly`."""
    found = []
    for line in lines:
        low = _LINE.match(line)
        if low and _LOCAL.search(low.group(2)):
            found.append((int(low.group(1), 16), " ".join(low.group(2).split())))
    return found


def spills_by_loop(lines: list[str]) -> list[tuple[int, str, bool]]:
    """`spills` of a `disassembly`, each with whether it lies inside its largest loop (a tile loop's refill runs
    every tile; a spill before the loop runs once)."""
    largest = loops(lines)[:1]
    return [(address, text, bool(largest) and largest[0][1] <= address <= largest[0][2])
            for address, text in spills(lines)]


def instructions(obj_path: pathlib.Path, nvdisasm: str) -> list[tuple[int, int, int, int, str]]:
    """(address, wb, rb, wait mask, text) of every instruction of the object's first cubin."""
    lines = disassembly(obj_path, nvdisasm)
    rows = []
    for at, line in enumerate(lines[:-1]):
        low = _LINE.match(line)
        high = _HIGH.search(lines[at + 1]) if low else None
        if high:
            control = (int(low.group(3), 16) | int(high.group(1), 16) << 64) >> 105
            rows.append((int(low.group(1), 16), control >> 5 & 7, control >> 8 & 7, control >> 11 & 0x3F,
                         low.group(2)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("object", type=pathlib.Path)
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm"), help="default: nvdisasm on PATH")
    parser.add_argument("--waits-on", type=int, choices=range(6), metavar="SB", help="scoreboard 0-5")
    parser.add_argument("--after", type=lambda s: int(s, 16), default=-1, metavar="ADDR", help="hex address")
    parser.add_argument("--loops", action="store_true", help="list the backward branches' spans instead")
    parser.add_argument("--spills", action="store_true", help="list the local-memory loads and stores instead")
    args = parser.parse_args(argv)
    if not args.nvdisasm:
        parser.error("--nvdisasm: no nvdisasm on PATH (CUDA toolkit, or pip install nvidia-cuda-nvdisasm)")
    if args.loops:
        for size, start, branch in loops(disassembly(args.object, args.nvdisasm)):
            print(f"{size:6d} instructions: {start:x} .. {branch:x}")
        return 0
    if args.spills and args.object.is_dir():
        objects = sorted(args.object.rglob("*.o"))
        for path in objects:
            found = spills_by_loop(disassembly(path, args.nvdisasm))
            if found:
                print(f"{len(found):4d} local-memory instructions, {sum(inside for *_, inside in found):4d} in the "
                      f"largest loop: {path.relative_to(args.object)}")
        print(f"{len(objects)} objects")
        return 0
    if args.spills:
        found = spills_by_loop(disassembly(args.object, args.nvdisasm))
        for address, text, inside in found:
            print(f"{address:6x} {'in the largest loop' if inside else 'outside it':19} {text}")
        print(f"{len(found)} local-memory instructions")
        return 0
    for address, wb, rb, wait, text in instructions(args.object, args.nvdisasm):
        if args.waits_on is not None and (address <= args.after or not wait >> args.waits_on & 1):
            continue
        waits = "".join(str(b) for b in range(6) if wait >> b & 1) or "-"
        print(f"{address:6x} wb={wb if wb != 7 else '-'} rb={rb if rb != 7 else '-'} wait={waits:6} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
