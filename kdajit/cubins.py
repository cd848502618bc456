"""The CUDA cubins embedded in a compiled host object (a cached kernel.o): their arch and code size.

Read from the ELF headers alone (no CUDA tools), so it works on the CPU machine.
"""
from __future__ import annotations

import struct

_EM_CUDA = 190  # e_machine of a CUDA cubin


def embedded_cubins(obj: bytes) -> list[bytes]:
    """The 64-bit CUDA ELF images inside a host object, each from its header to the end of its section table."""
    found, at = [], obj.find(b"\x7fELF", 1)
    while at >= 0:
        machine, = struct.unpack_from("<H", obj, at + 18)
        if obj[at + 4] == 2 and machine == _EM_CUDA:
            shoff, = struct.unpack_from("<Q", obj, at + 0x28)
            shentsize, shnum = struct.unpack_from("<HH", obj, at + 0x3A)
            found.append(obj[at:at + shoff + shentsize * shnum])
        at = obj.find(b"\x7fELF", at + 4)
    return found


def cubin_arch(cubin: bytes) -> str:
    """The SM arch of a cubin, e.g. "sm_90a", from its ELF header.

    NVIDIA's e_flags: ELF ABI version 7 keeps the SM number in bits 0-7 and the arch-specific ("a")
    feature flag at 0x800; version 8 (sm_100 and later) keeps the SM in bits 8-15 and the flag at 0x8.
    """
    flags, = struct.unpack_from("<I", cubin, 48)
    sm, accel = (flags & 0xFF, flags & 0x800) if cubin[8] < 8 else ((flags >> 8) & 0xFF, flags & 0x8)
    return f"sm_{sm}{'a' if accel else ''}"


def text_bytes(cubin: bytes) -> int:
    """Bytes of the cubin's `.text.*` sections: its kernels' SASS."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]

    def name(offset: int) -> bytes:
        start = names_at + offset
        return cubin[start:cubin.index(b"\0", start)]

    return sum(s[5] for s in sections if name(s[0]).startswith(b".text."))
