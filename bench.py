"""Benchmarks that print figures, every figure measured in the same run (medians of repetitions).

    python bench.py                 # everything
    python bench.py --only tree     # tree | allowed | load | decode | answers | retrieval
    python bench.py --only answers --max-new-tokens 32    # chyd.py's decoding flags, greedy by default
"""
from __future__ import annotations

import argparse
import contextlib
import io
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

from chyd import CliError, add_decoding_args, decode_options  # noqa: E402
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


def decode_ours(model, prompt: list[int], n: int) -> tuple[float, float, float]:
    """Greedy decoding of n tokens: tokens/s, and the median decode step and matvec floor in seconds.

    The floor (every weight matrix once, F.linear on a batch of 1, which no PyTorch implementation can
    beat) is timed between the steps, so that a shared machine's drift hits both alike.
    """
    from chyd import forward_hidden

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    x = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}
    model.setup_cache(1, len(prompt) + n + 1)
    logits = model.logits(forward_hidden(model, prompt, 0)[-1])
    steps, floors = [], []
    for i in range(n):
        t0 = time.perf_counter()
        logits = model.logits(forward_hidden(model, [int(logits.argmax())], len(prompt) + i)[-1])
        t1 = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(x[w.shape[1]], w)
        steps.append(t1 - t0)
        floors.append(time.perf_counter() - t1)
    return n / sum(steps), statistics.median(steps), statistics.median(floors)


def decode_transformers(hf, prompt: list[int], n: int) -> float:
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)  # prefill alone
    t1 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False)
    t2 = time.perf_counter()
    assert out.shape[1] == len(prompt) + n + 1
    return n / ((t2 - t1) - (t1 - t0))


def median_time(fn, reps: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth() -> float:
    """GB/s of torch sum over 1 GiB."""
    big = torch.ones(2**28, dtype=torch.float32)
    return 2**30 / median_time(lambda: big.sum(), reps=5) / 1e9


def dense_transformers(model):
    """transformers' LlamaForCausalLM holding our (dequantized, dense) weights: the same numbers, their code."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from model import FUSED, HF_LAYER_NAMES, HF_NAMES, rotate_half_rope_rows

    c = model.config
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                         head_dim=c.head_dim, rms_norm_eps=c.norm_eps, max_position_embeddings=c.max_position_embeddings,
                         rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                         tie_word_embeddings=c.tie_word_embeddings)
    ours = dict(model.named_parameters())
    state = {hf: ours[name] for hf, name in HF_NAMES.items() if name in ours}
    for i in range(c.n_layers):
        state.update({f"model.layers.{i}.{hf}": ours[f"layers.{i}.{name}"] for hf, name in HF_LAYER_NAMES.items()
                      if f"layers.{i}.{name}" in ours})
        for name, parts in FUSED.items():
            if f"layers.{i}.{name}" in ours:
                w = ours[f"layers.{i}.{name}"]
                sizes = ([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]
                         if "wqkv" in name else [c.intermediate_size] * 2)
                tensors = list(w.split(sizes))
                if "wqkv" in name:  # our interleaved RoPE pairs back to the checkpoint's rotate-half order
                    tensors[0], tensors[1] = rotate_half_rope_rows(tensors[0], c.n_heads), rotate_half_rope_rows(tensors[1], c.n_kv_heads)
                state.update({f"model.layers.{i}.{p}": t for p, t in zip(parts, tensors)})
    hf = LlamaForCausalLM(config).to(model.tok_embeddings.weight.dtype).eval()
    hf.load_state_dict(state, strict=False)
    return hf


def bench_decode(reps: int = 3, n: int = 128) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from checkpoints import smollm2_gguf
    from chyd import forward_hidden
    from model import load

    hf_logging.disable_progress_bar()  # its weight loading bar
    hf_logging.set_verbosity_error()  # and its advice on the dtype of a GGUF load, which would split the table
    gguf = smollm2_gguf()
    print(f"decode, SmolLM2-135M, greedy, batch 1, {n} new tokens, {torch.get_num_threads()} threads (medians of {reps})")
    print(f"read bandwidth (torch sum over 1 GiB): {read_bandwidth():.1f} GB/s")
    print("HF: transformers generate on the same dense weights; HF-GGUF: transformers loading the GGUF itself "
          "(it keeps the weights packed)")
    print("compiled: ours after model.compile_decode_step() (chyd.py --compile); compile s: its first step")
    print(f"{'dtype':>9} {'ours tok/s':>11} {'HF tok/s':>9} {'ours/HF':>8} {'HF-GGUF':>8} {'floor ms':>9} {'step ms':>8} "
          f"{'step/floor':>10} {'compiled tok/s':>14} {'ours/HF':>8} {'step/floor':>10} {'compile s':>9} "
          f"{'prefill tok/s':>13} {'k=4 pass':>9} {'k=8 pass':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        model, tok = load(str(gguf), dtype=dtype)
        with contextlib.redirect_stderr(io.StringIO()):  # its GGUF reader draws a progress bar that no setting turns off
            hf_gguf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()
        hf = dense_transformers(model)
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a long story about a pilot."}]))
        with torch.inference_mode():
            model.compile_decode_step()
            compiled_layers = model.compiled_layers
            t0 = time.perf_counter()
            decode_ours(model, prompt, 1)
            compile_s = time.perf_counter() - t0
            runs, runs_compiled, theirs, theirs_gguf = [], [], [], []
            for _ in range(reps):  # in turn, so that drift hits every decoder alike
                model.compiled_layers = None
                runs.append(decode_ours(model, prompt, n))
                model.compiled_layers = compiled_layers
                runs_compiled.append(decode_ours(model, prompt, n))
                theirs.append(decode_transformers(hf, prompt, n))
                theirs_gguf.append(decode_transformers(hf_gguf, prompt, n))
            model.compiled_layers = None
            ours, step, floor = sorted(runs)[reps // 2]  # the median run by tokens/s
            compiled, step_c, floor_c = sorted(runs_compiled)[reps // 2]
            theirs, theirs_gguf = statistics.median(theirs), statistics.median(theirs_gguf)
            long_prompt = (prompt * 40)[:1000]
            model.setup_cache(1, 1100)
            prefill_s = median_time(lambda: forward_hidden(model, long_prompt, 0), reps=3)
            # a k-token verification pass over a cached prefix, against a 1-token step at the same place
            kpass = {k: median_time(lambda k=k: model.logits(forward_hidden(model, long_prompt[500:500 + k], 500)), reps=7)
                     for k in (1, 4, 8)}
        name = str(dtype).split(".")[1]
        print(f"{name:>9} {ours:>11.1f} {theirs:>9.1f} {ours / theirs:>8.2f} {theirs_gguf:>8.1f} {floor * 1e3:>9.1f} {step * 1e3:>8.1f} "
              f"{step / floor:>10.2f} {compiled:>14.1f} {compiled / theirs:>8.2f} {step_c / floor_c:>10.2f} {compile_s:>9.0f} "
              f"{1000 / prefill_s:>13.0f} {kpass[4] / kpass[1]:>8.2f}x {kpass[8] / kpass[1]:>8.2f}x")
        del model, hf, hf_gguf


def random_model(cfg, dtype: torch.dtype):
    """Our model with random weights (norm weights 1): a step costs what it costs with the real checkpoint."""
    from model import build_on_meta

    model = build_on_meta(cfg)
    for name, p in list(model.named_parameters()):
        module, _, attr = name.rpartition(".")
        w = torch.ones(p.shape, dtype=dtype) if name.endswith("norm.weight") else torch.empty(p.shape, dtype=dtype).uniform_(-0.03, 0.03)
        model.get_submodule(module)._parameters[attr] = torch.nn.Parameter(w, requires_grad=False)
    if cfg.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


def bench_large_layers(n_layers: int = 8, n: int = 8) -> None:
    """The eager step against its floor at the layer shapes of a model chyd is for: the work around the matrix
    products is some 40 ops a layer whatever the model, the products grow with it."""
    from model import ModelConfig

    cfg = ModelConfig(model_type="qwen3", vocab_size=151936, dim=2560, n_layers=n_layers, n_heads=32, n_kv_heads=8,
                      head_dim=128, intermediate_size=9728, norm_eps=1e-6, rope_theta=5e6, qk_norm=True,
                      tie_word_embeddings=True)
    print(f"eager decode at Qwen3-4B's shapes: {n_layers} of its 36 layers and its output projection, random weights, "
          f"batch 1, {n} steps after 30 tokens")
    print(f"{'dtype':>9} {'floor ms':>9} {'step ms':>8} {'step/floor':>10} {'ms a layer over the floor':>26}")
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model(cfg, dtype)
        with torch.inference_mode():
            _, step, floor = decode_ours(model, list(range(1000, 1030)), n)
        name = str(dtype).split(".")[1]
        print(f"{name:>9} {floor * 1e3:>9.1f} {step * 1e3:>8.1f} {step / floor:>10.2f} {(step - floor) / n_layers * 1e3:>26.2f}")
        del model


def bench_answers(model_name: str, base) -> None:
    """On the sample set: passes per token and seconds per answer for free decoding and CHyD, with and without
    drafts (speculation inside quotes, prompt lookup outside), eager and compiled, in turn per example.
    base: the DecodeOptions of the command line, which each row changes where it says."""
    import json
    from dataclasses import replace

    from chyd import generate
    from constraint import Constraint, token_classes
    from model import load

    model, tok = load(model_name)
    data = [json.loads(l) for l in (ROOT / "data" / "sample_eval.jsonl").read_text().splitlines()]
    how = "greedy" if base.temperature == 0 else f"temperature {base.temperature}, top-p {base.top_p}, seed {base.seed}"
    print(f"answers on data/sample_eval.jsonl ({len(data)} examples), {model_name} {model.tok_embeddings.weight.dtype}, "
          f"{how}, {base.max_new_tokens} new tokens at most")
    print(f"{'decoder':>22} {'s/answer':>9} {'tokens/answer':>13} {'passes/token':>12} {'constraint ms/token':>19}")
    configs = [("free", dict(constrained=False, quote_first=False)),
               ("free + lookup", dict(constrained=False, quote_first=False, lookup=True)),
               ("CHyD", dict(quote_first=True, speculate=False)),
               ("CHyD + speculation", dict(quote_first=True, speculate=True)),
               ("CHyD + spec. + lookup", dict(quote_first=True, speculate=True, lookup=True)),
               ("free, compiled", dict(constrained=False, quote_first=False)),
               ("CHyD + spec., compiled", dict(quote_first=True, speculate=True))]
    model.compile_decode_step()
    compiled_layers = model.compiled_layers
    generate(model, tok, data[0]["question"], data[0]["contexts"], base, max_new_tokens=2)  # compiles
    totals = {name: [0.0, 0, 0, 0.0] for name, _ in configs}  # wall s, tokens, passes, constraint s
    for ex in data:
        for name, kw in configs:  # in turn, so that drift hits every decoder alike
            model.compiled_layers = compiled_layers if name.endswith("compiled") else None
            t0 = time.perf_counter()
            r = generate(model, tok, ex["question"], ex["contexts"], replace(base, **kw))
            total = totals[name]
            total[0] += time.perf_counter() - t0
            total[1] += len(r.tokens)
            total[2] += r.forward_passes
            if kw.get("constrained", True):  # the constraint's own work along the same tokens, isolated
                c = Constraint(token_classes(tok, model.config.vocab_size), ex["contexts"])
                logits = torch.randn(model.config.vocab_size)
                t0 = time.perf_counter()
                for token in r.tokens:
                    if c.forced() is None:
                        c.rows()
                        c.mask(logits)
                    c.advance(token)
                total[3] += time.perf_counter() - t0
    for name, (wall, n_tokens, passes, constraint_s) in totals.items():
        per_token = f"{constraint_s / n_tokens * 1e3:.2f}" if constraint_s else "-"
        print(f"{name:>22} {wall / len(data):>9.2f} {n_tokens / len(data):>13.1f} {passes / n_tokens:>12.2f} {per_token:>19}")


def bench_retrieval(n_bytes: int = 3_000_000, page_bytes: int = 3000) -> None:
    """Index a 1,000-page corpus (generated, as corpus_text) and time queries: the sample set's questions."""
    import json
    import os
    import tempfile

    from retrieve import Document, Index

    text = corpus_text(n_bytes, seed=5).decode()
    docs = [Document("corpus.txt", n, text[i:i + page_bytes]) for n, i in enumerate(range(0, len(text), page_bytes), 1)]
    questions = [json.loads(l)["question"] for l in (ROOT / "data" / "sample_eval.jsonl").read_text().splitlines()]
    with tempfile.TemporaryDirectory() as cache:
        old, os.environ["CHYD_CACHE"] = os.environ.get("CHYD_CACHE"), cache
        try:
            index = Index(docs)
            index.vectors
            t0 = time.perf_counter()
            again = Index(docs)
            again.vectors
            reread_s = time.perf_counter() - t0
        finally:
            os.environ.pop("CHYD_CACHE") if old is None else os.environ.update(CHYD_CACHE=old)
        size = {p.name: sum(f.stat().st_size for f in ([p] if p.is_file() else p.rglob("*"))) / 2**20
                for p in index.folder.iterdir()}
        print(f"retrieval over {len(docs)} pages of generated text ({n_bytes / 1e6:.1f} MB), {len(index.chunks)} chunks "
              f"of {index.size} tokens ({index.overlap} overlap), {torch.get_num_threads()} threads")
        print(f"index s: chunking {index.built['chunks.json']:.1f}, BM25 {index.built['bm25']:.1f}, "
              f"dense {index.built['dense.safetensors']:.1f} ({len(index.chunks) / index.built['dense.safetensors']:.0f} chunks/s); "
              f"read back {reread_s:.2f} s")
        print("on disk MiB: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(size.items())))
        print(f"{'retriever':>9} {'p50 ms':>7} {'p95 ms':>7}  (top 5, {len(questions)} questions; dense and hybrid embed the question)")
        for retriever in ("bm25", "dense", "hybrid"):
            index.search(questions[0], 5, retriever)  # warm-up
            times = []
            for q in questions:
                t0 = time.perf_counter()
                index.search(q, 5, retriever)
                times.append((time.perf_counter() - t0) * 1e3)
            times.sort()
            print(f"{retriever:>9} {statistics.median(times):>7.1f} {times[int(0.95 * (len(times) - 1))]:>7.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["tree", "allowed", "load", "decode", "answers", "retrieval"])
    p.add_argument("--model", default="smollm2", help="the model of the answers rows")
    add_decoding_args(p)  # the answers rows start from these, as chyd.py's answers do
    p.set_defaults(temperature=0.0)
    args = p.parse_args()
    try:
        options = decode_options(args)
    except CliError as e:
        p.error(str(e))
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
        bench_large_layers()
    if args.only in (None, "answers"):
        bench_answers(args.model, options)
    if args.only in (None, "retrieval"):
        bench_retrieval()


if __name__ == "__main__":
    main()
