"""`tpctl generate`: text from a trained checkpoint or a pretrained directory,
decoded with tensor parallelism in any mode, streamed as it comes.

    tpctl generate SOURCE prompt="..." [max_new_tokens=64] [temperature=0.8] [top_k=50] [seed=0]
                   [mode=none size=1 depth=1 device=cpu precision=fp32] [data.tokenizer=DIR] [model.KEY=VALUE] [--json]

SOURCE: a checkpoint (<run dir>/checkpoints/step_<N>, written in any
layout; it is loaded into the one asked for here) or a Hugging Face
save_pretrained directory (config.json and safetensors; any model_type
transformers builds as a causal LM). The tokenizer: the checkpoint's run's
`data.tokenizer` (bytes when it had none), or for a pretrained directory
the tokenizer saved in it, if any; `data.tokenizer=DIR` overrides both. temperature=0 is greedy decoding,
the same tokens in every mode. --json: no streaming; one JSON object
(the text, the ids, tokens/s) at the end.

The workers are started by the launcher as `tpctl train` starts them
(launch/local.py), reading a config.yaml written into a temporary directory
(kept, and named, if they fail); see training/generation.py for how the
batch, the logits and the KV cache are laid out per mode.

Exit status: 0 done, 1 a worker failed, 2 bad arguments or config (one line).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from tpctl.commands.options import integer, parse_options, text
from tpctl.errors import ConfigError, EXIT_OK, error, fail

# Model keys a checkpoint's model may be given differently here: they do not
# change its weights.
FREE_MODEL_KEYS = ("dropout", "plan")


def _temperature(key: str, value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        raise ConfigError(key, value, "expected a number >= 0 (0: greedy)") from None
    if not t >= 0:
        raise ConfigError(key, value, "expected a number >= 0 (0: greedy)")
    return t


OPTIONS = {
    "prompt": (None, text),
    "max_new_tokens": (64, integer(1, "expected a positive number of tokens")),
    "temperature": (0.8, _temperature),
    "top_k": (50, integer(0, "expected an integer >= 0 (0: the whole vocabulary)")),
    "seed": (0, integer(0, "expected an integer >= 0")),
}


def source_kind(source: Path) -> str:
    """"checkpoint" or "pretrained"; ConfigError naming SOURCE otherwise."""
    if not source.exists():
        raise ConfigError("SOURCE", str(source), "no such directory: expected a checkpoint (step_<N>) or a save_pretrained directory")
    if (source / "manifest.json").is_file():
        return "checkpoint"
    if (source / "config.json").is_file():
        return "pretrained"
    raise ConfigError("SOURCE", str(source), "neither a tpctl checkpoint (no manifest.json) nor a save_pretrained directory (no config.json)")


def _split_model(overrides: list[str]) -> tuple[list[str], list[str]]:
    model = [o for o in overrides if o.split("=", 1)[0].lstrip("+~").split(".")[0] == "model"]
    return model, [o for o in overrides if o not in model]


def compose(source: Path, kind: str, overrides: list[str]):
    """The run config of a generation: the layout and settings of the command
    line, the model of SOURCE. ConfigError on the first problem."""
    from omegaconf import OmegaConf

    from tpctl.config import compose_jobs, typed_model

    model_overrides, other = _split_model(overrides)
    if any("=" not in o or o.startswith("model=") for o in model_overrides):
        raise ConfigError("model", " ".join(model_overrides), "the model comes from SOURCE: only model.KEY=VALUE overrides apply")
    if kind == "checkpoint":
        from tpctl.checkpoint import CheckpointError, model_difference, verify

        try:
            manifest = verify(source)
        except CheckpointError as e:
            raise ConfigError("SOURCE", str(source), f"not a valid checkpoint: {e}") from None
        cfg = compose_jobs(other)[0]
        saved = manifest["model"]
        model = OmegaConf.merge(OmegaConf.create(saved), OmegaConf.from_dotlist([o[len("model."):] for o in model_overrides]))
        changed = model_difference(saved, OmegaConf.to_container(model))
        if changed and not all(any(d.startswith(f"model.{k}=") for k in FREE_MODEL_KEYS) for d in changed.split("; ")):
            raise ConfigError("model", " ".join(model_overrides), f"differs from the checkpoint's model: {changed}")
        cfg.model = typed_model(model)
        run_data = manifest.get("config", {}).get("data", {})
        if not any(o.split("=", 1)[0] == "data.tokenizer" for o in other):
            cfg.data.tokenizer = run_data.get("tokenizer")
        if "vocab_size" in run_data:
            cfg.data.vocab_size = run_data["vocab_size"]
        return cfg, str(source.resolve())
    try:
        arch = json.loads((source / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError("SOURCE", str(source), f"config.json is not a Hugging Face config: {e}") from None
    from tpctl.models.hf import check_arch

    try:
        check_arch(str(arch), ours=False)
    except ConfigError as e:
        raise ConfigError("SOURCE", str(source), f"model_type {arch!r}: {e.valid}") from None
    cfg = compose_jobs(["model=hf", f"model.arch={arch}", f"model.pretrained={source.resolve()}", *other, *model_overrides])[0]
    if cfg.data.tokenizer is None and any((source / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        cfg.data.tokenizer = str(source.resolve())
    cfg.data.vocab_size = 1  # no data is read; the model's vocabulary is the limit
    return cfg, None


def check(cfg, opts: dict) -> list[int]:
    """Validate the composed config for generation; return the prompt's ids."""
    from tpctl.config import validate

    validate(cfg, training=False)
    if opts["prompt"] is None:
        raise ConfigError("prompt", None, 'expected prompt="some text"')
    from tpctl.models import build_model
    from tpctl.data.tokenizer import Tokenizer
    from tpctl.training.generation import max_positions

    try:
        tokenizer = Tokenizer(cfg.data.tokenizer)
    except (OSError, ValueError) as e:
        raise ConfigError("data.tokenizer", cfg.data.tokenizer, f"cannot load it: {e}") from None
    ids = tokenizer.encode(opts["prompt"])
    if not ids:
        raise ConfigError("prompt", opts["prompt"], "encodes to no tokens: expected some text")
    limit = max_positions(build_model(cfg.model, cfg.seed, lazy=True))
    if limit is not None and len(ids) >= limit:  # not even one new token fits
        shown = opts["prompt"] if len(opts["prompt"]) <= 40 else opts["prompt"][:37] + "..."
        raise ConfigError("prompt", shown, f"{len(ids)} tokens, but the model has {limit} positions for the prompt and "
                          f"the new tokens: expected a prompt of at most {limit - 1} tokens")
    if limit is not None and len(ids) + opts["max_new_tokens"] > limit:
        raise ConfigError("max_new_tokens", opts["max_new_tokens"],
                          f"the prompt's {len(ids)} tokens plus the new ones exceed the model's {limit} positions: "
                          f"expected at most {limit - len(ids)}")
    return ids


def main(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(__doc__, end="")
        return EXIT_OK
    if not args or "=" in args[0] or args[0].startswith("-"):
        return fail("tpctl generate takes SOURCE first (a checkpoint or a save_pretrained directory), "
                      "then key=value settings (see tpctl generate --help)")
    from tpctl.launch.warm import allow_fork_start

    allow_fork_start()  # before validation runs a tensor op: the launch's server may fork from here
    source = Path(args[0])
    try:
        opts, overrides = parse_options(args[1:], OPTIONS, flags=("--json",))
        kind = source_kind(source)
        cfg, ckpt = compose(source, kind, overrides)
        ids = check(cfg, opts)
    except ConfigError as e:
        return fail(str(e))
    return run(cfg, ckpt, ids, opts)


def run(cfg, ckpt, ids: list[int], opts: dict) -> int:
    """Write the worker's inputs, start the workers, report."""
    from omegaconf import OmegaConf

    from tpctl.launch.generate_worker import OPTIONS as OPTIONS_FILE, RESULT
    from tpctl.launch.local import launch

    run_dir = Path(tempfile.mkdtemp(prefix="tpctl-generate-"))
    OmegaConf.save(OmegaConf.to_container(cfg, resolve=True), run_dir / "config.yaml")
    worker_opts = {k: opts[k] for k in OPTIONS} | {"prompt_ids": ids, "checkpoint": ckpt, "quiet": opts["json"]}
    (run_dir / OPTIONS_FILE).write_text(json.dumps(worker_opts))
    status = launch(cfg, run_dir, worker_module="tpctl.launch.generate_worker")
    if status > 128:  # interrupted: the launcher has said so, in one line
        shutil.rmtree(run_dir, ignore_errors=True)
        return status
    if status != EXIT_OK:
        error(f"generation failed; the workers' logs are in {run_dir}")
        return status
    result = json.loads((run_dir / RESULT).read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    if opts["json"]:
        print(json.dumps(result))
    else:
        print(f"tpctl: {result['tokens']} tokens in {result['time_s']:.2f}s ({result['tokens_per_s']:,.1f} tokens/s), "
              f"mode={cfg.mode} size={cfg.size}", file=sys.stderr)
    return EXIT_OK


