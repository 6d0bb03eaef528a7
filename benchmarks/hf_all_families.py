"""Every model type transformers builds as a causal LM, through model=hf:
built from tpctl's size keys with random weights (width 32, 4 heads, 2
layers, vocabulary 256), exported with save_hf (the family's stored names),
and read back with model.pretrained: the logits against from_pretrained's.

    python benchmarks/hf_all_families.py              # all of them
    python benchmarks/hf_all_families.py qwen2 opt    # some

Families run 20 to a process with a 6 GB address-space limit (some
families' defaults are large; a family that kills its process, or runs out
of memory, is retried alone), and each prints one line: OK with the largest
logit difference, or FAIL with the stage and the first line of the error.
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


def run(families: list[str], timeout_s: float) -> dict[str, str]:
    """{family: its line}, from one process for all of `families`; those
    it did not reach (it died, or ran out of time) are left out."""
    lines: dict[str, str] = {}
    try:
        done = subprocess.run([sys.executable, __file__, "--in-process", *families], capture_output=True, text=True,
                              timeout=timeout_s)
        out = done.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    for line in out.splitlines():
        if line.startswith(("OK ", "FAIL ")):
            lines[line.split()[1]] = line
    return lines


def main(families: list[str]) -> None:
    from tpctl.models.hf import causal_lm_types

    if families and families[0] == "--in-process":
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a family whose defaults are huge fails alone
        for family in families[1:]:
            print(one(family), flush=True)
        return
    families = families or list(causal_lm_types())
    start = time.perf_counter()
    # Chunks of families share one process (imports cost seconds); a
    # family that kills its process, or runs out of the memory the others
    # left it, is retried alone.
    lines: dict[str, str] = {}
    for i in range(0, len(families), 20):
        lines.update(run(families[i:i + 20], 120 * 20))
    for family in families:
        if family not in lines or any(m in lines[family] for m in ("can't allocate memory", "Cannot allocate memory")):
            lines.update(run([family], 300))
        print(lines.get(family, f"FAIL {family}: its process died (out of memory?) or ran over 300 s"), flush=True)
    ok = sum(line.startswith("OK") for line in lines.values())
    print(f"{ok} of {len(families)} read back to from_pretrained's logits ({time.perf_counter() - start:.0f}s)")


if __name__ == "__main__":
    main(sys.argv[1:])
