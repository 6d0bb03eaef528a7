"""`tpctl export CKPT OUT`: a checkpoint's full, unsharded weights as one
safetensors file, keyed by the model's parameter names (a tied parameter
once, under the name the model gives it first); for a Hugging Face model a
save_pretrained directory that `from_pretrained` loads.

    tpctl export outputs/.../checkpoints/step_200 model.safetensors
    tpctl export outputs/.../checkpoints/step_200 out_dir          # model=hf

One process, no process group: DCP reads every saved chunk into whole
tensors (padding was never saved). The steps are separate functions so that
another output form can reuse them: `full_weights` gives {name: tensor},
`write_hf` maps names and layouts back to the family's (models/hf.save_hf),
`write_safetensors` writes tpctl's own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError

from tpctl.atomic import replacing, swap_dir
from tpctl.errors import EXIT_FAILED, fail, one_line
from tpctl.schema import is_hf_arch

EPILOG = "exit status: 0 written, 1 OUT could not be written (one line: the OS error), 2 bad arguments or an invalid checkpoint"


def full_weights(checkpoint_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, {parameter name: whole tensor}) of a verified checkpoint."""
    from tpctl.checkpoint import read_full, verify

    manifest = verify(checkpoint_dir)
    return manifest, read_full(checkpoint_dir, manifest)


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, manifest: dict) -> None:
    """Written beside OUT and renamed onto it: a failed export leaves OUT
    as it was, never a truncated file."""
    from safetensors.torch import save_file

    metadata = {"format": "pt", "tpctl_step": str(manifest["step"]), "tpctl_model": json.dumps(manifest["model"])}
    with replacing(out) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def write_hf(manifest: dict, tensors: dict[str, torch.Tensor], out: Path) -> None:
    """A Hugging Face model: a directory `from_pretrained` loads, with the
    run's tokenizer when it had one."""
    from omegaconf import OmegaConf
    from transformers.utils import logging as hf_logging

    from tpctl.models.hf import save_hf

    hf_logging.disable_progress_bar()  # "Writing model shards" of one file: noise on the user's terminal

    # Written beside OUT and renamed into place: a failed export leaves no
    # half-written directory that from_pretrained would read.
    tmp = out.absolute().parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_hf(OmegaConf.create(manifest["model"]), tensors, tmp, tokenizer=hf_tokenizer(manifest))
        swap_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def hf_tokenizer(manifest: dict):
    """The run's tokenizer directory (data.tokenizer), if it had one."""
    return manifest.get("config", {}).get("data", {}).get("tokenizer")


def hf_inputs_problem(manifest: dict):
    """What a Hugging Face export reads besides the checkpoint and lacks:
    the pretrained directory's config.json (the family's config), the
    tokenizer directory. None when both are there."""
    pretrained = manifest["model"].get("pretrained")
    if pretrained and not (Path(pretrained) / "config.json").is_file():
        return f"the run's model.pretrained={pretrained!r} has no config.json any more (the family's config is read from it)"
    tokenizer = hf_tokenizer(manifest)
    if tokenizer and not Path(tokenizer).is_dir():
        return f"the run's data.tokenizer={tokenizer!r} is gone (export copies it)"
    return None


def exports_directory(model: dict) -> bool:
    """A Hugging Face model exports a directory; tpctl's own and custom
    models one safetensors file."""
    return is_hf_arch(model.get("arch"))


def export(checkpoint_dir: Path, out: Path) -> dict:
    manifest, tensors = full_weights(checkpoint_dir)
    if exports_directory(manifest["model"]):
        write_hf(manifest, tensors, out)
    else:
        write_safetensors(tensors, out, manifest)
    return {"step": manifest["step"], "tensors": len(tensors),
            "parameters": sum(t.numel() for t in tensors.values())}


def out_problem(out: Path, directory: bool, model: dict) -> str | None:
    """Why OUT cannot be written, decided before the checkpoint is read; None if it can."""
    parent = out.absolute().parent
    if not parent.exists():
        return f"its directory {parent} does not exist"
    if not parent.is_dir():
        return f"{parent} is a file, not a directory"
    if directory and out.exists() and not out.is_dir():
        return f"a file; model.arch={model.get('arch')} exports a directory"
    if not directory and out.is_dir():
        return "is a directory; expected a file path"
    return None


def write_error(error: BaseException) -> str:
    """One line on why writing OUT failed: the OS error's name and text.
    safetensors' writer raises its own error, the OS error in its text."""
    import errno
    import re

    if isinstance(error, OSError) and error.errno:
        return f"OSError [{errno.errorcode.get(error.errno, error.errno)}] {error.strerror}"
    found = re.search(r"os error (\d+)", str(error))
    if found:
        code = int(found.group(1))
        return f"OSError [{errno.errorcode.get(code, code)}] {os.strerror(code)}"
    return one_line(error)


def main(args: list[str]) -> int:
    from tpctl.atomic import respect_umask
    from tpctl.checkpoint import CheckpointError, verify

    parser = argparse.ArgumentParser(prog="tpctl export", description="Write a checkpoint's whole weights as safetensors "
                                     "(a save_pretrained directory for model=hf).", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                        help="a checkpoint directory (<run dir>/checkpoints/step_<N>)")
    parser.add_argument("out", type=Path, metavar="OUT", help="the safetensors file to write (its directory must exist); "
                        "for a Hugging Face model (model=hf, any family) a directory, written with save_pretrained "
                        "so that from_pretrained(OUT) loads it: config.json, the weights under the names the family "
                        "stores, and the run's tokenizer (data.tokenizer) if it had one")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists (else an existing OUT is refused)")
    parser.error = lambda message: sys.exit(fail(f"tpctl export: {message} (see tpctl export --help)"))
    flags = parser.parse_args(args)
    ckpt, out, force = flags.checkpoint, flags.out, flags.force
    try:
        manifest = verify(ckpt)
    except CheckpointError as e:
        return fail(f"export CHECKPOINT={str(ckpt)!r}: {e}")
    model = manifest["model"]
    if out.exists() and not force:
        return fail(f"export OUT={str(out)!r}: already exists; pass --force to overwrite it")
    problem = out_problem(out, exports_directory(model), model)
    if problem:
        return fail(f"export OUT={str(out)!r}: {problem}")
    problem = hf_inputs_problem(manifest) if exports_directory(model) else None
    if problem:
        return fail(f"export CHECKPOINT={str(ckpt)!r}: {problem}")
    try:
        done = export(ckpt, out)
    except CheckpointError as e:
        return fail(f"export CHECKPOINT={str(ckpt)!r}: {e}")
    except (OSError, SafetensorError) as e:  # a read-only mount, a full disk: OUT is as it was (written beside it)
        return fail(f"export OUT={str(out)!r}: not written: {write_error(e)}", EXIT_FAILED)
    respect_umask(out)  # safetensors writes 0600: a shared file system's other users must read it
    print(f"tpctl: wrote {out}: {done['tensors']} tensors, {done['parameters'] / 1e6:.2f}M parameters (step {done['step']})")
    return 0
