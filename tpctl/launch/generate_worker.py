"""One rank of `tpctl generate`; started by the launcher (launch/local.py)
as `python -u -m tpctl.launch.generate_worker <dir>/config.yaml`, like a
training worker. It reads the resolved config and, beside it, generate.json
(the prompt's ids and the sampling settings the command checked); builds and
rewrites the model as training does, loads the checkpoint into this layout
(or reads the pretrained shards), and decodes (training/generation.py).
Rank 0 streams the text to stdout as tokens come and writes generated.json.
The process starts and ends as a training rank's does (`worker.serve`)."""

from __future__ import annotations

if __name__ == "__main__":  # first of all (see `serve`)
    from tpctl.errors import quiet_interrupts

    quiet_interrupts()

import json
import logging
import time
from pathlib import Path

from .worker import serve, start_worker

OPTIONS = "generate.json"
RESULT = "generated.json"


def run(argv: list[str]) -> None:
    import torch.distributed as dist

    from tpctl import checkpoint
    from tpctl.data.tokenizer import Tokenizer
    from tpctl.training.build import build_run
    from tpctl.training.generation import TextStream, generate, stop_ids
    from tpctl.training.step import autocast

    config_path = Path(argv[0])
    run_dir = config_path.parent
    opts = json.loads((run_dir / OPTIONS).read_text())
    # Decoding feeds whole sequences: no sequence parallelism.
    cfg, par = start_worker(config_path, adjust=lambda layout: layout.replace(seq_parallel=False))
    # The text is the output: a dependency's warnings (a deprecation inside
    # transformers) go to logs/rank<r>.log, not between the user's tokens.
    logging.captureWarnings(True)
    mode, mesh, device = par.mode, par.mesh, par.mesh.device
    run = build_run(cfg, par, step=False, training=False)  # decoded only: no step, no training-only refusals
    model = run.model
    if opts.get("checkpoint"):
        path = Path(opts["checkpoint"])
        # The command has verified the checksums once; the ranks read.
        checkpoint.load(path, model, None, par, checkpoint.verify(path, checksums=False), cfg.seed)
    tokenizer = Tokenizer(cfg.data.tokenizer)
    stream = TextStream(tokenizer)
    quiet = opts.get("quiet", False)
    show = mesh.rank == 0 and not quiet

    def on_token(token: int) -> None:
        if show:
            print(stream.push(token), end="", flush=True)

    if show:
        print(opts["prompt"], end="", flush=True)
    started = time.perf_counter()
    with autocast(device, cfg.precision):
        new = generate(model, mode, opts["prompt_ids"], opts["max_new_tokens"], opts["temperature"], opts["top_k"],
                       opts["seed"], vocab_limit=tokenizer.vocab_size, stop=sorted(stop_ids(model, tokenizer)),
                       on_token=on_token, vocab_size=run.vocab_size)
    elapsed = time.perf_counter() - started
    if mesh.rank == 0:
        if show:
            print(stream.flush(), flush=True)
        result = {"prompt": opts["prompt"], "prompt_ids": opts["prompt_ids"], "ids": new,
                  "text": tokenizer.decode(new), "tokens": len(new), "time_s": elapsed,
                  "tokens_per_s": len(new) / elapsed if elapsed > 0 else None,
                  "mode": cfg.mode, "size": cfg.size}
        (run_dir / RESULT).write_text(json.dumps(result) + "\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    serve(run, argv)


if __name__ == "__main__":
    main()
