"""Pretrained weights read slice by slice from safetensors files.

A `ShardSpec` is exactly the slice of a tensor a rank holds, so a rank reads
just those bytes from the files, never the whole model. The files are not
memory-mapped: a mapped slice of a row-major matrix would touch (and keep
resident) every page its rows span; instead each contiguous run of the slice
is read with `os.pread` straight from the file. The safetensors layout is
simple (an 8-byte header length, a JSON header of dtype / shape / byte
offsets, then the raw little-endian data), and read here directly.

Works for a single `model.safetensors` and for a sharded checkpoint with a
`model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch
import torch.nn as nn

from tpctl.parallel.shard import ShardSpec
from .init import ParamSource

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def read_header(path: Path) -> dict:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a safetensors
    file, with "start": where its data begins in the file."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    for entry in header.values():
        entry["start"] = 8 + size + entry["data_offsets"][0]
    return header


def read_box(fd: int, entry: dict, box) -> torch.Tensor:
    """Block `box` (one (start, stop) per dim) of a tensor stored at `entry`,
    read run by run: the rows of the innermost dims that the box covers whole
    are one run each."""
    dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
    item = torch.empty((), dtype=dtype).element_size()
    out_shape = [b - a for a, b in box]
    # The innermost dims taken whole form one contiguous run per index of
    # the dims before them.
    inner = len(shape)
    while inner > 0 and box[inner - 1] == (0, shape[inner - 1]):
        inner -= 1
    run_dims = max(inner - 1, 0)  # dims looped over; dim run_dims is the partial one (or all whole)
    run_len = math.prod(out_shape[run_dims:]) * item
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    buffer = bytearray(math.prod(out_shape) * item)
    view = memoryview(buffer)
    pos = 0
    for index in _product([range(a, b) for a, b in box[:run_dims]]):
        offset = sum(i * s for i, s in zip(index, strides)) + (box[run_dims][0] * strides[run_dims] if shape else 0)
        got = os.preadv(fd, [view[pos:pos + run_len]], entry["start"] + offset * item)
        if got != run_len:
            raise OSError(f"short read: {got} of {run_len} bytes (is the file truncated?)")
        pos += run_len
    return torch.frombuffer(buffer, dtype=dtype).reshape(out_shape) if buffer else torch.empty(out_shape, dtype=dtype)


def _product(ranges):
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


class SafetensorsSource(ParamSource):
    def __init__(self, model: nn.Module, directory: Path):
        super().__init__(model)
        self.directory = Path(directory)
        self.transposed = set(getattr(model, "tpctl_transposed", ()))
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.directory / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{self.directory}: no model.safetensors or model.safetensors.index.json")
        self._entries: dict[str, tuple[Path, dict]] = {}
        for name in files:
            path = self.directory / name
            for key, entry in read_header(path).items():
                self._entries[key] = (path, entry)

    def _key(self, param: torch.Tensor) -> str:
        """The stored name of `param`: the first of its names (tied
        parameters have several) that the files hold."""
        for name in self.names(param):
            if name in self._entries:
                return name
        raise KeyError(f"{self.directory}: no tensor for {' / '.join(self.names(param))}")

    def full(self, param: torch.Tensor) -> torch.Tensor:
        return self.shard(param, ShardSpec(tuple(param.shape), (None,) * param.dim()))

    def shard(self, param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        key = self._key(param)
        path, entry = self._entries[key]
        flipped = key in self.transposed  # stored (in, out); the spec is in the Linear's (out, in)
        want = tuple(reversed(spec.full_shape)) if flipped else spec.full_shape
        if tuple(entry["shape"]) != want:
            raise ValueError(f"{self.directory}: {key} has shape {tuple(entry['shape'])}, the model expects {want}")
        fd = os.open(path, os.O_RDONLY)
        try:
            if flipped:
                read = lambda box: read_box(fd, entry, (box[1], box[0])).t()  # noqa: E731
            else:
                read = lambda box: read_box(fd, entry, box)  # noqa: E731
            return spec.read(read, param.dtype).to(param.dtype)
        finally:
            os.close(fd)
