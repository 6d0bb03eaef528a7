"""Pretrained weights read slice by slice from safetensors files.

A `ShardSpec` is exactly the slice of a tensor a rank holds, so a rank reads
just those blocks from the files (`safe_open(...).get_slice`), never the
whole model: peak memory while loading is the rank's shards plus one block.
Works for a single `model.safetensors` and for a sharded checkpoint with a
`model.safetensors.index.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from ..parallel.shard import ShardSpec
from .init import ParamSource


class SafetensorsSource(ParamSource):
    def __init__(self, model: nn.Module, directory: Path):
        super().__init__(model)
        self.directory = Path(directory)
        self.transposed = set(getattr(model, "tpctl_transposed", ()))
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            self._file_of = {k: self.directory / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            single = self.directory / "model.safetensors"
            if not single.exists():
                raise FileNotFoundError(f"{self.directory}: no model.safetensors or model.safetensors.index.json")
            from safetensors import safe_open

            with safe_open(str(single), "pt") as f:
                self._file_of = {k: single for k in f.keys()}
        self._open: dict[Path, object] = {}

    def _key(self, param: torch.Tensor) -> str:
        """The stored name of `param`: the first of its names (tied
        parameters have several) that the files hold."""
        for name in self.names(param):
            if name in self._file_of:
                return name
        raise KeyError(f"{self.directory}: no tensor for {' / '.join(self.names(param))}")

    def _slice(self, key: str):
        from safetensors import safe_open

        path = self._file_of[key]
        if path not in self._open:
            self._open[path] = safe_open(str(path), "pt")
        return self._open[path].get_slice(key)

    def _reader(self, param: torch.Tensor):
        """read_box for ShardSpec.read, in the Linear's (out, in) layout
        whatever the stored layout."""
        key = self._key(param)
        stored = self._slice(key)
        if key in self.transposed:
            return lambda box: stored[box[1][0]:box[1][1], box[0][0]:box[0][1]].t()
        return lambda box: stored[tuple(slice(a, b) for a, b in box)]

    def full(self, param: torch.Tensor) -> torch.Tensor:
        spec = ShardSpec(tuple(param.shape), (None,) * param.dim())
        return self.shard(param, spec)

    def shard(self, param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        key = self._key(param)
        shape = tuple(reversed(spec.full_shape)) if key in self.transposed else spec.full_shape
        stored_shape = tuple(self._slice(key).get_shape())
        if stored_shape != shape:
            raise ValueError(f"{self.directory}: {key} has shape {stored_shape}, the model expects {shape}")
        return spec.read(self._reader(param), param.dtype).to(param.dtype)
