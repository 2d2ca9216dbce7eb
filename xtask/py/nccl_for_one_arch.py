#!/usr/bin/env python3
"""NCCL from the registry's wheel, cut down to one GPU architecture and into pieces that travel.

Why: a lent GPU machine carries NCCL 2.28.9, which refuses two ranks of one communicator on one
GPU; 2.30 and later allow it (`NCCL_MULTI_RANK_GPU_ENABLE=1`). PyPI's `nvidia-nccl-cu13` 2.32.3
ships `libnccl.so.2` at 344 MB (268 MB under xz), and one device call carries at most 64 MiB.
An H200 loads only its own architecture's device code (sm_90), so a copy in which every other
architecture's code is blanked compresses to a few tens of MB.

How: `libnccl.so.2` is an ELF shared library. Its device code sits in two sections, each a list
of fat binaries (header magic 0xBA55ED50), each a list of entries (one per kind and architecture:
kind 1 is PTX, kind 2 a cubin, the architecture as `sm` x 10 + minor; each payload a zstd frame,
its compressed size at byte 16 of the entry's header and its size once decompressed at byte 56).
`.nv_fatbin` holds the linked code the CUDA runtime registers when the library loads;
`__nv_relfatbin` holds relocatable code for device-side linking. In both, the payload of every
entry that is not a cubin of the kept architecture is replaced by a zstd frame that decompresses
to as many zero bytes as the original did (RLE blocks, a few bytes), followed by zeros up to the
payload's padded size, and its header's compressed size is set to the new frame's; every other
header field stays as it was, so every entry still decompresses to its announced size and the
driver picks the kept architecture's cubin, exactly as in the original (`cuobjdump --list-elf`
reads the copy as it reads the original). An uncompressed payload (no zstd magic) is zeroed
as it is. The debugging sections (`.debug_*`, never loaded) are zeroed too. Nothing moves: the
copy has the original's size and layout, and its host code is byte for byte the original's. xz
then shrinks the long runs of zeros to almost nothing, and the result is split into pieces of at
most `--piece-mib`.

On the device the pieces are joined back (`cat`, `xz -d`) and checked against the copy's
SHA-256, written beside them in `manifest.json` with each piece's SHA-256 and the wheel's.

With `--arch all` nothing is blanked: the pieces join to the wheel's library byte for byte
(268 MB under xz: five pieces, five device calls; the fallback should a driver refuse the copy).

Usage: nccl_for_one_arch.py WHEEL_OR_LIBNCCL --arch 90|all --out DIR [--piece-mib 60]
       nccl_for_one_arch.py --join DIR --to LIBDIR   (joins DIR's pieces, checks, writes
                                                     LIBDIR/libnccl.so.2)
"""

import argparse
import hashlib
import json
import lzma
import os
import pathlib
import struct
import subprocess
import sys
import zipfile

FATBIN_MAGIC = 0xBA55ED50
KIND_CUBIN = 2
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ZSTD_MAX_BLOCK = 128 << 10


def empty_elf(original_header):
    """A valid ELF file with no content but its section-name table, whose identity (class,
    machine, version, flags: for a cubin, its architecture) is `original_header`'s."""
    names = b"\0.shstrtab\0"
    header = bytearray(original_header[:64])
    # e_entry, e_phoff = 0; e_shoff = 64; e_ehsize 64, e_phentsize 0, e_phnum 0, e_shentsize 64,
    # e_shnum 2, e_shstrndx 1 (e_flags, at 48, is kept).
    struct.pack_into("<QQQ", header, 24, 0, 0, 64)
    struct.pack_into("<HHHHHH", header, 52, 64, 0, 0, 64, 2, 1)
    null = bytes(64)
    strtab = struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, 64 + 128, len(names), 0, 0, 1, 0)
    return bytes(header) + null + strtab + names


def zstd_raw(data):
    """A zstd frame holding `data` as it is: a single-segment frame header with the content size
    in 4 bytes, then one raw block (3-byte block header: last-block bit, type 0, the size)."""
    assert len(data) < ZSTD_MAX_BLOCK
    return ZSTD_MAGIC + bytes([0xA0]) + struct.pack("<I", len(data)) + \
        struct.pack("<I", 1 | (len(data) << 3))[:3] + data


def zstd_zeros(size):
    """A zstd frame whose content is `size` zero bytes: a single-segment frame header with the
    content size in 4 bytes, then RLE blocks of at most 128 KiB (3-byte block header: last-block
    bit, type 1 = RLE, the repeat count; then the byte)."""
    frame = bytearray(ZSTD_MAGIC)
    frame += bytes([0xA0]) + struct.pack("<I", size)  # FCS in 4 bytes, single segment
    left = size
    while True:
        count = min(left, ZSTD_MAX_BLOCK)
        left -= count
        last = 1 if left == 0 else 0
        frame += struct.pack("<I", last | (1 << 1) | (count << 3))[:3] + b"\0"
        if last:
            return bytes(frame)
DEVICE_SECTIONS = (".nv_fatbin", "__nv_relfatbin")


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def sections(elf):
    """(name, offset, size) of every section of a little-endian ELF64 file."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        sys.exit("not a little-endian 64-bit ELF file")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        raw.append((name, typ, off, size))
    strtab = raw[shstrndx][2]
    out = []
    for name, typ, off, size in raw:
        end = elf.index(b"\0", strtab + name)
        # SHT_NOBITS (8) has no bytes in the file.
        out.append((elf[strtab + name:end].decode(), off, 0 if typ == 8 else size))
    return out


def blank_other_archs(elf, start, size, arch, stats):
    """Zeroes, in the fat binaries of elf[start:start+size], the payload of every entry that is
    not a cubin of `arch`; the headers stay."""
    pos, end = start, start + size
    while pos + 16 <= end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", elf, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fat binaries are 8-byte aligned; padding between them
            continue
        entry, fat_end = pos + header_size, pos + header_size + fat_size
        if fat_end > end:
            sys.exit(f"a fat binary at {pos} runs past its section's end")
        while entry < fat_end:
            kind, _ver, entry_header, payload = struct.unpack_from("<HHIQ", elf, entry)
            entry_arch = struct.unpack_from("<I", elf, entry + 28)[0]
            if entry_header == 0 or entry + entry_header + payload > fat_end:
                sys.exit(f"a fat binary entry at {entry} is malformed")
            body = entry + entry_header
            key = f"{'cubin' if kind == KIND_CUBIN else 'ptx' if kind == 1 else kind}-sm_{entry_arch}"
            kept = kind == KIND_CUBIN and entry_arch == arch
            stats.setdefault(key, {"entries": 0, "bytes": 0, "kept": kept})
            stats[key]["entries"] += 1
            stats[key]["bytes"] += payload
            if not kept:
                blank_entry(elf, entry, entry_header, body, payload)
            entry = body + payload
        pos = fat_end


def stub_of(content):
    """What stands in for an entry's decompressed `content`: an empty ELF of the same identity
    for a cubin, the directives a PTX file starts with (`.version`, `.target`, `.address_size`)
    for PTX; None for anything else."""
    if content[:4] == b"\x7fELF":
        return empty_elf(content)
    lines = []
    for line in content.split(b"\n"):
        lines.append(line)
        if line.strip().startswith(b".address_size"):
            return b"\n".join(lines) + b"\n"
    return None


def blank_entry(elf, entry, header_size, body, payload):
    """Replaces the payload of the fat binary entry at `entry` by a stand-in: its content's stub
    (see `stub_of`) in a raw zstd frame, then zeros; the header's compressed size (byte 16) and
    decompressed size (byte 56) are set to the frame's and the stub's. A payload that is not a
    zstd frame, or whose stub does not fit, becomes zeros."""
    compressed = struct.unpack_from("<I", elf, entry + 16)[0]
    frame = None
    if header_size >= 64 and elf[body:body + 4] == ZSTD_MAGIC and compressed <= payload:
        content = subprocess.run(["zstd", "-dcq"], input=bytes(elf[body:body + compressed]),
                                 capture_output=True, check=True).stdout
        stub = stub_of(content)
        if stub is not None and len(stub) + 16 <= compressed:
            frame = zstd_raw(stub)
            struct.pack_into("<I", elf, entry + 16, len(frame))
            struct.pack_into("<Q", elf, entry + 56, len(stub))
    frame = frame or b""
    elf[body:body + payload] = frame + bytes(payload - len(frame))


def one_arch_copy(original, arch):
    elf = bytearray(original)
    stats = {}
    found = set()
    for name, off, size in sections(original):
        if name in DEVICE_SECTIONS:
            blank_other_archs(elf, off, size, arch, stats)
            found.add(name)
        elif name.startswith(".debug_"):
            elf[off:off + size] = bytes(size)
    if ".nv_fatbin" not in found:
        sys.exit("no .nv_fatbin section: not a CUDA library")
    if not any(v["kept"] for v in stats.values()):
        sys.exit(f"no cubin for sm_{arch} in this library: {sorted(stats)}")
    return bytes(elf), stats


def read_library(path):
    path = pathlib.Path(path)
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            names = [n for n in wheel.namelist() if n.endswith("/libnccl.so.2")]
            if len(names) != 1:
                sys.exit(f"{path}: expected one libnccl.so.2, found {names}")
            return wheel.read(names[0]), sha256(path.read_bytes())
    return path.read_bytes(), None


def cut(args):
    original, wheel_sha = read_library(args.library)
    if args.arch == "all":
        copy, stats = original, {}  # the wheel's library itself, byte for byte
    else:
        copy, stats = one_arch_copy(original, int(args.arch))
    packed = lzma.compress(copy, preset=9 | lzma.PRESET_EXTREME if args.extreme else 9)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    piece = args.piece_mib << 20
    pieces = []
    for i in range(0, len(packed), piece):
        name = f"piece{i // piece}"
        folder = out / name
        folder.mkdir(exist_ok=True)
        part = packed[i:i + piece]
        tmp = folder / "part.tmp"
        tmp.write_bytes(part)
        os.replace(tmp, folder / "part")
        pieces.append({"folder": name, "bytes": len(part), "sha256": sha256(part)})
    manifest = {
        "library": "libnccl.so.2",
        "arch": "all" if args.arch == "all" else f"sm_{args.arch}",
        "wheel_sha256": wheel_sha,
        "original_bytes": len(original),
        "original_sha256": sha256(original),
        "copy_bytes": len(copy),
        "copy_sha256": sha256(copy),
        "xz_bytes": len(packed),
        "pieces": pieces,
        "device_code": stats,
    }
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / "manifest.json")
    kept = sum(v["bytes"] for v in stats.values() if v["kept"])
    what = "the whole library" if args.arch == "all" else \
        f"sm_{args.arch} copy (device code kept {kept / 1e6:.1f} MB)"
    print(f"libnccl.so.2 {len(original) / 1e6:.1f} MB -> {what} -> xz {len(packed) / 1e6:.1f} MB "
          f"in {len(pieces)} piece(s) of at most {args.piece_mib} MiB, in {out}")


def join(args):
    folder = pathlib.Path(args.join)
    manifest = json.loads((folder / "manifest.json").read_text())
    packed = bytearray()
    for p in manifest["pieces"]:
        part = (folder / p["folder"] / "part").read_bytes()
        if sha256(part) != p["sha256"]:
            sys.exit(f"{folder / p['folder'] / 'part'}: SHA-256 differs from the manifest's")
        packed += part
    copy = lzma.decompress(bytes(packed))
    if sha256(copy) != manifest["copy_sha256"]:
        sys.exit("the joined library's SHA-256 differs from the manifest's")
    to = pathlib.Path(args.to)
    to.mkdir(parents=True, exist_ok=True)
    tmp = to / "libnccl.so.2.tmp"
    tmp.write_bytes(copy)
    os.replace(tmp, to / "libnccl.so.2")
    print(f"{to / 'libnccl.so.2'}: {len(copy)} bytes, SHA-256 {manifest['copy_sha256']} as in "
          f"the manifest ({manifest['arch']} copy of NCCL's wheel)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("library", nargs="?", help="the wheel, or a libnccl.so.2")
    parser.add_argument("--arch", default="90",
                        help="kept architecture (90: H100, H200), or `all`: the library as it is")
    parser.add_argument("--out", help="folder of the pieces and the manifest")
    parser.add_argument("--piece-mib", type=int, default=60)
    parser.add_argument("--extreme", action="store_true", help="xz -9e (slower)")
    parser.add_argument("--join", help="folder of pieces to join")
    parser.add_argument("--to", help="folder for the joined libnccl.so.2")
    args = parser.parse_args()
    if args.join:
        if not args.to:
            parser.error("--join needs --to")
        join(args)
    elif args.library and args.out:
        cut(args)
    else:
        parser.error("give WHEEL --out DIR, or --join DIR --to LIBDIR")


if __name__ == "__main__":
    main()
