"""Constrained Hybrid Decoding: the decoding loop, the prompt, and the command line.

    python chyd.py --ctx data/manual.txt -q "What pressure should the main wheel tyres be inflated to?"

Each step of the loop is the paper's: the mode's mask, a sample, the transition (constraint.py holds
the rules). Inside a quote the passage's continuation is drafted and verified in one forward pass.
"""
from __future__ import annotations

import codecs
import copy
import json
import math
import os
import sys
import time
import weakref
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from checkpoints import ALIASES, checkpoint_kind, identify, load  # noqa: F401  (load: `from chyd import load, generate`)
from model import ModelConfig
from cli import (USER_ERRORS, CliError, Parser, add_decoding_args, add_model_args, add_retrieval_args, add_server_args,
                 check_retrieval_args, check_server_args, decode_options, engine, load_model, run_cli)
from constraint import EEC, STANDARD, Constraint, GrammarConstraint, extract_spans, holds_word, token_classes
from retrieve import RERANK_POOL, RERANK_WORDS, Document, Index, Passage, paragraphs, passage, read_documents

NO_ANSWER = "No answer"
SPECULATE_K = 8  # tokens drafted from the context inside a quote
WINDOW_SPARE = 4  # tokens of the window kept for forced closes
QUOTE_SEARCH_TOKENS = 16  # the longest quote, in tokens, that quote search weighs
QUOTE_LENGTH_ALPHA = 0.5  # a span's score: its log-probability / its length ** alpha (1: the mean, 0: the sum)
# less this share of its log-probability after the prompt without its question: a span the model would quote
# whatever the question, such as the gloss beside the option asked for, counts for less (README, Quotes that hold the answer)
QUOTE_CONTRAST = 0.25
# models that open too few quotes on their own: the answer starts with one (README, Answer quality)
QUOTE_FIRST_MODELS = {ALIASES["smollm2"], ALIASES["qwen2.5-coder-1.5b"]}
# greedy answers of these models choose each quote by quote search of this width (README, Quotes that hold the answer)
QUOTE_SEARCH_MODELS = {ALIASES["smollm2"]: 8}
# p("No answer") above which a quote-first answer abstains, chosen on the dev split (README, Quotes that hold the
# answer); 1/2 (the likelier of the two) where none was measured
NO_ANSWER_ABOVE = {ALIASES["qwen2.5-coder-1.5b"]: 1 / 3}
DATA = Path(__file__).resolve().parent / "data"
SYSTEM_PROMPT = (
    "Answer the question using only the passages. Copy the words that support your answer exactly as "
    "they stand in a passage, between [ and ]. If the passages do not contain the answer, reply "
    "exactly: No answer"
)
REFERENCE_PROMPT = (
    "Answer the question using only the passages. Quote the shortest exact phrase of a passage that answers it "
    "(a command, an option, a value) between [ and ], as it stands. If the passages do not contain the answer, "
    "reply exactly: No answer"
)
# --prompt: the instruction and the worked examples (data/), by what the examples look like
PROMPTS = {
    "maintenance": (SYSTEM_PROMPT, "fewshot.json"),  # a maintenance manual's prose; a sentence around its quote
    "reference": (REFERENCE_PROMPT, "fewshot_reference.json"),  # command lists, option tables; the quote first
}


@dataclass
class DecodeOptions:
    """How an answer is decoded. These defaults are chyd.py's with no flags (cli.py takes them from here); they
    were chosen from README's measured table (Answer quality)."""

    constrained: bool = True  # False: the same prompt decoded freely, quotes unchecked
    temperature: float = 0.7  # 0: greedy
    top_p: float = 0.9
    max_new_tokens: int = 64
    seed: int = 0
    trigger_bias: float = 0.0  # added to the logits of `[` tokens outside quotes
    quote_first: bool | None = None  # open the answer with a quote unless "No answer" is likelier; None: the model's
    speculate: bool = True  # inside a quote, verify the passage's continuation in one pass
    lookup: bool = False  # outside quotes, verify what follows the answer's last tokens in a passage
    whole_words: bool = True  # a quote starts and ends on word boundaries and holds a word (constraint.py)
    no_repeat_ngram: int = 4  # outside quotes, no token that repeats an n-gram of the answer (0: off)
    repetition_penalty: float = 1.0  # outside quotes, CTRL's penalty on the answer's tokens (1: off)
    engine: str = "chyd"  # "llguidance": the mask from llguidance's matcher over constraint.lark_grammar
    batch_size: int | None = None  # answers decoded together, a cache row each (None: all)
    quote_search: int | None = None  # greedy only: a beam of this width chooses each quote (0: off; None: the model's)
    no_answer: str = NO_ANSWER  # the abstention that quote_first weighs against a quote
    no_answer_above: float | None = None  # quote_first abstains where p(no_answer) is above this; None: the model's
    prompt: str = "maintenance"  # the instruction and worked examples, a key of PROMPTS
    on_token: Callable[[bytes, str], None] | None = None  # called with each token's bytes and mode as it is chosen

    def __post_init__(self):  # a bad value is a ValueError naming its field (cli.py names the flag instead)
        for name, ok, rule in (
                ("temperature", 0 <= self.temperature < math.inf, "a finite number >= 0"),
                ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
                ("trigger_bias", math.isfinite(self.trigger_bias), "a finite number"),
                ("no_repeat_ngram", self.no_repeat_ngram >= 0, ">= 0"),
                ("repetition_penalty", 0 < self.repetition_penalty < math.inf, "a finite number > 0"),
                ("quote_search", self.quote_search is None or self.quote_search >= 0, ">= 0"),
                ("no_answer_above", self.no_answer_above is None or 0 < self.no_answer_above < 1, "in (0, 1)"),
                ("batch_size", self.batch_size is None or self.batch_size >= 1, ">= 1"),
                ("engine", self.engine in ("chyd", "llguidance"), "chyd or llguidance"),
                ("prompt", self.prompt in PROMPTS, f"one of {', '.join(PROMPTS)}")):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")


def model_defaults(cfg: ModelConfig) -> dict:
    """The defaults that follow the model (cfg: its config, as load or open_checkpoint gives it), decided from what
    it is (checkpoints.identify), not from how it was named: an alias, its hub id, its folder and its GGUF alike."""
    name, how = identify(cfg)
    return {"model": name, "recognised": how, "quote_first": name in QUOTE_FIRST_MODELS,
            "no_answer_above": NO_ANSWER_ABOVE.get(name, 0.5), "quote_search": QUOTE_SEARCH_MODELS.get(name, 0)}


def with_model_defaults(o: DecodeOptions, cfg: ModelConfig, served: bool = False) -> DecodeOptions:
    """o with what it leaves to the model (quote_first, no_answer_above, quote_search: None) decided by
    model_defaults; quote search only where it can run (greedy, constrained, our engine; not served), else 0."""
    if None not in (o.quote_first, o.no_answer_above, o.quote_search):
        return o
    d = model_defaults(cfg)
    searches = o.temperature == 0 and o.constrained and o.engine == "chyd" and not served
    return replace(o, quote_first=d["quote_first"] if o.quote_first is None else o.quote_first,
                   no_answer_above=d["no_answer_above"] if o.no_answer_above is None else o.no_answer_above,
                   quote_search=(d["quote_search"] if searches else 0) if o.quote_search is None else o.quote_search)


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


def load_fewshot(prompt: str = "maintenance") -> list[dict]:
    return json.loads((DATA / PROMPTS[prompt][1]).read_text())


# the prompt's own headings (user_message): an answer that writes one outside a quote has begun to invent a passage
# or a question (SmolLM2 on retrieved chunks: 11 of 69 dev answers); it ends before it
ANSWER_STOPS = (b"\nPassage ", b"\nQuestion:")


def user_message(question: str, contexts: list[str]) -> str:
    passages = "\n\n".join(f"Passage {i + 1}:\n{c.strip()}" for i, c in enumerate(contexts))
    return f"{passages}\n\nQuestion: {question.strip()}"


def build_prompt(tok, question: str, contexts: list[str], prompt: str = "maintenance", quote_first: bool = False) -> str:
    """The system message and worked examples of PROMPTS[prompt], the numbered passages and the question. With
    quote_first, an example's answer in the form the loop will force, opening with its quote (answer_quote_first):
    shown "The pump must run for [2 minutes ...]", a quote-first model wrote [The] and went on unquoted."""
    messages = [{"role": "system", "content": PROMPTS[prompt][0]}]
    for ex in load_fewshot(prompt):
        answer = ex.get("answer_quote_first", ex["answer"]) if quote_first else ex["answer"]
        messages.append({"role": "user", "content": user_message(ex["question"], ex["contexts"])})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": user_message(question, contexts)})
    return tok.apply_chat_template(messages)


def prompt_for(tok, question: str, contexts: list[str], o: DecodeOptions) -> str:
    """build_prompt as o asks: its prompt, its examples quote-first where the answer opens with a quote
    (o.quote_first, decided: with_model_defaults)."""
    return build_prompt(tok, question, contexts, o.prompt, bool(o.quote_first))


def stop_cut(pieces: list[bytes], modes: list[str]) -> int | None:
    """Where an answer ends at one of ANSWER_STOPS: the number of its tokens (pieces: their bytes, modes: the mode
    each was written in) before the first stop whose last byte was written outside a quote, or None. A token across
    the stop's start stays if it closes a quote or adds only blanks; the blank tokens just before the cut go."""
    text, starts = b"".join(pieces), [0]  # starts[i]: the byte token i begins at
    for p in pieces:
        starts.append(starts[-1] + len(p))
    first = None
    for stop in ANSWER_STOPS:
        at = text.find(stop)
        while at >= 0 and modes[bisect_right(starts, at + len(stop) - 1) - 1] != STANDARD:
            at = text.find(stop, at + 1)
        if at >= 0 and (first is None or at < first):
            first = at
    if first is None:
        return None
    n = bisect_right(starts, first) - 1  # the tokens that end before the stop, then the one across its start if it
    if starts[n] < first and (modes[n] == EEC or not text[first:starts[n + 1]].strip()):  # closes a quote or adds a blank
        n += 1
    while n and modes[n - 1] == STANDARD and not pieces[n - 1].strip():  # and the blank before it
        n -= 1
    return n


def sendable(pieces: list[bytes]) -> int:
    """How many of an answer's tokens not yet streamed (pieces: their bytes; the answer has not ended at a stop) can
    be: those before any that stop_cut may yet cut (one that holds what may begin a stop, those after it, and the
    blank tokens before it). A whole stop among them is a quote's own text."""
    tail = b"".join(pieces)
    held = next((p for p in range(len(tail)) if any(s.startswith(tail[p:]) for s in ANSWER_STOPS)), len(tail))
    n, size = 0, 0
    while n < len(pieces) and size + len(pieces[n]) <= held:
        n, size = n + 1, size + len(pieces[n])
    return before_blanks(pieces, n)


def before_blanks(pieces: list[bytes], n: int) -> int:
    """n less the blank tokens just before it (pieces: the tokens' bytes)."""
    while n and not pieces[n - 1].strip():
        n -= 1
    return n


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


def discourage_repeats(logits: torch.Tensor, tokens: list[int], no_repeat_ngram: int, penalty: float,
                       exempt: torch.Tensor, token_bytes: list[bytes] | None = None) -> torch.Tensor:
    """transformers' no_repeat_ngram_size and repetition_penalty over the answer's tokens, logits [V] -> [V].

    Over the answer only, not the prompt, which holds the passages: outside quotes the model should use their
    words. The penalty spares the exempt tokens ([V] bool, the `[` tokens), or every quote after the first
    would be less likely; the n-gram ban does not, as a quote opened again after the same words is a loop.
    With token_bytes, the ban reads the answer without its whitespace-only tokens, so that a loop cannot go on by
    putting one more blank between its repeats (`] [`, `]  [`, `]   [`); so a blank is never banned.
    """
    n = no_repeat_ngram
    if not tokens or (penalty == 1.0 and not n):
        return logits
    logits = logits.clone()
    if penalty != 1.0:
        seen = torch.tensor(sorted(set(tokens)))
        seen = seen[~exempt[seen]].to(logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    words = tokens if not n or token_bytes is None else [t for t in tokens if token_bytes[t].strip()]
    if n and len(words) >= n:
        prefix = words[len(words) - n + 1:]  # the n - 1 last tokens; an n-gram that starts with them is banned
        logits[[words[i + n - 1] for i in range(len(words) - n + 1) if words[i:i + n - 1] == prefix]] = float("-inf")
    return logits


def forward_hidden(model, ids: list[int], pos: int, row: int = 0) -> torch.Tensor:
    """Feed ids at positions pos, pos+1, ... into cache row `row`; their final hidden states [len(ids), dim]."""
    device = model.tok_embeddings.weight.device
    ids, positions = torch.tensor([ids], device=device), torch.arange(pos, pos + len(ids), device=device)
    return model(ids, positions, hidden_only=True, row=row)[0]


def forward_rows(model, rows: list[list[int]], starts: list[int]) -> torch.Tensor:
    """Feed each row's ids at its own positions starts[b], ... into cache row b; hidden states [B, T, dim], T the
    longest row's length (a shorter row's are padded, not computed). One row takes the shared-positions path of
    the model, as forward_hidden does."""
    device = model.tok_embeddings.weight.device
    if len(rows) == 1:
        return forward_hidden(model, rows[0], starts[0])[None]
    lengths = [len(r) for r in rows]
    T = max(lengths)
    pos = torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)  # [B, T]
    ids = torch.tensor([r + r[-1:] * (T - len(r)) for r in rows], device=device)
    return model(ids, pos, hidden_only=True, lengths=lengths)


def no_answer_likelier(model, hidden: torch.Tensor, no_answer: list[int], above: float) -> bool:
    """Whether p(the answer starts with no_answer) > above. hidden [len(no_answer), dim]: the states after the
    prompt and after each of no_answer's tokens but the last."""
    logp = torch.log_softmax(model.logits(hidden).float(), -1)  # [n, V]
    return float(logp[torch.arange(len(no_answer)), torch.tensor(no_answer, device=logp.device)].sum()) > math.log(above)


RERANK_PROMPT = "\n\nA question this text answers: "  # a passage, this, then the question whose likelihood ranks it


def question_scorer(model, tok) -> Callable[[str, list[str]], list[float]]:
    """score(question, texts): how likely each text makes the question under the model, the mean log-probability
    of the question's tokens after the text and RERANK_PROMPT (retrieve.py's rerank; one text a pass)."""
    @torch.inference_mode()
    def score(question: str, texts: list[str]) -> list[float]:
        q, out = tok.encode(question), []
        for text in texts:
            before = tok.encode(text + RERANK_PROMPT)
            ensure_cache(model, 1, len(before) + len(q))
            hidden = forward_hidden(model, before + q, 0)[len(before) - 1:-1]  # the states that predict q, [len(q), dim]
            logp = torch.log_softmax(model.logits(hidden).float(), -1)
            out.append(float(logp[torch.arange(len(q)), torch.tensor(q, device=logp.device)].mean()) if q else 0.0)
        return out
    return score


def load_scorer(name: str, device: str, answering: tuple | None = None) -> Callable[[str, list[str]], list[float]]:
    """--rerank's question scorer: the answering model when `answering` (its name, model, tokenizer) names `name`,
    else `name` loaded with int8 weights (on this CPU SmolLM2 scores the 10 chunks of a question in 2.7 s, README)."""
    reuse = answering is not None and answering[0] == name
    model, tok = answering[1:] if reuse else load(name, device=device, quantize="int8")
    print(f"chyd: reranking with {name} ({'the answering model' if reuse else 'int8 weights'})", file=sys.stderr)
    return question_scorer(model, tok)


PREFIX_BLOCK = 16  # tokens a kept block of keys and values holds
PREFIX_TOKENS_KEPT = 4096  # a model's kept blocks, in tokens; the least recently used go first
PREFIXES = weakref.WeakKeyDictionary()  # model -> OrderedDict {a block's key: its keys and values, [layers, 2, H_kv, PREFIX_BLOCK, D]}


def prefix_keys(prompt: list[int], end: int) -> Iterator[tuple[int, int]]:
    """(start, key) of each whole block of prompt[:end]; a key stands for every token up to its block's end
    (a chain of hashes, as vLLM's prefix caching)."""
    key = 0
    for s in range(0, end - PREFIX_BLOCK + 1, PREFIX_BLOCK):
        key = hash((key, *prompt[s:s + PREFIX_BLOCK]))
        yield s, key


def reuse_prefix(model, prompt: list[int], row: int = 0) -> int:
    """Write the keys and values of the longest start of `prompt` kept from earlier prompts into cache row `row`;
    their count. The prompts of a dataset share the system message and the worked examples, often a passage."""
    kept, blocks = PREFIXES.setdefault(model, OrderedDict()), []
    for _, key in prefix_keys(prompt, len(prompt) - 1):  # a token is left to prefill, for its hidden state
        if key not in kept:
            break
        blocks.append(key)
    if not blocks:
        return 0
    kv = torch.cat([kept[key] for key in blocks], dim=3)  # [layers, 2, H_kv, n, D]
    n = kv.shape[3]
    for layer, (k, v) in zip(model.layers, kv):
        layer.attention.kv_cache.k[row, :, :n] = k
        layer.attention.kv_cache.v[row, :, :n] = v
    return n


def keep_prefix(model, prompt: list[int], row: int = 0) -> None:
    """Keep the keys and values of prompt's whole blocks from cache row `row`, for the prompts to come."""
    kept, caches, keys = PREFIXES.setdefault(model, OrderedDict()), [layer.attention.kv_cache for layer in model.layers], []
    for s, key in prefix_keys(prompt, len(prompt)):
        if key not in kept:
            kept[key] = torch.stack([torch.stack([c.k[row, :, s:s + PREFIX_BLOCK], c.v[row, :, s:s + PREFIX_BLOCK]])
                                     for c in caches])
        keys.append(key)
    for key in reversed(keys):  # the most recently used last, a block after the blocks it follows: dropped first
        kept.move_to_end(key)
    while len(kept) * PREFIX_BLOCK > PREFIX_TOKENS_KEPT:
        kept.popitem(last=False)


def prefill(model, prompt: list[int], row: int = 0, then: list[int] = ()) -> torch.Tensor:
    """The prompt into cache row `row`, its start copied from earlier prompts' (reuse_prefix), then the tokens
    `then` (scored: their slots are overwritten by what comes next); the hidden states of the prompt's last
    token and of each token of `then`, [1 + len(then), dim]. One prompt a pass: a prompt's own tokens keep
    the matrix products busy, and prompts of a batch padded to one length would compute the padding."""
    n = reuse_prefix(model, prompt, row)
    hidden = forward_hidden(model, prompt[n:] + list(then), n, row)[len(prompt) - 1 - n:]
    keep_prefix(model, prompt, row)
    return hidden


def ensure_cache(model, batch: int, seq_len: int) -> None:
    """A cache of at least batch rows of seq_len positions; a length that falls short is doubled at least, so
    that a longer prompt to come does not allocate again."""
    length = model.max_seq_len if model.max_seq_len >= seq_len else max(seq_len, 2 * model.max_seq_len)
    if length != model.max_seq_len or model.max_batch_size < batch:
        model.setup_cache(max(batch, model.max_batch_size), min(length, model.config.max_position_embeddings))


class Answer:
    """One answer being decoded: its constraint, tokens, modes and sampler. step() is one step of the paper's
    loop; a batch holds one Answer a row."""

    def __init__(self, model, tok, prompt: list[int], contexts: list[str], o: DecodeOptions, index: int = 0):
        self.model, self.tok, self.prompt, self.o = model, tok, prompt, o
        self.classes = token_classes(tok, model.config.vocab_size)
        self.index = index  # the prompt's place among a stream's
        self.stops = set(tok.eos_ids)
        if o.engine == "llguidance" and o.constrained:
            self.constraint = GrammarConstraint(self.classes, contexts, tok, o.trigger_bias, o.quote_first, o.whole_words)
        else:
            self.constraint = Constraint(self.classes, contexts, o.trigger_bias, verbatim=o.constrained,
                                         whole_words=o.whole_words)
        self.generator = torch.Generator(model.tok_embeddings.weight.device).manual_seed(o.seed)
        self.tokens, self.modes = [], []
        self.passes, self.draft_len, self.prefill_s, self.decode_s = 1, SPECULATE_K, 0.0, 0.0
        self.weighs_no_answer = o.quote_first and self.constraint.can_quote
        self.plan: deque[int] = deque()  # the quote that quote search chose and its exit: written token by token
        self.kept: int | None = None  # the tokens the answer keeps once it wrote one of ANSWER_STOPS
        self.quote_at: int | None = None  # the open quote's trigger, its index in tokens (None: it opened inside a token)
        self.sent = 0  # the tokens on_token has been given: those that cannot begin a stop

    @property
    def pos(self) -> int:
        """Where the last token goes in the cache: it holds the prompt and every token but the last."""
        return len(self.prompt) + len(self.tokens) - 1

    def emit(self, token: int, mode: str) -> None:
        self.constraint.advance(token)  # the transition
        if self.constraint.mode == EEC and (mode == STANDARD or b"[" in self.classes.token_bytes[token]):
            self.quote_at = len(self.tokens) if mode == STANDARD else None  # llguidance's `] [` is one token
        self.tokens.append(token)
        self.modes.append(mode)

    def send(self, upto: int) -> None:
        for t, m in zip(self.tokens[self.sent:upto], self.modes[self.sent:upto]):
            self.o.on_token(self.classes.token_bytes[t], m)
        self.sent = upto  # never back: sendable holds what stop_cut may cut

    def wrote_stop(self) -> bool:
        """Whether the last token completed one of ANSWER_STOPS outside a quote (then self.kept says where the
        answer ends). A stop lies within its length in tokens, each a byte at least."""
        k = max(0, len(self.tokens) - max(map(len, ANSWER_STOPS)))
        cut = stop_cut([self.classes.token_bytes[t] for t in self.tokens[k:]], self.modes[k:])
        if cut is not None:
            self.kept = k + cut
        return cut is not None

    def wordless_quote(self) -> int | None:
        """Where the open quote begins while it holds no word (whole-word quotes): a quote the budget closed there
        would be no evidence ([2], [1.3,]), so the answer ends before it (if more than blanks stands there) and the
        stream holds it back till then."""
        c = self.constraint
        if self.o.whole_words and self.o.constrained and c.mode == EEC and not holds_word(c.quote):
            return self.quote_at
        return None

    def few_rows(self) -> torch.Tensor | None:
        """The vocabulary rows the next step needs when they are few (inside a quote), else None: all."""
        rows = self.constraint.rows()
        return rows if rows is not None and len(rows) <= self.model.config.vocab_size // 8 else None

    def start(self, hidden: torch.Tensor, no_answer: list[int]) -> bool:
        """The first step, after the prefill (hidden: prefill's states, with no_answer but its last token after
        the prompt when weighs_no_answer). quote_first weighs "No answer" against a quote: "No answer" is written
        where its probability is above o.no_answer_above, else `[` as if the model had written it. Whether the
        answer goes on."""
        if not self.weighs_no_answer:
            return self.step(hidden[0]) is not None
        going = not no_answer_likelier(self.model, hidden, no_answer, self.o.no_answer_above)
        for token in [self.classes.open_id] if going else no_answer:
            self.emit(token, STANDARD)
        return going

    def step(self, h: torch.Tensor, draft: int | None = None, logits: torch.Tensor | None = None) -> int | None:
        """One step of the paper's loop for hidden state h [dim]: mode, mask, sample, transition. logits [V]:
        the step's output projection when the batch computed it. The token written, or None once the answer
        ends (a stop token, or the budget)."""
        c, o, model = self.constraint, self.o, self.model
        mode = c.mode
        token = c.forced()
        planned = self.plan.popleft() if self.plan else None
        if token is None:
            if logits is None:  # inside a quote few tokens are possible: project only their rows
                logits = model.logits(h, self.few_rows())
            logits = logits.float()
            if mode == STANDARD:  # inside a quote the passage decides
                logits = discourage_repeats(logits, self.tokens, o.no_repeat_ngram, o.repetition_penalty,
                                            self.classes.trigger, self.classes.token_bytes)
            logits = c.mask(logits)
            if planned is not None and logits[planned] == float("-inf"):
                raise AssertionError(f"planned token {planned} is outside the constraint")
            token = sample(logits, o.temperature, o.top_p, self.generator, draft) if planned is None else planned
        elif planned not in (None, token):
            raise AssertionError(f"planned token {planned}, forced {token}")
        if token in self.stops:
            return None
        self.emit(token, mode)
        if mode == STANDARD and self.wrote_stop():
            return None
        if o.on_token:
            held = self.wordless_quote()
            self.send(self.sent + sendable([self.classes.token_bytes[t] for t in self.tokens[self.sent:held]]))
        return None if len(self.tokens) >= o.max_new_tokens and c.may_end() else token

    def propose(self) -> list[int]:
        """Tokens to verify along with the next one: the quote's continuation, or a lookup's."""
        c, o = self.constraint, self.o
        if self.plan:  # chosen already: verified in one pass
            return list(self.plan)
        if c.mode == EEC:
            return c.draft(self.draft_len) if o.speculate else []
        return c.lookup_draft(self.tokens, self.draft_len) if o.lookup else []

    def verify(self, hidden: torch.Tensor, draft: list[int], first: torch.Tensor | None = None) -> bool:
        """After a pass over the last token and the draft (hidden [>= 1 + k, dim]), step along it until a
        token differs from the draft (first: the logits [V] of the first step, if the batch computed them).
        Accepted draft tokens are in the cache already; the slots of rejected ones are overwritten later.
        Whether the answer goes on."""
        self.passes += 1
        for i, (h, d) in enumerate(zip(hidden, draft + [None])):
            token = self.step(h, d, first if i == 0 else None)
            if token is None or token != d:  # after the last draft token there is none: the loop ends here at the latest
                break
        if draft:  # shrinks after rejections, so that a quote about to close costs no long pass
            self.draft_len = min(SPECULATE_K, 2 * i + 1)
        return token is not None

    def opened_quote(self) -> bool:
        """Whether quote search should choose the quote just opened (the trigger is the last token)."""
        return bool(self.o.quote_search) and self.constraint.mode == EEC and not self.constraint.quote and not self.plan

    def result(self) -> Result:
        at = self.wordless_quote() if self.kept is None else None
        if at is not None:  # the budget reached inside a quote without a word: the answer ends before it, if aught is left
            self.kept = before_blanks([self.classes.token_bytes[t] for t in self.tokens], at) or None
        dropped = at is not None and self.kept is not None  # that quote is not the answer's: not counted as opened
        close = self.constraint.close() if self.kept is None else None  # the budget reached inside a quote
        if close is not None:
            self.emit(close, EEC)
        tokens, modes = self.tokens[:self.kept], self.modes[:self.kept]
        if self.o.on_token:
            self.send(len(tokens))
        c, text = self.constraint, self.tok.decode(tokens)
        return Result(text, [Span(s, c.sources(s)) for s in extract_spans(text)], tokens, modes,
                      len(self.prompt), c.opened - dropped, c.forced_closes, self.prefill_s, self.decode_s, self.passes)


@contextmanager
def clock(answers: list[Answer], part: str):
    """Add the seconds the block takes to each answer's `part` ("prefill_s" or "decode_s")."""
    t0 = time.perf_counter()
    yield
    for a in answers:
        setattr(a, part, getattr(a, part) + time.perf_counter() - t0)


def copy_positions(caches: list, dst, src, lo: int, hi: int) -> None:
    """Positions lo..hi-1 of cache row(s) src into row(s) dst (an int, a slice or an index tensor), every layer."""
    for c in caches:
        c.k[dst, :, lo:hi], c.v[dst, :, lo:hi] = c.k[src, :, lo:hi], c.v[src, :, lo:hi]


@torch.inference_mode()
def quote_candidates(model, answer: Answer, row: int, width: int,
                     contrast: list[int] | None = None) -> list[tuple[list[int], float]]:
    """The quotes a beam of `width` finds for the quote the answer has just opened (its last token the trigger, not
    yet in cache row `row`): each a span its Constraint allows token by token and may close there (whole-word rules
    included), then its likeliest exit token, with its score: the log-probability of the span's tokens and of the
    quote's end (any exit or stop token), as a forward pass over the prompt, the answer and the span gives them, over
    their count ** QUOTE_LENGTH_ALPHA. With contrast (the prompt without its question), less QUOTE_CONTRAST times
    the same log-probability after contrast and the answer. The beam runs in the cache's last `width` rows (the
    contrast's in the `width` before them), one pass a token for all its hypotheses; at each depth the `width`
    likeliest spans go on. Every row reads the start it shares with the prompt from row `row` (Pass.shared)."""
    caches = [layer.attention.kv_cache for layer in model.layers]
    base, start, device = model.max_batch_size - width, answer.pos, model.tok_embeddings.weight.device
    common = start if contrast is None else len(os.path.commonprefix([answer.prompt, contrast]))  # lists' common start
    beam_rows = [(base, start)]  # (the first cache row, the trigger's position) of the beam, and of the contrast's
    # what follows the shared start of the prompt, and the answer so far, into every row of the beam
    copy_positions(caches, slice(base, base + width), row, common, start)
    if contrast is not None:  # the contrast's own end and the answer so far, into the rows before the beam's
        cbase, cstart = base - width, len(contrast) + len(answer.tokens) - 1
        beam_rows.append((cbase, cstart))
        copy_positions(caches, cbase, row, 0, common)  # its start is the prompt's: copied once to compute the rest
        forward_hidden(model, contrast[common:] + answer.tokens[:-1], common, cbase)
        copy_positions(caches, slice(cbase + 1, base), cbase, common, cstart)
    exits = answer.classes.exit_ids.to(device)
    ends = torch.cat([exits, answer.classes.stop_ids.to(device)])
    budget = min(QUOTE_SEARCH_TOKENS, answer.o.max_new_tokens - len(answer.tokens) - 1)  # `]` must fit
    # (span, its log-probability, the same after contrast, rules)
    beam, last, found = [([], 0.0, 0.0, answer.constraint)], [answer.tokens[-1]], []
    for depth in range(budget + 1):
        n = len(last)
        if contrast is None:
            hidden = model(torch.tensor([[t] for t in last], device=device), torch.tensor([start + depth], device=device),
                           hidden_only=True, row=base, shared=(row, common))[:, 0]
        else:  # the contrast's rows, then the beam's, each at its own position, in one pass
            ids = torch.tensor([[t] for t in last + [last[0]] * (width - n) + last], device=device)  # unused rows padded
            pos = torch.tensor([[cstart + depth]] * width + [[start + depth]] * n, device=device)
            hidden = model(ids, pos, hidden_only=True, row=cbase, shared=(row, common))[:, 0]
            hidden = torch.cat([hidden[width:], hidden[:n]])  # the beam's n rows, then the contrast's
        logp = torch.log_softmax(model.logits(hidden).float(), -1)  # [n or 2n, V]
        contrast_logp, share = (logp[n:], QUOTE_CONTRAST) if contrast is not None else (torch.zeros_like(logp), 0.0)
        children = []  # (parent, span, log-probability, after contrast, token)
        for parent, ((span, total, total_c, rules), lp, lc) in enumerate(zip(beam, logp, contrast_logp)):
            ids = rules.allowed()
            if rules.closable:  # at a dead end the loop writes `]` itself
                exit = int(exits[lp[exits].argmax()]) if len(ids) else answer.classes.close_id
                end, end_c = float(torch.logsumexp(lp[ends], 0)), float(torch.logsumexp(lc[ends], 0))
                score = (total + end - share * (total_c + end_c)) / (len(span) + 1) ** QUOTE_LENGTH_ALPHA
                found.append((span + [exit], score))
            if len(ids) and depth < budget:
                top = lp[ids.to(device)].topk(min(width, len(ids)))
                children += [(parent, span + [t], total + v, total_c + float(lc[t]), t)
                             for v, t in zip(top.values.tolist(), ids[top.indices.cpu()].tolist())]
        if not children:
            break
        children = sorted(children, key=lambda ch: -ch[2])[:width]  # one length: the sums rank as the means
        parents = torch.tensor([ch[0] for ch in children], device=device)
        for first, at in beam_rows:  # each child's rows take its parent's span
            copy_positions(caches, slice(first, first + len(children)), first + parents, at, at + depth + 1)
        beam = [(span, total, total_c, advanced(beam[parent][3], t)) for parent, span, total, total_c, t in children]
        last = [ch[4] for ch in children]
    return found


def advanced(rules: Constraint, token: int) -> Constraint:
    """A copy of the rules after the token (their transition replaces, never mutates, what it changes)."""
    rules = copy.copy(rules)
    rules.advance(token)
    return rules


class Batch:
    """The cache rows of a stream, each decoding one Answer; the prompts that wait take the rows that free up
    (continuous batching), and once they run out the batch shrinks."""

    def __init__(self, model, tok, prompts: list[list[int]], contexts: list[list[str]], o: DecodeOptions,
                 contrasts: list[list[int]] | None = None):
        self.model, self.tok, self.prompts, self.contexts, self.o = model, tok, prompts, contexts, o
        self.contrasts = contrasts
        self.no_answer = tok.encode(o.no_answer)
        self.waiting = deque(range(len(prompts)))
        self.rows: list[Answer | None] = [None] * min(o.batch_size or len(prompts), len(prompts))  # rows[r]: cache row r
        # quote search's beam takes the cache's last rows, its contrast's the rows before them
        spare = o.quote_search * (2 if contrasts else 1)
        longest = max(map(len, prompts + (contrasts or [])))
        ensure_cache(model, len(self.rows) + spare, longest + o.max_new_tokens + SPECULATE_K + 8)

    def fill(self) -> Iterator[tuple[int, Result]]:
        """The next prompts take the free rows, each prefilled alone into its row (a prompt's own tokens keep the
        matrix products busy) and started; the answers that end there. Once the prompts run out, the free rows
        leave the batch."""
        for r, a in enumerate(self.rows):
            while a is None and self.waiting:
                i = self.waiting.popleft()
                a = Answer(self.model, self.tok, self.prompts[i], self.contexts[i], self.o, i)
                with clock([a], "prefill_s"):
                    hidden = prefill(self.model, a.prompt, r, self.no_answer[:-1] if a.weighs_no_answer else [])
                with clock([a], "decode_s"):
                    going = a.start(hidden, self.no_answer)
                    self.search(a, r, going)
                if not going:
                    yield i, a.result()
                    a = None
            self.rows[r] = a
        if None in self.rows and not self.waiting:
            keep = [r for r, a in enumerate(self.rows) if a is not None]
            if keep != list(range(len(keep))):
                self.model.keep_rows(torch.tensor(keep))
            self.rows = [self.rows[r] for r in keep]

    def search(self, a: Answer, r: int, going: bool) -> None:
        """If a's quote has just opened, plan it: the best-scored of quote_candidates, and its exit."""
        if going and a.opened_quote():
            found = quote_candidates(self.model, a, r, self.o.quote_search,
                                     None if self.contrasts is None else self.contrasts[a.index])
            if found:
                a.plan.extend(max(found, key=lambda f: f[1])[0])

    def step(self) -> Iterator[tuple[int, Result]]:
        """One forward pass over every row's last token and draft, then each row's steps along its draft; the
        answers that end."""
        rows = self.rows
        if not rows:
            return
        drafts = [a.propose() for a in rows]
        with clock(rows, "decode_s"):
            hidden = forward_rows(self.model, [[a.tokens[-1]] + d for a, d in zip(rows, drafts)], [a.pos for a in rows])
            # one output projection for the rows whose next step needs the whole vocabulary: the weights read once
            wide = [r for r, a in enumerate(rows) if a.few_rows() is None]
            first = dict(zip(wide, self.model.logits(hidden[wide, 0]))) if len(wide) > 1 else {}
            going = [a.verify(h, d, first.get(r)) for r, (a, h, d) in enumerate(zip(rows, hidden, drafts))]
            for r, (a, g) in enumerate(zip(rows, going)):
                self.search(a, r, g)
        self.rows = [a if g else None for a, g in zip(rows, going)]
        for a, g in zip(rows, going):
            if not g:
                yield a.index, a.result()


@torch.inference_mode()
def decode_stream(model, tok, prompts: list[list[int]], contexts: list[list[str]],
                  o: DecodeOptions, contrasts: list[list[int]] | None = None) -> Iterator[tuple[int, Result]]:
    """Continue each prompt (token ids) with an answer whose quotes come from contexts[i]; (i, its Result) as
    each answer ends. o.batch_size answers (default all) are decoded together, one forward pass a step for all,
    each with its own constraint, mode, sampler, stop and budget, its own positions in its own cache row (no
    left padding, so that every row computes what it would alone). contrasts[i]: prompts[i] without its question,
    what quote search weighs its spans against (quote_candidates)."""
    window = model.config.max_position_embeddings
    for p in prompts:
        if len(p) + o.max_new_tokens + WINDOW_SPARE > window:
            raise ValueError(f"prompt of {len(p)} tokens plus {o.max_new_tokens} new tokens exceeds "
                             f"the model's window of {window} tokens")
    if not prompts:
        return
    o = with_model_defaults(o, model.config)
    if o.quote_search and (o.temperature != 0 or o.engine != "chyd"):
        raise ValueError("quote search is greedy and needs our constraint: give it temperature 0 and engine chyd")
    batch = Batch(model, tok, prompts, contexts, o, contrasts)
    while batch.rows:
        yield from batch.fill()
        yield from batch.step()


def generate_stream(model, tok, questions: list[str], contexts: list[list[str]], *, options: DecodeOptions | None = None,
                    **overrides) -> Iterator[tuple[int, Result]]:
    """Answer questions[i] from contexts[i] with CHyD's prompt; (i, its Result) as each answer ends.

    options (or keyword overrides of its fields: constrained, temperature, top_p, max_new_tokens, seed,
    trigger_bias, quote_first, speculate, lookup, whole_words, no_repeat_ngram, repetition_penalty, engine,
    quote_search, prompt, batch_size, on_token) say how; see DecodeOptions. With constrained, every quote is verbatim by construction.
    """
    o = with_model_defaults(replace(options or DecodeOptions(), **overrides), model.config)
    for i, c in enumerate(contexts):  # a lone string would be read as one passage a character
        if isinstance(c, str) or not all(isinstance(t, str) for t in c):
            raise TypeError(f"the contexts of question {i} must be a list of strings, got {type(c).__name__}")
    prompts = [tok.encode(prompt_for(tok, q, c, o)) for q, c in zip(questions, contexts)]
    contrasts = [tok.encode(prompt_for(tok, "", c, o)) for c in contexts] if o.quote_search else None
    return decode_stream(model, tok, prompts, contexts, o, contrasts)


def generate_batch(model, tok, questions: list[str], contexts: list[list[str]], *, options: DecodeOptions | None = None,
                   **overrides) -> list[Result]:
    """generate_stream's answers in the order of the questions."""
    return [r for _, r in sorted(generate_stream(model, tok, questions, contexts, options=options, **overrides))]


def generate(model, tok, question: str, contexts: list[str], *, options: DecodeOptions | None = None,
             **overrides) -> Result:
    """The answer to one question (generate_stream's)."""
    return generate_batch(model, tok, [question], [contexts], options=options, **overrides)[0]


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


def prompt_fits(window: int, tok, question: str, contexts: list[str], options: DecodeOptions) -> bool:
    """Whether the prompt with every context leaves room for the answer in the model's window (tokens)."""
    if sum(map(len, contexts)) > 8 * window:  # prose never packs 8 characters into a token: no need to count
        return False
    prompt = prompt_for(tok, question, contexts, options)
    return len(tok.encode(prompt)) + options.max_new_tokens + WINDOW_SPARE <= window


class Library:
    """The user's documents. Shown whole (split at blank lines) when they fit the prompt; else the top k
    chunks are retrieved from an index, built or read back when a question first needs it and kept, and shown
    best last, next to the question (README, Answer quality)."""

    def __init__(self, docs: list[Document], args, load_rerank: Callable[[], Callable] | None = None):
        self.docs, self.args, self.load_rerank = docs, args, load_rerank  # load_rerank: --rerank's scorer, loaded
        self.everything = [passage(d, 0, len(d.text)) for d in docs] if args.whole else [p for d in docs for p in paragraphs(d)]
        self.index: Index | None = None
        self.rerank: Callable[[str, list[str]], list[float]] | None = None  # load_scorer's, when a question first needs it

    def passages(self, window: int, tok, question: str, options: DecodeOptions) -> tuple[list[Passage], dict[str, float]]:
        """What the model (whose window holds `window` tokens) is shown for this question, and the seconds spent
        indexing and retrieving."""
        a = self.args
        if not prompt_fits(window, tok, question, [], options):
            raise CliError(f"the question is too long: with the instruction it leaves no room for a passage and the "
                           f"answer in the model's window of {window} tokens")
        if a.top_k == 0 or prompt_fits(window, tok, question, [p.text for p in self.everything], options):
            return self.everything, {"index_s": 0.0, "retrieve_s": 0.0}
        if self.load_rerank and not self.rerank:
            self.rerank = self.load_rerank()
        t0 = time.perf_counter()
        before = self.index.build_s if self.index else 0.0
        if self.index is None:
            self.index = Index(self.docs, a.chunk_tokens, a.chunk_overlap)
        hits = self.index.search(question, a.top_k, a.retriever, self.rerank)  # may build the dense part on first use
        index_s = self.index.build_s - before
        timings = {"index_s": index_s, "retrieve_s": time.perf_counter() - t0 - index_s}
        how = a.retriever
        if self.rerank:  # BM25's own top RERANK_WORDS are in its pool already
            how += f", reranked by {a.rerank} from its top {max(a.top_k, RERANK_POOL)}"
            how += f" and BM25's top {RERANK_WORDS}" if a.retriever != "bm25" else ""
        print(f"chyd: the documents do not fit the prompt; the top {len(hits)} of {len(self.index.chunks)} chunks "
              f"({how}), the best last", file=sys.stderr)
        return hits[::-1], timings


def build_parser() -> Parser:
    p = Parser(prog="chyd.py", description="Answer from documents; every [quote] is verbatim by construction.")
    p.add_argument("--ctx", action="append", required=True, metavar="PATH",
                   help="a text, Markdown or PDF file, or a folder of them (repeatable)")
    p.add_argument("--whole", action="store_true", help="show each file (or PDF page) as one passage, not split at blank lines")
    p.add_argument("-q", "--question", help="the question (else read from stdin, or asked in a loop on a terminal)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the streamed answer")
    add_model_args(p)
    add_server_args(p, concurrency=False)
    add_decoding_args(p, DecodeOptions(), PROMPTS)
    add_retrieval_args(p)
    p.add_argument("--no-constraint", action="store_true", help="decode freely (quotes are not checked)")
    p.add_argument("--show-prompt", action="store_true", help="print the rendered prompt to stderr")
    return p


def source(passages: list[Passage], index: int, offset: int, length: int) -> dict:
    """Where a quote stands: its file, page (and printed page label), line and character range in the document."""
    p = passages[index]
    return {"file": p.file, "page": p.page, "page_label": p.page_label, "line": p.line_at(offset),
            "start": p.start + offset, "end": p.start + offset + length}


def describe(src: dict, index: int) -> str:
    """One source, as the terminal shows it: "passage 2 (m.pdf, p. iv (sheet 6), line 3, chars 10-17)"."""
    page = "" if src["page"] is None else f", page {src['page']}"
    if src["page_label"] not in (None, str(src["page"])):  # the printed number, then the sheet a PDF viewer counts
        page = f", p. {src['page_label']} (sheet {src['page']})"
    return f"passage {index + 1} ({src['file']}{page}, line {src['line']}, chars {src['start']}-{src['end']})"


def applied_defaults(cfg: ModelConfig, options: DecodeOptions, served: bool = False) -> dict:
    """What the model was recognised as, whether quote-first is on, above which p("No answer") it abstains and the
    quote search's width, and why: the flags, or the model (served: by a serving engine, which does not search)."""
    d, o = model_defaults(cfg), with_model_defaults(options, cfg, served)
    d.update(quote_first=o.quote_first, no_answer_above=o.no_answer_above, quote_search=o.quote_search)
    flags = ([f"--{'' if options.quote_first else 'no-'}quote-first"] if options.quote_first is not None else []) + \
            ([f"--no-answer-above {options.no_answer_above:g}"] if options.no_answer_above is not None else []) + \
            ([f"--quote-search {options.quote_search}"] if options.quote_search is not None else [])
    d["why"] = ", ".join(flags + ([] if len(flags) == 3 else [f"the default for {d['model']} ({d['recognised']})"]))
    return d


class Local:
    """The model in this process decodes: answers stream as they are written."""

    def __init__(self, args):
        self.model, self.tok = load_model(args)
        self.cfg, self.engine = self.model.config, engine(self.model, args)
        self.window = self.cfg.max_position_embeddings

    def answer(self, question: str, contexts: list[str], options: DecodeOptions, on_token) -> Result:
        return generate(self.model, self.tok, question, contexts, options=options, on_token=on_token)


class Served:
    """A serving engine decodes under CHyD's grammar (server.py, --server); the checkpoint gives the tokenizer and
    tells what the model is, and no weights are loaded here. Every quote that comes back is checked."""

    def __init__(self, args):
        from server import open_served

        self.server, self.tok, self.cfg = open_served(args.server, args.model, args.served_model)
        self.window = self.server.max_model_len or self.cfg.max_position_embeddings
        self.engine = {"engine": self.server.engine}

    def answer(self, question: str, contexts: list[str], options: DecodeOptions, on_token) -> Result:
        from server import server_stream

        r = next(server_stream(self.server, self.tok, [question], [contexts], options, concurrency=1))[1]
        if on_token:  # the whole answer at once: the server's answer is checked before it is shown
            on_token(r.text.encode(), STANDARD)
        return r


def answer_one(decoder: Local | Served, question: str, library: Library, options: DecodeOptions, args) -> int:
    """Answer and print; 1 when a quote that came back is not in the passages (a server that ignored the grammar)."""
    tok = decoder.tok
    passages, timings = library.passages(decoder.window, tok, question, options)
    contexts = [p.text for p in passages]
    if args.show_prompt:
        print(prompt_for(tok, question, contexts, options), file=sys.stderr)
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    r = decoder.answer(question, contexts, options, None if args.json else StreamPrinter(sys.stdout, colour))
    sources = [[(i, source(passages, i, o, len(s.text))) for i, o in s.sources] for s in r.spans]
    bad = getattr(r, "not_verbatim", [])
    if args.json:
        print(json.dumps({
            "answer": r.text,
            "quotes": [{"text": s.text, "sources": [src for _, src in where]} for s, where in zip(r.spans, sources)],
            "passages": [{"file": p.file, "page": p.page, "page_label": p.page_label, "line": p.line, "start": p.start,
                          "end": p.end, "text": p.text, "score": p.score} for p in passages],
            "spans": [{"text": s.text, "sources": [{"passage": i + 1, **src} for i, src in where]}
                      for s, where in zip(r.spans, sources)],
            "not_verbatim": bad,
            "defaults": decoder.defaults,
            "engine": decoder.engine,
            "tokens": len(r.tokens), "prompt_tokens": r.prompt_tokens,
            "quotes_opened": r.quotes_opened, "quotes_forced": r.quotes_forced,
            "timings": {**{k: round(v, 4) for k, v in timings.items()}, "prefill_s": round(r.prefill_s, 4),
                        "decode_s": round(r.decode_s, 4), "tokens_per_s": round(r.tokens_per_s, 2),
                        "forward_passes": r.forward_passes},
        }, ensure_ascii=False))
    else:
        print()
        for n, where in enumerate(sources, 1):
            print(f"[{n}] " + ("; ".join(describe(src, i) for i, src in where) or "NOT VERBATIM: in no passage"))
    if getattr(r, "finish_reason", "") == "length" and r.quotes_forced:
        print("chyd: the engine stopped at the token limit inside a quote; chyd closed it", file=sys.stderr)
    if bad:
        print(f"chyd: error: {len(bad)} quote(s) from the engine are not in the passages: "
              + "; ".join(repr(b) for b in bad), file=sys.stderr)
    return 1 if bad else 0


def command(argv) -> int:
    args = build_parser().parse_args(argv)
    options = decode_options(args, DecodeOptions(constrained=not args.no_constraint))
    check_retrieval_args(args)
    check_server_args(args)
    docs = read_documents(args.ctx)
    question = args.question
    if question is None and not sys.stdin.isatty():
        question = sys.stdin.read()
    if question is not None and not question.strip():
        raise CliError("the question is empty")
    if args.rerank and args.top_k:
        checkpoint_kind(args.rerank)  # a name that names no model is said now; loaded when a question needs it
    decoder = Served(args) if args.server else Local(args)
    answering = None if args.server else (args.model, decoder.model, decoder.tok)  # scores too when --rerank names it
    library = Library(docs, args, (lambda: load_scorer(args.rerank, args.device, answering)) if args.rerank else None)
    decoder.defaults = d = applied_defaults(decoder.cfg, options, served=bool(args.server))
    options = replace(options, quote_first=d["quote_first"], no_answer_above=d["no_answer_above"],
                      quote_search=d["quote_search"])
    details = f", No answer where its probability is above {d['no_answer_above']:.2g}" if d["quote_first"] else ""
    details += f", quote search {d['quote_search']}" if d["quote_search"] else ""
    if args.no_constraint:  # nothing is forced: quote-first shows only in the worked examples' form
        form = f" (the worked examples open with their quote: quote-first, {d['why']})" if d["quote_first"] else ""
        print(f"chyd: --no-constraint: decoded freely, no quote forced or checked{form}", file=sys.stderr)
    else:
        print(f"chyd: quote-first {'on' if d['quote_first'] else 'off'}{details}: {d['why']}", file=sys.stderr)
    if not prompt_fits(decoder.window, decoder.tok, "", [], options):  # said once, not for each question
        raise CliError(f"--max-new-tokens {options.max_new_tokens} leaves no room for the prompt in the model's "
                       f"window of {decoder.window} tokens")
    if args.server:
        from server import unsupported  # server.py builds on this file: imported where a server is asked for

        if ignored := unsupported(options):
            print(f"chyd: the engine does not apply {', '.join(ignored)}", file=sys.stderr)
    if question is not None:
        return answer_one(decoder, question, library, options, args)
    while True:  # a terminal: keep the model and the index loaded and ask
        try:
            question = input("question> ")
        except EOFError:
            print()
            return 0
        if question.strip():
            try:
                answer_one(decoder, question, library, options, args)
            except USER_ERRORS as e:  # the next question may be fine: the model and the index stay loaded
                print(f"chyd.py: error: {e}", file=sys.stderr)


def main(argv=None) -> int:
    return run_cli("chyd.py", command, argv)


if __name__ == "__main__":
    sys.exit(main())
