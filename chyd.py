"""Constrained Hybrid Decoding: the decoding loop, the prompt, and the command line.

    python chyd.py --ctx data/manual.txt -q "What pressure should the main wheel tyres be inflated to?"

Each step of the loop is the paper's: the mode's mask, a sample, the transition (constraint.py holds
the rules). Inside a quote the passage's continuation is drafted and verified in one forward pass.
"""
from __future__ import annotations

import argparse
import codecs
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from constraint import EEC, STANDARD, Constraint, extract_spans, token_classes
from model import QUANTIZATIONS, load
from retrieve import CHUNK_OVERLAP, CHUNK_TOKENS, RETRIEVERS, Document, Index, Passage, paragraphs, passage, read_documents

NO_ANSWER = "No answer"
SPECULATE_K = 8  # tokens drafted from the context inside a quote
WINDOW_SPARE = 4  # tokens of the window kept for forced closes
QUOTE_FIRST_MODELS = {"smollm2"}  # small models that rarely open a quote on their own
DATA = Path(__file__).resolve().parent / "data"
SYSTEM_PROMPT = (
    "Answer the question using only the passages. Copy the words that support your answer exactly as "
    "they stand in a passage, between [ and ]. If the passages do not contain the answer, reply "
    "exactly: No answer"
)


@dataclass
class DecodeOptions:
    """How an answer is decoded; chyd.py, eval.py and bench.py fill it from the same flags."""

    constrained: bool = True  # False: the same prompt decoded freely, quotes unchecked
    temperature: float = 0.7  # 0: greedy
    top_p: float = 0.9
    max_new_tokens: int = 64
    seed: int = 0
    trigger_bias: float = 0.0  # added to the logits of `[` tokens outside quotes
    quote_first: bool = False  # open the answer with a quote unless "No answer" is likelier
    speculate: bool = True  # inside a quote, verify the passage's continuation in one pass
    lookup: bool = False  # outside quotes, verify what follows the answer's last tokens in a passage


@dataclass
class Span:
    text: str  # the quoted text, outer whitespace stripped
    sources: list[tuple[int, int]]  # (context index, char offset) of every occurrence


@dataclass
class Result:
    text: str
    spans: list[Span]
    tokens: list[int]
    modes: list[str]  # the mode each token was chosen in
    prompt_tokens: int
    quotes_opened: int = 0
    quotes_forced: int = 0  # closed without sampling: a dead end or the budget
    prefill_s: float = 0.0
    decode_s: float = 0.0
    forward_passes: int = 0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s else 0.0


def load_fewshot() -> list[dict]:
    return json.loads((DATA / "fewshot.json").read_text())


def user_message(question: str, contexts: list[str]) -> str:
    passages = "\n\n".join(f"Passage {i + 1}:\n{c.strip()}" for i, c in enumerate(contexts))
    return f"{passages}\n\nQuestion: {question.strip()}"


def build_prompt(tok, question: str, contexts: list[str]) -> str:
    """System message, worked examples from data/fewshot.json, the numbered passages and the question."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for ex in load_fewshot():
        messages.append({"role": "user", "content": user_message(ex["question"], ex["contexts"])})
        messages.append({"role": "assistant", "content": ex["answer"]})
    messages.append({"role": "user", "content": user_message(question, contexts)})
    return tok.apply_chat_template(messages)


def top_p_filter(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of tokens whose probability reaches p, renormalised, [V]."""
    probs_sort, probs_idx = torch.sort(probs, descending=True)
    probs_sort[torch.cumsum(probs_sort, dim=-1) - probs_sort > p] = 0.0
    kept = torch.zeros_like(probs).scatter_(0, probs_idx, probs_sort)
    return kept / kept.sum()


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
           draft: int | None = None) -> int:
    """A token from logits [V]: greedy at temperature 0, else nucleus sampling.

    With a draft token (speculation), the draft is accepted with its probability, and on rejection a token
    is drawn with the draft removed: the same distribution as plain sampling.
    """
    if temperature == 0:
        return int(logits.argmax())
    probs = top_p_filter(torch.softmax(logits.float() / temperature, dim=-1), top_p)
    if draft is not None:
        if float(torch.rand(1, generator=generator, device=probs.device)) < probs[draft]:
            return draft
        probs[draft] = 0.0
    return int(torch.multinomial(probs, 1, generator=generator))


def forward_hidden(model, ids: list[int], pos: int) -> torch.Tensor:
    """Feed ids at positions pos, pos+1, ... into the cache; their final hidden states [len(ids), dim]."""
    device = model.tok_embeddings.weight.device
    return model(torch.tensor([ids], device=device), torch.arange(pos, pos + len(ids), device=device), hidden_only=True)[0]


def no_answer_likelier(model, logits: torch.Tensor, no_answer: list[int], pos: int) -> bool:
    """Whether p(the answer starts with "No answer") > 1/2, scored with one pass over its tokens after the prompt."""
    logp = torch.log_softmax(logits, -1)[no_answer[0]]
    if len(no_answer) > 1:  # the cache slots written here are overwritten by the answer
        out = model.logits(forward_hidden(model, no_answer[:-1], pos)).float()
        logp = logp + torch.log_softmax(out, -1).gather(1, torch.tensor(no_answer[1:], device=out.device)[:, None]).sum()
    return bool(logp > math.log(0.5))


def ensure_cache(model, seq_len: int) -> None:
    if model.max_seq_len < seq_len or model.max_batch_size < 1:
        model.setup_cache(1, min(max(seq_len, 2 * model.max_seq_len), model.config.max_position_embeddings))


def speculative_step(model, step, last: int, draft: list[int], pos: int) -> tuple[int, bool]:
    """Feed the last token and a draft of k tokens in one pass [1 + k]; after each position step(h, draft token)
    chooses the next token, until one differs from the draft. Returns (draft tokens accepted, whether the
    answer goes on). Accepted draft tokens are in the cache already; the cache slots of rejected ones are
    overwritten later."""
    hidden = forward_hidden(model, [last] + draft, pos)  # [1 + k, dim]
    for i, (h, d) in enumerate(zip(hidden, draft + [None])):
        token = step(h, d)
        if token is None or token != d:  # after the last draft token there is none: the loop ends here at the latest
            break
    return i, token is not None


@torch.inference_mode()
def generate(model, tok, question: str, contexts: list[str], options: DecodeOptions | None = None,
             on_token=None, **overrides) -> Result:
    """Answer `question` from `contexts`; with `constrained`, every quote is verbatim by construction.

    options (or keyword overrides of its fields: constrained, temperature, top_p, max_new_tokens, seed,
    trigger_bias, quote_first, speculate, lookup) say how; see DecodeOptions.
    on_token(token_bytes, mode) is called as each token is chosen, for streaming.
    """
    o = replace(options or DecodeOptions(), **overrides)
    t0 = time.perf_counter()
    prompt = tok.encode(build_prompt(tok, question, contexts))
    window = model.config.max_position_embeddings
    if len(prompt) + o.max_new_tokens + WINDOW_SPARE > window:
        raise ValueError(f"prompt of {len(prompt)} tokens plus {o.max_new_tokens} new tokens exceeds "
                         f"the model's window of {window} tokens")
    ensure_cache(model, len(prompt) + o.max_new_tokens + SPECULATE_K + 8)
    V = model.config.vocab_size
    classes = token_classes(tok, V)
    constraint = Constraint(classes, contexts, o.trigger_bias, verbatim=o.constrained)
    generator = torch.Generator(model.tok_embeddings.weight.device).manual_seed(o.seed)
    stops = set(tok.eos_ids)
    tokens, modes = [], []

    def emit(token: int, mode: str) -> None:
        constraint.advance(token)  # the transition
        tokens.append(token)
        modes.append(mode)
        if on_token:
            on_token(classes.token_bytes[token], mode)

    def step(h: torch.Tensor, draft: int | None = None) -> int | None:
        """One step of the paper's loop for hidden state h [dim]: mode, mask, sample, transition.
        The token written, or None once the answer ends (a stop token, or the budget)."""
        mode = constraint.mode
        token = constraint.forced()
        if token is None:
            rows = constraint.rows()  # inside a quote few tokens are possible: project only their rows
            logits = model.logits(h, rows if rows is not None and len(rows) <= V // 8 else None).float()
            token = sample(constraint.mask(logits), o.temperature, o.top_p, generator, draft)
        if token in stops:
            return None
        emit(token, mode)
        return None if len(tokens) >= o.max_new_tokens and constraint.may_end() else token

    def propose(k: int) -> list[int]:
        """Up to k tokens to verify along with the next one: the quote's continuation, or a lookup's."""
        if constraint.mode == EEC:
            return constraint.draft(k) if o.speculate else []
        return constraint.lookup_draft(tokens, k) if o.lookup else []

    hidden = forward_hidden(model, prompt, 0)[-1]  # [dim]: the prefill
    t1 = time.perf_counter()
    passes = 1
    if o.quote_first and constraint.can_quote:
        no_answer = tok.encode(NO_ANSWER)
        passes += len(no_answer) > 1
        going = not no_answer_likelier(model, model.logits(hidden).float(), no_answer, len(prompt))
        for token in [classes.open_id] if going else no_answer:  # `[`: as if the model had written it
            emit(token, STANDARD)
    else:
        going = step(hidden) is not None
    draft_len = SPECULATE_K  # shrinks after rejections, so that a quote about to close costs no long pass
    while going:
        draft = propose(draft_len)
        # the cache holds the prompt and every token but the last
        accepted, going = speculative_step(model, step, tokens[-1], draft, len(prompt) + len(tokens) - 1)
        passes += 1
        if draft:
            draft_len = min(SPECULATE_K, 2 * accepted + 1)
    close = constraint.close()  # the budget reached inside a quote
    if close is not None:
        emit(close, EEC)
    t2 = time.perf_counter()
    text = tok.decode(tokens)
    return Result(text, [Span(s, constraint.sources(s)) for s in extract_spans(text)], tokens, modes, len(prompt),
                  constraint.opened, constraint.forced_closes, t1 - t0, t2 - t1, passes)


class StreamPrinter:
    """Prints the answer as it is generated, quotes highlighted on a colour terminal."""

    def __init__(self, out, colour: bool):
        self.out, self.colour = out, colour
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, piece: bytes, mode: str) -> None:
        text = self.decoder.decode(piece)
        if self.colour:
            text = text.replace("[", "\033[1;32m[").replace("]", "]\033[0m")
        self.out.write(text)
        self.out.flush()


class CliError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise CliError(message)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags that choose and prepare the model, shared by chyd.py, eval.py and bench.py."""
    p.add_argument("--model", default="smollm2", help="alias, hub repo id, local folder or .gguf file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--quantize", choices=QUANTIZATIONS,
                   help="int8: weight-only int8 for every linear layer (a quarter of fp32's bytes a step)")
    p.add_argument("--compile", action="store_true",
                   help="compile the one-token step (torch.compile; one to two minutes the first time, then cached)")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """The flags of DecodeOptions, shared by chyd.py, eval.py and bench.py (which sets its own defaults)."""
    d = DecodeOptions()
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--greedy", action="store_true", help="temperature 0")
    p.add_argument("--trigger-bias", type=float, default=d.trigger_bias, help="added to the logits of `[` tokens outside quotes")
    p.add_argument("--quote-first", action=argparse.BooleanOptionalAction, default=None,
                   help="open the answer with a quote unless the model prefers 'No answer' (default: on for smollm2)")
    p.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=d.speculate,
                   help="inside a quote, draft its continuation from the passage and verify it in one pass")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=d.lookup,
                   help="outside quotes, draft what follows the answer's last tokens in a passage and verify it in one pass")


def decode_options(args, constrained: bool = True) -> DecodeOptions:
    """DecodeOptions from the flags of add_decoding_args (and --model for the quote-first default), checked."""
    temperature = 0.0 if args.greedy else args.temperature
    if not temperature >= 0:
        raise CliError(f"--temperature must be >= 0, got {temperature}")
    if not 0 < args.top_p <= 1:
        raise CliError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    quote_first = args.model in QUOTE_FIRST_MODELS if args.quote_first is None else args.quote_first
    return DecodeOptions(constrained, temperature, args.top_p, args.max_new_tokens, args.seed, args.trigger_bias,
                         quote_first, args.speculate, args.lookup)


def load_model(args):
    """The model and tokenizer that the flags of add_model_args name, compiled if asked."""
    model, tok = load(args.model, dtype=getattr(torch, args.dtype) if args.dtype else None, device=args.device,
                      quantize=args.quantize)
    if args.compile:
        model.compile_decode_step()
    return model, tok


def add_retrieval_args(p: argparse.ArgumentParser) -> None:
    """How passages are cut and retrieved, shared by chyd.py and eval.py."""
    p.add_argument("--top-k", type=int, default=5,
                   help="passages retrieved when the documents do not fit the prompt (0: never retrieve)")
    p.add_argument("--retriever", choices=RETRIEVERS, default="hybrid",
                   help="BM25, all-MiniLM-L6-v2 vectors, or both fused by reciprocal rank")
    p.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS, help="chunk size, in the embedder's tokens")
    p.add_argument("--chunk-overlap", type=int, default=CHUNK_OVERLAP, help="tokens a chunk shares with the one before")


def check_retrieval_args(args) -> None:
    if args.top_k < 0:
        raise CliError(f"--top-k must be >= 0, got {args.top_k}")
    if args.chunk_tokens < 1:
        raise CliError(f"--chunk-tokens must be >= 1, got {args.chunk_tokens}")
    if not 0 <= args.chunk_overlap < args.chunk_tokens:
        raise CliError(f"--chunk-overlap must be >= 0 and below --chunk-tokens ({args.chunk_tokens}), got {args.chunk_overlap}")


def prompt_fits(model, tok, question: str, contexts: list[str], max_new_tokens: int) -> bool:
    """Whether the prompt with every context leaves room for the answer in the model's window."""
    window = model.config.max_position_embeddings
    if sum(map(len, contexts)) > 8 * window:  # prose never packs 8 characters into a token: no need to count
        return False
    return len(tok.encode(build_prompt(tok, question, contexts))) + max_new_tokens + WINDOW_SPARE <= window


class Library:
    """The user's documents. Shown whole (split at blank lines) when they fit the prompt; else the top k
    chunks are retrieved from an index, built or read back when a question first needs it and kept."""

    def __init__(self, docs: list[Document], args):
        self.docs, self.args = docs, args
        self.everything = [passage(d, 0, len(d.text)) for d in docs] if args.whole else [p for d in docs for p in paragraphs(d)]
        self.index: Index | None = None

    def passages(self, model, tok, question: str, options: DecodeOptions) -> tuple[list[Passage], dict[str, float]]:
        """What the model is shown for this question, and the seconds spent indexing and retrieving."""
        a = self.args
        if a.top_k == 0 or prompt_fits(model, tok, question, [p.text for p in self.everything], options.max_new_tokens):
            return self.everything, {"index_s": 0.0, "retrieve_s": 0.0}
        t0 = time.perf_counter()
        before = self.index.build_s if self.index else 0.0
        if self.index is None:
            self.index = Index(self.docs, a.chunk_tokens, a.chunk_overlap)
        hits = self.index.search(question, a.top_k, a.retriever)  # may build the dense part on first use
        index_s = self.index.build_s - before
        timings = {"index_s": index_s, "retrieve_s": time.perf_counter() - t0 - index_s}
        print(f"chyd: the documents do not fit the prompt; the top {len(hits)} of {len(self.index.chunks)} chunks "
              f"({a.retriever})", file=sys.stderr)
        return hits, timings


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="chyd.py", description="Answer from documents; every [quote] is verbatim by construction.")
    p.add_argument("--ctx", action="append", required=True, metavar="PATH",
                   help="a text, Markdown or PDF file, or a folder of them (repeatable)")
    p.add_argument("--whole", action="store_true", help="show each file (or PDF page) as one passage, not split at blank lines")
    p.add_argument("-q", "--question", help="the question (else read from stdin, or asked in a loop on a terminal)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the streamed answer")
    add_model_args(p)
    add_decoding_args(p)
    add_retrieval_args(p)
    p.add_argument("--no-constraint", action="store_true", help="decode freely (quotes are not checked)")
    p.add_argument("--show-prompt", action="store_true", help="print the rendered prompt to stderr")
    return p


def source(passages: list[Passage], index: int, offset: int, length: int) -> dict:
    """Where a quote stands: its file, page, line and character range in the document."""
    p = passages[index]
    return {"file": p.file, "page": p.page, "line": p.line_at(offset), "start": p.start + offset,
            "end": p.start + offset + length}


def describe(src: dict, index: int) -> str:
    page = f", page {src['page']}" if src["page"] is not None else ""
    return f"passage {index + 1} ({src['file']}{page}, line {src['line']}, chars {src['start']}-{src['end']})"


def answer_one(model, tok, question: str, library: Library, options: DecodeOptions, args) -> None:
    passages, timings = library.passages(model, tok, question, options)
    contexts = [p.text for p in passages]
    if args.show_prompt:
        print(build_prompt(tok, question, contexts), file=sys.stderr)
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    r = generate(model, tok, question, contexts, options, on_token=None if args.json else StreamPrinter(sys.stdout, colour))
    sources = [[(i, source(passages, i, o, len(s.text))) for i, o in s.sources] for s in r.spans]
    if args.json:
        print(json.dumps({
            "answer": r.text,
            "quotes": [{"text": s.text, "sources": [src for _, src in where]} for s, where in zip(r.spans, sources)],
            "passages": [{"file": p.file, "page": p.page, "line": p.line, "start": p.start, "end": p.end, "text": p.text,
                          "score": p.score} for p in passages],
            "spans": [{"text": s.text, "sources": [{"passage": i + 1, **src} for i, src in where]}
                      for s, where in zip(r.spans, sources)],
            "tokens": len(r.tokens), "prompt_tokens": r.prompt_tokens,
            "quotes_opened": r.quotes_opened, "quotes_forced": r.quotes_forced,
            "timings": {**{k: round(v, 4) for k, v in timings.items()}, "prefill_s": round(r.prefill_s, 4),
                        "decode_s": round(r.decode_s, 4), "tokens_per_s": round(r.tokens_per_s, 2),
                        "forward_passes": r.forward_passes},
        }, ensure_ascii=False))
        return
    print()
    for n, where in enumerate(sources, 1):
        print(f"[{n}] " + ("; ".join(describe(src, i) for i, src in where) or "not in the passages"))


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        options = decode_options(args, constrained=not args.no_constraint)
        check_retrieval_args(args)
        library = Library(read_documents(args.ctx), args)
        question = args.question
        if question is None and not sys.stdin.isatty():
            question = sys.stdin.read()
        if question is not None and not question.strip():
            raise CliError("the question is empty")
        model, tok = load_model(args)
        if question is not None:
            answer_one(model, tok, question, library, options, args)
            return 0
        while True:  # a terminal: keep the model and the index loaded and ask
            try:
                question = input("question> ")
            except EOFError:
                print()
                return 0
            if question.strip():
                answer_one(model, tok, question, library, options, args)
    except (CliError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"chyd.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
