"""`tpctl prepare-data` throughput (tokens/s) with 1 and 2 workers against the
usual Hugging Face path, `datasets.load_dataset("json") + map(batched=True,
num_proc=2)`, with the same tokenizer on the same generated corpus.

    python benchmarks/prepare_data.py                 # ~50 MB of jsonl, a 32k BPE trained here
    python benchmarks/prepare_data.py --mb 10 --keep /tmp/bench

The corpus: the Python standard library's sources cut into ~4 KB documents,
cycled until --mb megabytes, in 8 .jsonl files (nothing is downloaded). The
tokenizer: a byte-level BPE trained on the first 4 MB with `tokenizers`,
saved as a transformers tokenizer directory. Every side runs one core per
process (TOKENIZERS_PARALLELISM=false), so "2 workers" means 2 cores for all.
Both sides append EOS to every document; the token counts are checked equal.
The datasets side is timed as load (json -> arrow) + map, and map alone.
Beside wall-clock tokens/s, the CPU seconds of this process and its
(finished) worker processes: on a shared machine the wall clock measures the
neighbours too, tokens per CPU-second measures the work.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_corpus(directory: Path, mb: float, files: int = 8) -> list[Path]:
    from tpctl.data.corpora import stdlib_files

    target = int(mb * 1e6)
    docs, total = [], 0
    sources = stdlib_files(1 << 40)
    while total < target:
        for p in sources:
            text = p.read_text(encoding="utf-8", errors="replace")
            for a in range(0, len(text), 4096):
                doc = text[a:a + 4096]
                docs.append(doc)
                total += len(doc.encode())
                if total >= target:
                    break
            if total >= target:
                break
    paths = [directory / f"part-{k:02d}.jsonl" for k in range(files)]
    per = -(-len(docs) // files)
    for k, path in enumerate(paths):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs[k * per:(k + 1) * per])
    return paths


def make_tokenizer(directory: Path, corpus: list[Path], vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def sample():
        seen = 0
        for p in corpus:
            with open(p, encoding="utf-8") as f:
                for line in f:
                    yield json.loads(line)["text"]
                    seen += len(line)
                    if seen > 4_000_000:
                        return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample(), trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(directory)
    return str(directory)


def cpu_seconds() -> float:
    """User + system CPU time of this process and its reaped children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_prepare(corpus_dir: Path, out: Path, tokenizer: str, workers: int) -> tuple[float, int]:
    from tpctl.data.prepare import prepare

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    index = prepare([str(corpus_dir)], out, tokenizer, workers=workers).index
    return time.perf_counter() - t0, index["tokens"]["train"] + index["tokens"]["val"]


def run_datasets(files: list[Path], cache: Path, tokenizer_dir: str, num_proc: int) -> tuple[float, float, int]:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    eos = tokenizer.eos_token_id
    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", cache_dir=str(cache))
    t1 = time.perf_counter()

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eos] for x in ids]}

    out = ds.map(tokenize, batched=True, num_proc=num_proc, remove_columns=ds.column_names)
    t2 = time.perf_counter()
    n = sum(len(x) for x in out.with_format("arrow")["ids"].to_pylist())
    return t2 - t0, t2 - t1, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=50.0, help="corpus size in MB (default 50)")
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--keep", help="work in this directory and keep it (default: a temp dir, removed)")
    args = ap.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tpctl-bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        corpus_dir = work / "corpus"
        if not corpus_dir.is_dir():
            corpus_dir.mkdir()
            make_corpus(corpus_dir, args.mb)
        files = sorted(corpus_dir.glob("*.jsonl"))
        mb = sum(f.stat().st_size for f in files) / 1e6
        tok_dir = work / "tokenizer"
        tokenizer = str(tok_dir) if (tok_dir / "tokenizer.json").is_file() else make_tokenizer(tok_dir, files, args.vocab)
        print(f"corpus: {len(files)} jsonl files, {mb:.1f} MB; tokenizer: byte-level BPE, {args.vocab} ids; "
              f"cores: {len(os.sched_getaffinity(0))}; load average {os.getloadavg()[0]:.1f}", flush=True)

        rows = []  # (name, wall seconds, tokens, CPU seconds or None)
        for w in (1, 2):
            c0 = cpu_seconds()
            s, n = run_prepare(corpus_dir, work / f"out-{w}", tokenizer, w)
            rows.append((f"tpctl prepare-data workers={w}", s, n, cpu_seconds() - c0))
            print(f"  {rows[-1][0]}: {s:.1f}s", flush=True)
        c0 = cpu_seconds()
        total, map_only, n = run_datasets(files, work / "hf-cache", tokenizer, 2)
        rows.append(("datasets load_dataset+map num_proc=2", total, n, cpu_seconds() - c0))
        rows.append(("datasets map num_proc=2 (map alone)", map_only, n, None))
        print(f"  datasets: {total:.1f}s ({map_only:.1f}s map)", flush=True)

        counts = {r[2] for r in rows}
        assert len(counts) == 1, f"the sides disagree on the token count: {rows}"
        base, base_cpu = rows[2][1], rows[2][3]
        print(f"\n{'':40s} {'seconds':>8s} {'tokens/s':>10s} {'MB/s':>6s} {'vs datasets':>11s}"
              f" {'CPU s':>7s} {'tokens/CPU-s':>12s} {'vs datasets':>11s}")
        for name, s, n, cpu in rows:
            per_cpu = f"{cpu:7.1f} {n / cpu:12,.0f} {base_cpu / cpu:10.2f}x" if cpu else ""
            print(f"{name:40s} {s:8.1f} {n / s:10,.0f} {mb / s:6.2f} {base / s:10.2f}x {per_cpu}")
        print(f"\n{n:,} tokens each (documents joined by EOS); load average now {os.getloadavg()[0]:.1f}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
