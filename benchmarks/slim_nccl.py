"""Make a copy of a libnccl.so.2 that carries device code for one GPU architecture only,
small enough to travel to the GPU machine in one device call.

NCCL 2.32.3's library is 328 MiB: fat binaries with cubins for sm_75 .. sm_120 and PTX, and
debug sections. Every cubin entry for another architecture has its payload zeroed (entry
headers, sizes and offsets stay, so the file layout and every address are unchanged, and the
CUDA runtime, which picks the entry matching the device, never reads them); the PTX is zeroed
too (it is only JIT-compiled where no cubin matches). Debug sections are zeroed as well.
Zeros compress to nothing, so the xz of the result is a few tens of MiB.

Usage: python benchmarks/slim_nccl.py LIBNCCL --sm 90 -o .gpu-extras/nccl-sm90.xz
Restore: python benchmarks/slim_nccl.py --restore .gpu-extras/nccl-sm90.xz -o /tmp/nccl/libnccl.so.2
(the restore prints the sha256 of the slim library, to be compared with the ``.sha256`` file
written beside the archive).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import lzma
import struct
import sys
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_CUBIN = 1, 2
# Sections holding fat binaries (loaded and relocatable) and sections no loader reads.
FATBIN_SECTIONS = (b".nv_fatbin", b"__nv_relfatbin")


def _sections(data: bytes) -> dict[bytes, tuple[int, int, int]]:
    """name -> (file offset, size, flags) of every section of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = headers[shstrndx][4]
    out = {}
    for name_off, _type, flags, _addr, off, size, *_ in headers:
        end = data.index(b"\0", strtab_off + name_off)
        out[data[strtab_off + name_off:end]] = (off, size, flags)
    return out


def slim(data: bytearray, sm: int) -> collections.Counter:
    """Zero, in place, every fat-binary entry not a cubin for ``sm`` and every debug section.
    Returns bytes kept and zeroed by (kind, arch); raises ValueError on a layout it does not know."""
    sections = _sections(bytes(data))
    tally: collections.Counter = collections.Counter()
    for name in FATBIN_SECTIONS:
        if name not in sections:
            continue
        off, size, _ = sections[name]
        pos, end = off, off + size
        while pos < end:
            magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
            if magic != FATBIN_MAGIC:
                raise ValueError(f"{name.decode()}: no fat binary header at offset {pos:#x}")
            entry, entries_end = pos + header_size, pos + header_size + fat_size
            while entry < entries_end:
                kind, _v, entry_header_size, padded_size = struct.unpack_from("<HHII", data, entry)
                arch, = struct.unpack_from("<I", data, entry + 28)
                payload = entry + entry_header_size
                keep = kind == KIND_CUBIN and arch == sm
                tally[("kept" if keep else "zeroed", kind, arch)] += padded_size
                if not keep:
                    data[payload:payload + padded_size] = bytes(padded_size)
                entry = payload + padded_size
            if entry != entries_end:
                raise ValueError(f"{name.decode()}: fat binary at {pos:#x} does not end where its header says")
            pos = entries_end
    for name, (off, size, _flags) in sections.items():
        if name.startswith(b".debug_"):
            data[off:off + size] = bytes(size)
            tally[("zeroed", "debug", 0)] += size
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("library", nargs="?", help="libnccl.so.2 to slim")
    ap.add_argument("--sm", type=int, default=90, help="the one GPU architecture kept (90: Hopper)")
    ap.add_argument("--restore", help="an archive written by this script, to decompress")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    if args.restore:
        data = lzma.decompress(Path(args.restore).read_bytes())
        Path(args.output).write_bytes(data)
        print(hashlib.sha256(data).hexdigest())
        return 0
    if not args.library:
        ap.error("give a library to slim, or --restore")
    data = bytearray(Path(args.library).read_bytes())
    tally = slim(data, args.sm)
    for (what, kind, arch), num_bytes in sorted(tally.items(), key=str):
        print(f"{what:7s} {kind!s:6s} sm_{arch:<4d} {num_bytes / 2**20:8.1f} MiB", file=sys.stderr)
    Path(args.output + ".sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    Path(args.output).write_bytes(lzma.compress(bytes(data), preset=6))
    print(f"{args.output}: {Path(args.output).stat().st_size / 2**20:.1f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
