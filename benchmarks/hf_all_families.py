"""Every model type transformers builds as a causal LM, through model=hf:
built from tpctl's size keys with random weights (width 32, 4 heads, 2
layers, vocabulary 256), exported with save_hf (the family's stored names),
and read back with model.pretrained: the logits against from_pretrained's.

    python benchmarks/hf_all_families.py              # all of them, one process each (about an hour on 2 cores)
    python benchmarks/hf_all_families.py qwen2 opt    # some

Each family runs in its own process with a 4 GB address-space limit and a
time limit (some families' defaults are large), and prints one line: OK with
the largest logit difference, or FAIL with the stage and the first line of
the error.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import time


def one(family: str) -> str:
    import torch
    import transformers
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from tpctl.config import typed_model
    from tpctl.models import build_model, logits_of
    from tpctl.models.hf import save_hf

    transformers.logging.set_verbosity_error()
    stage = "config"
    try:
        cfg = typed_model(OmegaConf.create({"arch": family, "vocab_size": 256, "n_layer": 2, "n_head": 4, "n_embd": 32,
                                            "block_size": 64, "bias": None, "tie_embeddings": False}))
        stage = "build"
        model = build_model(cfg, seed=0).eval()
        stage = "save"
        directory = tempfile.mkdtemp(prefix=f"{family}-")
        save_hf(cfg, {name: p.detach() for name, p in model.named_parameters()}, directory)
        stage = "read"
        read = build_model(typed_model(OmegaConf.create({"arch": family, "pretrained": directory, "bias": None})),
                           seed=1).eval()
        ref = AutoModelForCausalLM.from_pretrained(directory).eval()
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            gap = (logits_of(read(ids)) - ref(ids, use_cache=False).logits).abs().max().item()
        return f"OK {family} {gap:.1e}"
    except Exception as e:  # a survey: every family gets its line
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        return f"FAIL {family} at {stage}: {type(e).__name__}: {first}"


def main(families: list[str]) -> None:
    from tpctl.models.hf import causal_lm_types

    if len(families) == 2 and families[0] == "--one":
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        print(one(families[1]), flush=True)
        return
    ok = 0
    for family in families or causal_lm_types():
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, __file__, "--one", family], capture_output=True, text=True, timeout=300)
            line = next((x for x in done.stdout.splitlines() if x.startswith(("OK", "FAIL"))),
                        f"FAIL {family}: exit {done.returncode} (out of memory?)")
        except subprocess.TimeoutExpired:
            line = f"FAIL {family}: over 300 s"
        ok += line.startswith("OK")
        print(f"{line} ({time.perf_counter() - start:.0f}s)", flush=True)
    print(f"{ok} of {len(families or causal_lm_types())} read back to from_pretrained's logits")


if __name__ == "__main__":
    main(sys.argv[1:])
