"""Benchmarks that print figures, every figure measured in the same run (medians of repetitions).

    python bench.py                 # everything
    python bench.py --only tree     # tree | allowed | load | decode
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from suffix_tree import SuffixTree, TokenTrie, allowed_tokens  # noqa: E402


def corpus_text(n_bytes: int, seed: int = 0) -> bytes:
    """Manual-like text: the sample passages' words in a random order (repetitive, as real manuals are)."""
    words = " ".join((ROOT / "data" / f).read_text() for f in ("manual.txt", "leaflet.txt")).split()
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out).encode()[:n_bytes]


def bench_tree() -> None:
    print("suffix tree build (Ukkonen, pure Python)")
    print(f"{'input':>8} {'time s':>8} {'peak MiB':>9} {'nodes':>9} {'steps/byte':>10} {'time ratio':>10}")
    last = None
    for n in (10_000, 100_000, 1_000_000):
        text = corpus_text(n)
        tracemalloc.start()
        t0 = time.perf_counter()
        tree = SuffixTree([text[: n // 2], text[n // 2:]])
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        ratio = f"{dt / last:.1f}x" if last else ""
        print(f"{n:>8} {dt:>8.3f} {peak:>9.1f} {len(tree.start):>9} {tree.steps / n:>10.2f} {ratio:>10}")
        last = dt
        del tree


def quotable_vocab(token_bytes: list[bytes]) -> list[bytes]:
    return [b for b in token_bytes if b and b"[" not in b and b"]" not in b]


def synthetic_vocab(base: list[bytes], size: int, seed: int = 0) -> list[bytes]:
    """A vocabulary of `size` tokens: the base one plus merges of two of its tokens, as compounds or word pairs."""
    rng = random.Random(seed)
    words = [b for b in base if len(b) > 1]
    seen = set(base)
    out = list(base)
    while len(out) < size:
        second = rng.choice(words)
        b = rng.choice(words) + (second.lstrip() if rng.random() < 0.5 else second)
        if b not in seen:
            seen.add(b)
            out.append(b)
    return out


def bench_allowed(token_bytes: list[bytes]) -> None:
    contexts = [corpus_text(1000, seed=s) for s in range(5)]
    print("allowed_tokens over quotes walked through 5 contexts of 1,000 bytes")
    print(f"{'vocabulary':>12} {'trie s':>7} {'root ms':>8} {'median ms':>10} {'p99 ms':>8} {'steps':>6} {'mean allowed':>12}")
    for name, vocab in (("SmolLM2", token_bytes), ("150k", synthetic_vocab(quotable_vocab(token_bytes), 150_000))):
        t0 = time.perf_counter()
        trie = TokenTrie(vocab, [i for i, b in enumerate(vocab) if b and b"[" not in b and b"]" not in b])
        trie_s = time.perf_counter() - t0
        tree = SuffixTree(contexts)
        t0 = time.perf_counter()
        allowed_tokens(tree.root(), trie)
        root_ms = (time.perf_counter() - t0) * 1e3
        rng = random.Random(1)
        times, sizes = [], []
        for _ in range(40):  # a quote: start anywhere, then follow the context a token at a time
            c = rng.choice(contexts)
            at = rng.randrange(len(c) - 50)
            cur = tree.root().step(c[at:at + 1])
            at += 1
            for _ in range(12):
                t0 = time.perf_counter()
                ids = allowed_tokens(cur, trie)
                times.append((time.perf_counter() - t0) * 1e3)
                sizes.append(len(ids))
                nxt = [i for i in ids.tolist() if c.startswith(vocab[i], at)]
                if not nxt:
                    break
                b = max((vocab[i] for i in nxt), key=len)  # the longest token that follows this occurrence
                cur, at = cur.step(b), at + len(b)
        times.sort()
        print(f"{name:>12} {trie_s:>7.2f} {root_ms:>8.1f} {statistics.median(times):>10.3f} "
              f"{times[int(0.99 * (len(times) - 1))]:>8.3f} {len(times):>6} {statistics.mean(sizes):>12.1f}")


LOAD_SNIPPET = """
import resource, sys, time
sys.path.insert(0, {root!r})
import torch, model
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
m, tok = model.load("smollm2")
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
size = sum(p.numel() * p.element_size() for p in m.parameters())
print(dt, base / 1024, peak / 1024, size / 2**20)
"""


def bench_load() -> None:
    out = subprocess.run([sys.executable, "-c", LOAD_SNIPPET.format(root=str(ROOT))], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    dt, base, peak, size = map(float, out.stdout.split())
    print(f"load smollm2 (GGUF, fp32): {dt:.1f} s; peak RSS {peak:.0f} MiB = {base:.0f} MiB before loading "
          f"+ {peak - base:.0f} MiB for {size:.0f} MiB of weights ({(peak - base) / size:.2f}x)")


def decode_ours(model, prompt: list[int], n: int) -> float:
    from chyd import decode_one_token, prefill

    model.setup_cache(1, len(prompt) + n + 1)
    logits = prefill(model, prompt)
    t0 = time.perf_counter()
    for i in range(n):
        logits = decode_one_token(model, int(logits.argmax()), len(prompt) + i)
    return n / (time.perf_counter() - t0)


def decode_transformers(hf, prompt: list[int], n: int) -> float:
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)  # prefill alone
    t1 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False)
    t2 = time.perf_counter()
    assert out.shape[1] == len(prompt) + n + 1
    return n / ((t2 - t1) - (t1 - t0))


def bench_decode(reps: int = 3, n: int = 128) -> None:
    from transformers import AutoModelForCausalLM

    from model import load, smollm2_gguf

    gguf = smollm2_gguf()
    print(f"decode, SmolLM2-135M, greedy, batch 1, {n} new tokens, {torch.get_num_threads()} threads (median of {reps})")
    print(f"{'dtype':>9} {'ours tok/s':>11} {'transformers tok/s':>19} {'ratio':>6}")
    for dtype in (torch.float32, torch.bfloat16):
        model, tok = load(str(gguf), dtype=dtype)
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a long story about a pilot."}]))
        with torch.inference_mode():
            ours = statistics.median(decode_ours(model, prompt, n) for _ in range(reps))
            theirs = statistics.median(decode_transformers(hf, prompt, n) for _ in range(reps))
        print(f"{str(dtype).split('.')[1]:>9} {ours:>11.1f} {theirs:>19.1f} {ours / theirs:>6.2f}")
        del model, hf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--only", choices=["tree", "allowed", "load", "decode"])
    args = p.parse_args()
    if args.only in (None, "load"):
        bench_load()
    if args.only in (None, "tree"):
        bench_tree()
    if args.only in (None, "allowed"):
        from model import load

        _, tok = load("smollm2")
        bench_allowed(tok.token_bytes)
    if args.only in (None, "decode"):
        bench_decode()


if __name__ == "__main__":
    main()
