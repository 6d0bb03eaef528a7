"""Pretrained weights read slice by slice from safetensors files.

**Names.** A family stores its tensors under the names it has always
written (GPT-NeoX `embed_out.weight`, GPT-2 `h.0.attn.c_attn.weight` without
its `transformer.` prefix, a mixture of experts one tensor per expert), and
`from_pretrained` maps them onto the model's parameters with transformers'
own tables: the family's renames and converters (`conversion_mapping.py`),
the base-model prefix added or dropped, legacy renames. `StoredNames` runs
those very functions on the stored names (from the files' headers, no
data), so each parameter knows the stored tensor it comes from. A rename
is read slice by slice; a conversion (tensor surgery: experts stacked, a
fused tensor split) is run by the family's own converter on the whole
stored tensors, and the slice taken from the result. A parameter that no
stored tensor feeds (from_pretrained would leave it randomly initialised),
a stored tensor of another shape, a conversion that fails on the stored
shapes (run on meta tensors) are errors before any worker starts. Tied
parameters are one parameter,
read once, from whichever of their names is stored.

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

import copy
import json
import math
import os
import struct
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn

from tpctl.errors import ConfigError
from tpctl.parallel.shard import ShardSpec
from .init import ParamSource

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def read_header(path: Path) -> dict:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a safetensors
    file, with "start": where its data begins in the file. A damaged or
    truncated file is a ConfigError naming it: the header and the file's
    size tell, before any worker starts (a short read in a worker names
    nothing, after the run dir exists)."""
    path = Path(path)
    on_disk = path.stat().st_size
    with open(path, "rb") as f:
        if on_disk < 8:
            raise _damaged(path, f"{on_disk} bytes, fewer than the 8 of the header's length: truncated")
        (size,) = struct.unpack("<Q", f.read(8))
        if 8 + size > on_disk:
            raise _damaged(path, f"its header's length says {size} bytes, the file holds {on_disk - 8} after it: truncated, "
                           "or not a safetensors file")
        try:
            header = json.loads(f.read(size))
        except ValueError as e:  # UnicodeDecodeError too
            raise _damaged(path, f"its header is not JSON ({e}): damaged") from None
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a JSON object: damaged")
    header.pop("__metadata__", None)
    end = 0
    for name, entry in header.items():
        try:
            first, last = entry["data_offsets"]
            nbytes = math.prod(entry["shape"]) * torch.empty((), dtype=_DTYPES[entry["dtype"]]).element_size()
        except (KeyError, TypeError, ValueError):
            raise _damaged(path, f"tensor {name!r} has no valid dtype, shape and data_offsets in the header: damaged") from None
        if not 0 <= first <= last or last - first != nbytes:
            raise _damaged(path, f"tensor {name!r} spans bytes {first}..{last} of the data, but its dtype and shape "
                           f"take {nbytes}: damaged")
        entry["start"] = 8 + size + first
        end = max(end, last)
    if 8 + size + end > on_disk:
        raise _damaged(path, f"truncated: its header places tensor data up to byte {8 + size + end}, the file "
                       f"holds {on_disk}")
    return header


def _damaged(path: Path, why: str) -> ConfigError:
    return ConfigError("model.pretrained", str(path.parent), f"{path}: {why}")


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
    """The values of a Hugging Face model's parameters, read from the
    safetensors files of a `save_pretrained` directory under the names the
    family stores them (module docstring; `StoredNames`)."""

    def __init__(self, model: nn.Module, directory: Path):
        super().__init__(model)
        self.directory = Path(directory)
        self.transposed = set(getattr(model, "tpctl_transposed", ()))
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise _damaged(index, f"not a safetensors index ({type(e).__name__}: {e}): damaged") from None
        elif (self.directory / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{self.directory}: no model.safetensors or model.safetensors.index.json")
        self._entries: dict[str, tuple[Path, dict]] = {}
        for name in files:
            path = self.directory / name
            for key, entry in read_header(path).items():
                self._entries[key] = (path, entry)
        self.stored = StoredNames(model, list(self._entries))
        missing = [self.names(p)[0] for p in self.parameters() if self.stored.source(self.names(p)) is None]
        if missing:
            raise KeyError(f"{self.directory}: no stored tensor for {len(missing)} parameter(s) of "
                           f"{type(model).__name__}, first {missing[0]} (stored names: {', '.join(list(self._entries)[:4])}, ...)")
        self._converted: tuple[Optional[str], dict[str, torch.Tensor]] = (None, {})
        self._check_shapes(model)
        self._load_buffers(model)

    def _check_shapes(self, model: nn.Module) -> None:
        """Every stored tensor, or what the family's conversion makes of the
        stored ones, has its parameter's shape: found here, before any
        worker starts. The conversions run on meta tensors (shapes only)."""
        made: dict[str, dict[str, torch.Tensor]] = {}
        for param in self.parameters():
            names = self.names(param)
            kind, source = self.stored.source(names)
            if kind == "stored":
                shape = tuple(self._entries[source][1]["shape"])
            else:
                if source not in made:
                    try:
                        made[source] = self.stored.convert(source, self._meta_tensor)
                    except Exception as e:  # the family's converter, on this directory's tensors
                        raise ValueError(f"{self.directory}: {type(model).__name__}'s conversion of the stored tensors "
                                         f"of {source} fails: {type(e).__name__}: {e}") from None
                shape = next((tuple(made[source][n].shape) for n in names if n in made[source]), None)
            flipped = any(n in self.transposed for n in names)  # stored (in, out), the Linear's (out, in)
            want = tuple(reversed(param.shape)) if flipped else tuple(param.shape)
            if shape != want:
                raise ValueError(f"{self.directory}: {source} has shape {shape}, {type(model).__name__}.{names[0]} "
                                 f"expects {want}")

    def _meta_tensor(self, key: str) -> torch.Tensor:
        entry = self._entries[key][1]
        return torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]], device="meta")

    def _load_buffers(self, model: nn.Module) -> None:
        """Persistent buffers the files store (a router's score correction)
        get the stored values, as from_pretrained gives them; they are small
        and every rank holds them whole. The others keep what the model's
        constructor computed (rotary frequencies)."""
        params = {name for p in self.parameters() for name in self.names(p)}
        for name, buffer in model.state_dict(keep_vars=True).items():
            if name in params or buffer is None or buffer.is_meta:
                continue
            found = self.stored.source([name])
            if found is None:
                continue
            kind, source = found
            value = self._convert(source, [name]) if kind == "converted" else self._whole(source)
            if tuple(value.shape) != tuple(buffer.shape):
                raise ValueError(f"{self.directory}: {source} has shape {tuple(value.shape)}, the model's buffer "
                                 f"{name} {tuple(buffer.shape)}")
            with torch.no_grad():
                buffer.copy_(value.to(buffer.dtype))

    def full(self, param: torch.Tensor) -> torch.Tensor:
        return self.shard(param, ShardSpec(tuple(param.shape), (None,) * param.dim()))

    def shard(self, param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        names = self.names(param)
        flipped = any(n in self.transposed for n in names)  # stored (in, out); the spec is in the Linear's (out, in)
        kind, source = self.stored.source(names)
        if kind == "converted":
            # The family's loader does tensor surgery here (stacks experts,
            # splits a fused tensor): it runs on the whole stored tensors,
            # then this rank's slice is taken.
            value = self._convert(source, names)
            return spec.slice(value.t() if flipped else value).to(param.dtype)
        path, entry = self._entries[source]  # shapes checked in __init__
        fd = os.open(path, os.O_RDONLY)
        try:
            if flipped:
                read = lambda box: read_box(fd, entry, (box[1], box[0])).t()  # noqa: E731
            else:
                read = lambda box: read_box(fd, entry, box)  # noqa: E731
            return spec.read(read, param.dtype).to(param.dtype)
        finally:
            os.close(fd)

    def _whole(self, key: str) -> torch.Tensor:
        path, entry = self._entries[key]
        fd = os.open(path, os.O_RDONLY)
        try:
            return read_box(fd, entry, tuple((0, n) for n in entry["shape"]))
        finally:
            os.close(fd)

    def _convert(self, group: str, names: list[str]) -> torch.Tensor:
        """The value of the parameter named `names` made by conversion group
        `group` (every target of one group is made at once, and kept until
        another group is asked for: q, k and v of a split come in a row)."""
        if self._converted[0] != group:
            self._converted = (None, {})  # let the previous group's tensors go first
            self._converted = (group, self.stored.convert(group, self._whole))
        made = self._converted[1]
        name = next((n for n in names if n in made), None)
        if name is None:
            raise KeyError(f"{self.directory}: the conversion of {group} did not make {' / '.join(names)}")
        return made[name]

    def parameters(self):
        return [entry[2] for entry in self._params.values()]


class StoredNames:
    """Where each parameter of a transformers model comes from in its
    stored files: the renames and conversions `from_pretrained` applies
    (transformers' own tables: `get_model_conversion_mapping`, the
    base-model prefix added or dropped, the legacy renames), run on the
    stored names exactly as its loader runs them."""

    def __init__(self, model: nn.Module, stored: list[str]):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                     rename_source_key)

        self.model = model
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        expected = dict(model.state_dict(keep_vars=True))  # meta tensors: names and shapes only
        prefix = getattr(model, "base_model_prefix", "")
        self.direct: dict[str, str] = {}  # parameter name -> stored name
        self.targets: dict[str, str] = {}  # parameter name -> its conversion group (the group's first target)
        self.groups: dict[str, tuple[object, list[tuple[str, str]]]] = {}  # group -> (converter, [(stored, pattern)])
        for key in sorted(stored, key=dot_natural_key):  # the loader's order (a grouped rename depends on it)
            target, pattern = rename_source_key(key, renamings, converters, prefix, expected)
            if target not in expected and key in expected:  # as the loader: renamed away from a name the model has
                target, pattern = rename_source_key(key, [], [], prefix, expected)
            if target not in expected:
                continue  # a stored tensor the model does not have: from_pretrained ignores it too
            if pattern is None:
                self.direct.setdefault(target, key)
                continue
            converter, sources = self.groups.setdefault(target, (copy.deepcopy(by_pattern[pattern]), []))
            sources.append((key, pattern))
            for t in converter.target_patterns:
                self.targets.setdefault(target.replace(converter.target_patterns[0], t), target)

    def source(self, names: list[str]):
        """("stored", stored name) or ("converted", group) for the parameter
        known by `names` (a tied parameter has several: read once, from the
        first that is stored), or None."""
        for name in names:
            if name in self.direct:
                return "stored", self.direct[name]
        for name in names:
            if name in self.targets:
                return "converted", self.targets[name]
        return None

    def convert(self, group: str, whole: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """{parameter name: value} of every target of conversion `group`,
        made by the family's own converter from the whole stored tensors."""
        converter, sources = self.groups[group]
        converter = copy.deepcopy(converter)
        for key, pattern in sources:
            converter.add_tensor(group, key, pattern, lambda key=key: whole(key))
        return {name: (value[0] if isinstance(value, list) else value)
                for name, value in converter.convert(group, model=self.model, config=self.model.config).items()}
