"""`tpctl export CKPT OUT`: a checkpoint's full, unsharded weights as one
safetensors file, keyed by the model's parameter names (a tied parameter
once, under the name the model gives it first).

    tpctl export outputs/.../checkpoints/step_200 model.safetensors

One process, no process group: DCP reads every saved chunk into whole
tensors (padding was never saved). The steps are separate functions so that
another output form (e.g. a Hugging Face directory for model.arch=gpt2 or
llama) can reuse them: `full_weights` gives {name: tensor}, an adapter maps
names and layouts (see EXPORTERS), `write_safetensors` writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

from tpctl.errors import fail

EPILOG = "exit status: 0 written, 2 bad arguments or an invalid checkpoint"


def full_weights(checkpoint_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, {parameter name: whole tensor}) of a verified checkpoint."""
    from tpctl.training.checkpoint import read_full, verify

    manifest = verify(checkpoint_dir)
    return manifest, read_full(checkpoint_dir, manifest)


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, manifest: dict) -> None:
    from safetensors.torch import save_file

    metadata = {"format": "pt", "tpctl_step": str(manifest["step"]), "tpctl_model": json.dumps(manifest["model"])}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out), metadata=metadata)


def write_hf(manifest: dict, tensors: dict[str, torch.Tensor], out: Path) -> None:
    """A Hugging Face model: a directory `from_pretrained` loads."""
    from omegaconf import OmegaConf

    from tpctl.models.hf import save_hf

    save_hf(OmegaConf.create(manifest["model"]), tensors, out)


# model.arch -> function(manifest, {name: tensor}, out) writing another form;
# tpctl's own (and custom) models write one safetensors file.
EXPORTERS: dict[str, Callable[[dict, dict[str, torch.Tensor], Path], None]] = {"gpt2": write_hf, "llama": write_hf}


def export(checkpoint_dir: Path, out: Path) -> dict:
    manifest, tensors = full_weights(checkpoint_dir)
    exporter = EXPORTERS.get(manifest["model"].get("arch"))
    if exporter is not None:
        exporter(manifest, tensors, out)
    else:
        write_safetensors(tensors, out, manifest)
    return {"step": manifest["step"], "tensors": len(tensors),
            "parameters": sum(t.numel() for t in tensors.values())}


def main(args: list[str]) -> int:
    from tpctl.training.checkpoint import CheckpointError, verify
    from tpctl.training.corpus import respect_umask

    parser = argparse.ArgumentParser(prog="tpctl export", description="Write a checkpoint's whole weights as safetensors "
                                     "(a save_pretrained directory for model=hf).", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                        help="a checkpoint directory (<run dir>/checkpoints/step_<N>)")
    parser.add_argument("out", type=Path, metavar="OUT", help="the safetensors file to write (its directory must exist); "
                        "for a Hugging Face model (model=hf) a directory, written with save_pretrained so that "
                        "from_pretrained(OUT) loads it")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists (else an existing OUT is refused)")
    parser.error = lambda message: sys.exit(fail(f"tpctl export: {message} (see tpctl export --help)"))
    flags = parser.parse_args(args)
    ckpt, out, force = flags.checkpoint, flags.out, flags.force
    try:
        arch = verify(ckpt)["model"].get("arch")
    except CheckpointError as e:
        return fail(f"export CHECKPOINT={str(ckpt)!r}: {e}")
    if out.exists() and not force:
        return fail(f"export OUT={str(out)!r}: already exists; pass --force to overwrite it")
    if arch in EXPORTERS:  # a directory
        if out.exists() and not out.is_dir():
            return fail(f"export OUT={str(out)!r}: a file; model.arch={arch} exports a directory")
    elif out.is_dir() or not out.absolute().parent.is_dir():
        why = "is a directory" if out.is_dir() else f"its directory {out.absolute().parent} does not exist"
        return fail(f"export OUT={str(out)!r}: {why}; expected a file path")
    try:
        done = export(ckpt, out)
    except CheckpointError as e:
        return fail(f"export CHECKPOINT={str(ckpt)!r}: {e}")
    respect_umask(out)  # safetensors writes 0600: a shared file system's other users must read it
    print(f"tpctl: wrote {out}: {done['tensors']} tensors, {done['parameters'] / 1e6:.2f}M parameters (step {done['step']})")
    return 0
