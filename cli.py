"""The command lines' shared kit: the flags that chyd.py, eval.py, trace.py and bench.py share, their checks,
and one error rule (bad input is one line on stderr and exit 2, never a traceback).

The decoding flags take their defaults from the DecodeOptions they are given (chyd.py's), so a command with
no flags decodes exactly as the library's DecodeOptions() does.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from checkpoints import QUANTIZATIONS, choose_dtype, load
from quantize import Int8Linear
from retrieve import CHUNK_OVERLAP, CHUNK_TOKENS, RERANK_POOL, RERANK_WORDS, RETRIEVERS

# every core but one: beside one busy neighbour, threads that share a core wait for each other at every product
# (two threads on two cores: 30x slower products; one: unchanged; README, Speed)
THREADS = max(1, torch.get_num_threads() - 1)
RERANKER = "smollm2"  # --rerank's default: the 1.5B's gold phrase quoted from retrieved chunks 0.684 to 0.737 (README)
BATCH_SIZE = {"cpu": 8, "cuda": 32}  # answers decoded together; CPU: bench.py --only batch here; CUDA: not measured


class CliError(Exception):
    pass


USER_ERRORS = (CliError, ValueError, FileNotFoundError, RuntimeError)  # said in one line: what a user's input can cause


def run_cli(prog: str, command, argv) -> int:
    """command(argv) under the command line's rule: bad input is one line on stderr and exit 2, never a traceback."""
    try:
        return command(argv)
    except USER_ERRORS as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise CliError(message)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags that choose and prepare the model."""
    p.add_argument("--model", default="smollm2", help="alias, hub repo id, local folder or .gguf file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="the weights' dtype (default: the faster of float32 and bfloat16 products here, measured)")
    p.add_argument("--quantize", choices=QUANTIZATIONS,
                   help="int8: int8 weights for every linear layer (a quarter of fp32's bytes a step) and, on a CPU, int8 x int8 products")
    p.add_argument("--compile", action="store_true",
                   help="compile the one-token step (torch.compile; one to two minutes the first time, then cached)")
    p.add_argument("--threads", type=int, metavar="N", help=f"CPU threads (default: {THREADS}, README, Speed)")


def load_model(args):
    """The model and tokenizer that the flags of add_model_args name, compiled if asked; says on stderr which
    weights it chose and why."""
    check_at_least_one(args, "threads")
    torch.set_num_threads(args.threads or THREADS)
    model, tok = load(args.model, dtype=getattr(torch, args.dtype) if args.dtype else None, device=args.device,
                      quantize=args.quantize)
    if args.compile:
        for m in model.modules():
            if isinstance(m, Int8Linear):
                m.unpack()  # the compiled step reads plain int8 weights
        model.compile_decode_step()
    e = engine(model, args)
    threads = f"{e['threads']} thread{'s' if e['threads'] != 1 else ''}"
    print(f"chyd: weights {e['weights']} ({e['why']}), {threads}", file=sys.stderr)
    return model, tok


def engine(model, args) -> dict:
    """What the products run on: the weights' dtype (int8: with its float parts' dtype), why, and the threads."""
    dtype = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
    why = "--dtype" if args.dtype else choose_dtype(model.config, args.device, args.quantize)[1]
    return {"weights": f"int8 + {dtype}" if args.quantize else dtype, "why": why, "threads": torch.get_num_threads()}


def add_decoding_args(p: argparse.ArgumentParser, d, prompts=None) -> None:
    """The flags of DecodeOptions, each defaulting to d's value (d: a chyd.DecodeOptions); --prompt where the
    command answers with chyd's prompt (prompts: chyd.PROMPTS)."""
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--greedy", action="store_true", help="temperature 0")
    p.add_argument("--trigger-bias", type=float, default=d.trigger_bias, help="added to the logits of `[` tokens outside quotes")
    p.add_argument("--quote-first", action=argparse.BooleanOptionalAction, default=d.quote_first,
                   help="open the answer with a quote unless the model prefers 'No answer' (default: the model's own, "
                        "chyd.model_defaults)")
    p.add_argument("--no-answer-above", type=float, default=d.no_answer_above, metavar="P",
                   help="with quote-first, answer 'No answer' where the model gives it a probability above P "
                        "(default: the model's own, chyd.model_defaults)")
    p.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=d.speculate,
                   help="inside a quote, draft its continuation from the passage and verify it in one pass")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=d.lookup,
                   help="outside quotes, draft what follows the answer's last tokens in a passage and verify it in one pass")
    p.add_argument("--whole-words", action=argparse.BooleanOptionalAction, default=d.whole_words,
                   help="a quote starts and ends on word boundaries of the passage and holds a word of two letters or "
                        "digits: no [1], [,] or [ressure]")
    p.add_argument("--engine", choices=["chyd", "llguidance"], default=d.engine,
                   help="llguidance: the mask from llguidance's matcher over the CHyD grammar (no speculation), to "
                        "check ours against")
    p.add_argument("--no-repeat-ngram", type=int, default=d.no_repeat_ngram, metavar="N",
                   help="outside quotes, never repeat an n-gram of the answer (0: off)")
    p.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty, metavar="P",
                   help="outside quotes, divide the logits of the answer's tokens by P (1: off)")
    p.add_argument("--quote-search", type=int, default=d.quote_search, metavar="N",
                   help="greedy only: when a quote opens, a beam of width N over the passages' spans chooses the whole "
                        "quote by the model's length-normalised log-probability, less a quarter of it after the prompt "
                        "without its question (0: off; default: the model's own under --greedy, chyd.model_defaults)")
    if prompts:
        p.add_argument("--prompt", choices=list(prompts), default=d.prompt,
                       help="the instruction and worked examples: maintenance (a manual's prose, a sentence around "
                            "its quote) or reference (command lists and option tables, the shortest phrase quoted first)")


def decode_options(args, d):
    """d (a chyd.DecodeOptions) with the values of add_decoding_args' flags, checked (by DecodeOptions: its message
    names the field, said here with the flag's name)."""
    temperature = 0.0 if args.greedy else args.temperature
    try:
        o = replace(d, temperature=temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed,
                    trigger_bias=args.trigger_bias, quote_first=args.quote_first,
                    no_answer_above=args.no_answer_above, speculate=args.speculate,
                    lookup=args.lookup, whole_words=args.whole_words, no_repeat_ngram=args.no_repeat_ngram,
                    repetition_penalty=args.repetition_penalty, engine=args.engine, quote_search=args.quote_search,
                    prompt=getattr(args, "prompt", d.prompt))
    except ValueError as e:
        field, rule = str(e).split(" ", 1)
        raise CliError(f"--{field.replace('_', '-')} {rule}") from None
    if o.quote_search and o.temperature != 0:
        raise CliError("--quote-search chooses quotes greedily: give --greedy (or --temperature 0)")
    return o


def add_server_args(p: argparse.ArgumentParser, concurrency: bool = True) -> None:
    """--server and --served-model; with concurrency (commands that send many requests), --concurrency."""
    p.add_argument("--server", metavar="URL", help="decode on an OpenAI-compatible server (vLLM with the guidance backend, "
                   "server.py); --model names the checkpoint whose tokenizer builds the prompt")
    p.add_argument("--served-model", metavar="NAME", help="the server's name of the model (default: the one it serves)")
    if concurrency:
        p.add_argument("--concurrency", type=int, default=8, metavar="N", help="with --server: requests in flight")


def check_server_args(args) -> None:
    if args.served_model and not args.server:
        raise CliError("--served-model names the model a server serves: give --server URL too")
    if getattr(args, "concurrency", 1) < 1:  # chyd.py sends one request at a time
        raise CliError(f"--concurrency must be >= 1, got {args.concurrency}")


def check_at_least_one(args, *names: str) -> None:
    """Each of args' counts named (attribute names: "top_k" is --top-k) that was given is 1 or more."""
    for name in names:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def check_output_file(flag: str, path: str | None) -> None:
    """A file the command will write: said now, before the work, if it is a folder or its folder does not exist."""
    if path is None:
        return
    if Path(path).is_dir():
        raise CliError(f"{flag} {path} is a folder; give a file name")
    if not Path(path).parent.is_dir():
        raise CliError(f"{flag} {path}: the folder {Path(path).parent} does not exist")


def add_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, metavar="B",
                   help=f"questions decoded together (default: {BATCH_SIZE['cpu']} on CPU, {BATCH_SIZE['cuda']} on CUDA)")


def batch_size(args) -> int:
    """--batch-size, or the default for --device."""
    check_at_least_one(args, "batch_size")
    return BATCH_SIZE.get(args.device.split(":")[0], 1) if args.batch_size is None else args.batch_size


def add_retrieval_args(p: argparse.ArgumentParser, retriever: bool = True) -> None:
    """How documents are cut into chunks and how many are retrieved; with retriever, by what (trace.py retrieves
    by cosine alone, as its paper does)."""
    p.add_argument("--top-k", type=int, default=5,
                   help="chunks retrieved for a question, shown best last, next to it (chyd.py: when the documents do not "
                        "fit the prompt; 0: never)")
    if retriever:
        p.add_argument("--retriever", choices=RETRIEVERS, default="hybrid",
                       help="BM25, all-MiniLM-L6-v2 vectors, or both fused by reciprocal rank")
        p.add_argument("--rerank", metavar="MODEL", default=RERANKER, type=lambda s: None if s == "none" else s,
                       help=f"order the retriever's top {RERANK_POOL} chunks and BM25's top {RERANK_WORDS} by how likely "
                            "each makes the question under "
                            "MODEL (an alias, hub id, folder or .gguf; int8 weights, or the answering model's own when "
                            "it is the same), then show the top k (default: %(default)s; none: the retriever's order)")
    p.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS, help="chunk size, in the embedder's tokens")
    p.add_argument("--chunk-overlap", type=int, default=CHUNK_OVERLAP, help="tokens a chunk shares with the one before")


def check_retrieval_args(args) -> None:
    if args.top_k < 0:
        raise CliError(f"--top-k must be >= 0, got {args.top_k}")
    check_at_least_one(args, "chunk_tokens")
    if not 0 <= args.chunk_overlap < args.chunk_tokens:
        raise CliError(f"--chunk-overlap must be >= 0 and below --chunk-tokens ({args.chunk_tokens}), got {args.chunk_overlap}")
