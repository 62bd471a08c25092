"""Constrained Hybrid Decoding: free text, and verbatim quotes from the contexts between [ and ].

    python chyd.py --ctx data/manual.txt -q "What pressure should the main wheel tyres be inflated to?"

In STANDARD mode the model writes freely but may not write a bracket except a trigger token ending
in `[`. That switches to EEC mode (extraction), where only tokens that keep the quote a verbatim
substring of some context, or an exit token `]...`, may be sampled.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from suffix_tree import SuffixTree, TokenTrie, allowed_tokens

STANDARD, EEC = "STANDARD", "EEC"
NO_ANSWER = "No answer"
SPECULATE_K = 8  # tokens drafted from the context inside a quote
LOOKUP_TOKENS = 3  # outside quotes, the answer's last tokens looked up in the contexts for a draft
QUOTE_FIRST_MODELS = {"smollm2"}  # small models that rarely open a quote on their own
DATA = Path(__file__).resolve().parent / "data"
EXIT_RE = re.compile(rb"\s*\][^\[\]]*")  # optional whitespace, the bracket, then a tail of free text
SYSTEM_PROMPT = (
    "Answer the question using only the passages. Copy the words that support your answer exactly as "
    "they stand in a passage, between [ and ]. If the passages do not contain the answer, reply "
    "exactly: No answer"
)


@dataclass
class TokenClasses:
    """What each token id is to the decoder, computed once per tokenizer."""

    token_bytes: list[bytes]  # padded to the model's vocabulary
    trigger: torch.Tensor  # [V] bool: the only bracket is a final `[`
    exit_ids: torch.Tensor  # [n] long: whitespace, `]`, a tail without brackets
    standard_banned: torch.Tensor  # [V] bool: every other token with a bracket
    stop_ids: torch.Tensor  # [n] long
    open_id: int  # the canonical `[`
    close_id: int  # the canonical `]`
    trie: TokenTrie  # the tokens a quote may continue with: no bracket, not special
    cannot_start: torch.Tensor  # [V] bool: only whitespace, or a UTF-8 continuation byte first: no quote begins so


@lru_cache(maxsize=4)
def token_classes(tok, vocab_size: int) -> TokenClasses:
    token_bytes = list(tok.token_bytes[:vocab_size]) + [b""] * (vocab_size - len(tok.token_bytes))
    special = set(tok.special_ids) | set(tok.eos_ids)
    trigger, exits, banned, quotable = (torch.zeros(vocab_size, dtype=torch.bool) for _ in range(4))
    for i, b in enumerate(token_bytes):
        if i in special or not b:
            continue
        if b"[" not in b and b"]" not in b:
            quotable[i] = True
        elif b.endswith(b"[") and b.count(b"[") == 1 and b"]" not in b:
            trigger[i] = True
        else:
            exits[i] = EXIT_RE.fullmatch(b) is not None
            banned[i] = True  # exits too: outside a quote there is nothing to close
    canonical = {b: i for i in reversed(range(vocab_size)) if (b := token_bytes[i]) in (b"[", b"]") and i not in special}
    if len(canonical) < 2:
        raise ValueError("the tokenizer has no token `[` or no token `]`, so it cannot quote")
    return TokenClasses(token_bytes, trigger, exits.nonzero().flatten(), banned,
                        torch.tensor(sorted(tok.eos_ids), dtype=torch.long), canonical[b"["], canonical[b"]"],
                        TokenTrie(token_bytes, quotable.nonzero().flatten().tolist()),
                        torch.tensor([0x80 <= b[0] < 0xC0 or utf8_complete(b) and not b.decode(errors="ignore").strip()
                                      if b else True for b in token_bytes]))


def utf8_complete(data: bytes) -> bool:
    """Whether data does not end inside a multi-byte UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b < 0x80:
            return back == 1
        if b >= 0xC0:  # a lead byte: how many bytes its character needs
            return back == (2 if b < 0xE0 else 3 if b < 0xF0 else 4)
    return not data


class Constraint:
    """The CHyD state machine: mode, the quote's cursor in the suffix tree, and the mask of each step."""

    def __init__(self, classes: TokenClasses, contexts: list[str], trigger_bias: float = 0.0):
        self.c = classes
        self.tree = SuffixTree([s.encode() for s in contexts])
        self.mode = STANDARD
        self.quote = b""
        self.closable = False  # the quote is non-blank and ends on a character: `]` may follow
        self.cursor = self.tree.root()
        self.opened = self.forced_closes = 0
        self._allowed = None
        self.can_quote = len(self.allowed()) > 0  # False with no (or blank) contexts
        bias = torch.zeros(len(classes.token_bytes))
        bias[classes.standard_banned] = float("-inf")
        bias[classes.trigger] = trigger_bias if self.can_quote else float("-inf")
        self.standard_bias = bias  # [V], added to the logits in STANDARD mode

    def allowed(self) -> torch.Tensor:
        """Ids that extend the quote verbatim (EEC mode), computed once per cursor."""
        if self._allowed is None:
            ids = allowed_tokens(self.cursor, self.c.trie)
            # a quote starts on a character with something to read, so that it never ends up blank or garbled
            self._allowed = ids[~self.c.cannot_start[ids]] if not self.quote.strip() else ids
        return self._allowed

    def rows(self) -> torch.Tensor | None:
        """The ids whose logits this step needs: None (all) outside a quote."""
        if self.mode == STANDARD:
            return None
        if not self.closable:
            return self.allowed()
        c = self.c
        return torch.cat([self.allowed(), c.exit_ids, c.stop_ids, torch.tensor([c.close_id])])

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that continue the quote along one of its occurrences, longest token first."""
        if self.mode != EEC or self.cursor.depth == 0:
            return []
        i, offset = self.cursor.first_occurrence()
        return spell(self.tree.contexts[i], offset + self.cursor.depth, self.c.trie, k)

    def dead_end(self) -> bool:
        """In a quote that no token can extend: the decoder must close it."""
        return self.mode == EEC and len(self.allowed()) == 0

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> logits with every token the current mode forbids at -inf."""
        if self.mode == STANDARD:
            return logits + self.standard_bias.to(logits.device)
        ids = self.allowed().to(logits.device)
        out = torch.full_like(logits, float("-inf"))
        out[ids] = logits[ids]
        if self.closable:
            c = self.c
            out[c.exit_ids] = logits[c.exit_ids]
            # a stop token inside a quote closes it: its probability goes to `]`
            stops = torch.cat([torch.tensor([c.close_id]), c.stop_ids]).to(logits.device)
            out[c.close_id] = torch.logsumexp(logits[stops].float(), 0).to(logits.dtype)
        return out

    def advance(self, token: int) -> None:
        """The transition: delta(STANDARD, trigger) = EEC, delta(EEC, exit) = STANDARD, else the same mode."""
        if self.mode == STANDARD:
            if self.c.trigger[token]:
                self.mode, self.quote, self.closable, self.cursor, self._allowed = EEC, b"", False, self.tree.root(), None
                self.opened += 1
            return
        if token == self.c.close_id or bool((self.c.exit_ids == token).any()):
            self.mode = STANDARD
            return
        b = self.c.token_bytes[token]
        cursor = self.cursor.step(b)
        if cursor is None:
            raise AssertionError(f"token {token} {b!r} leaves the contexts: the mask was not applied")
        self.cursor, self.quote, self._allowed = cursor, self.quote + b, None
        self.closable = utf8_complete(self.quote) and bool(self.quote.decode("utf-8", errors="ignore").strip())


def spell(text: bytes, at: int, trie: TokenTrie, k: int) -> list[int]:
    """Up to k tokens that spell text[at:], each the longest that fits; stops at a bracket or the end."""
    children, ids, out = trie.children, trie.ids, []
    while len(out) < k:
        node, best, j = 0, None, at
        while j < len(text) and (node := children[node].get(text[j])) is not None:
            j += 1
            if ids[node]:
                best = (ids[node][0], j)
        if best is None:
            break
        out.append(best[0])
        at = best[1]
    return out


def lookup_draft(tree: SuffixTree, classes: TokenClasses, tokens: list[int], k: int) -> list[int]:
    """Prompt lookup: where the answer's last LOOKUP_TOKENS tokens (else its last 2) occur in a context,
    the up to k tokens that follow them there. One token alone matches too often to be worth a pass."""
    for n in range(min(LOOKUP_TOKENS, len(tokens)), 1, -1):
        recent = b"".join(classes.token_bytes[t] for t in tokens[-n:])
        cursor = tree.root().step(recent)
        if cursor is not None:
            i, offset = cursor.first_occurrence()
            return spell(tree.contexts[i], offset + len(recent), classes.trie, k)
    return []


class ChydLogitsProcessor:
    """CHyD for transformers' `generate`: pass it in `logits_processor=[...]` with the prompt's length.

    The decoder's forced closes become masks that leave only `]`. transformers stops at max_new_tokens
    even inside a quote; our own `generate` closes it.
    """

    def __init__(self, constraint: Constraint, prompt_len: int):
        self.constraint, self.seen = constraint, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for token in input_ids[0, self.seen:].tolist():  # batch 1: catch up with the tokens chosen since
            self.constraint.advance(token)
        self.seen = input_ids.shape[1]
        if self.constraint.dead_end():
            out = torch.full_like(scores, float("-inf"))
            out[:, self.constraint.c.close_id] = 0.0
            return out
        return self.constraint.mask(scores[0])[None]


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
    quotes_forced: int = 0  # closed by the decoder: dead end, stop token or budget
    prefill_s: float = 0.0
    decode_s: float = 0.0
    forward_passes: int = 0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s else 0.0


def find_spans(text: str, contexts: list[str]) -> list[Span]:
    """The bracketed spans of an answer, each with every place it occurs in the contexts."""
    from eval import extract_spans

    encoded = [c.encode() for c in contexts]
    spans = []
    for s in extract_spans(text):
        needle, sources = s.encode(), []
        for i, c in enumerate(encoded):
            at = c.find(needle)
            while needle and at != -1:
                sources.append((i, len(c[:at].decode("utf-8", errors="ignore"))))
                at = c.find(needle, at + 1)
        spans.append(Span(s, sources))
    return spans


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


@torch.inference_mode()
def generate(model, tok, question: str, contexts: list[str], constrained: bool = True, temperature: float = 0.7,
             top_p: float = 0.9, max_new_tokens: int = 64, seed: int = 0, trigger_bias: float = 0.0,
             quote_first: bool = False, speculate: bool = True, lookup: bool = False, on_token=None) -> Result:
    """Answer `question` from `contexts`; with `constrained`, every quote is verbatim by construction.

    trigger_bias is added to the logits of `[` tokens outside quotes. With quote_first the answer opens
    with a quote, unless the model gives "No answer" a probability above one half. With speculate, a
    quote's continuation in the context is drafted and verified in one pass (same output distribution).
    With lookup, so is the continuation of the answer's last tokens where they occur in a context, outside quotes.
    on_token(token_bytes, mode) is called as each token is chosen, for streaming.
    """
    t0 = time.perf_counter()
    prompt = tok.encode(build_prompt(tok, question, contexts))
    window = model.config.max_position_embeddings
    if len(prompt) + max_new_tokens + 4 > window:  # a few tokens spare for forced closes
        raise ValueError(f"prompt of {len(prompt)} tokens plus {max_new_tokens} new tokens exceeds "
                         f"the model's window of {window} tokens")
    ensure_cache(model, len(prompt) + max_new_tokens + SPECULATE_K + 8)
    V = model.config.vocab_size
    classes = token_classes(tok, V)
    constraint = Constraint(classes, contexts, trigger_bias) if constrained else None
    # the tree that lookup drafts come from: the constraint's own, or one built for them
    tree = (constraint.tree if constraint else SuffixTree([c.encode() for c in contexts])) if lookup else None
    device = model.tok_embeddings.weight.device
    free_bias = (classes.trigger.float() * trigger_bias).to(device)  # the same push to quote, unconstrained
    generator = torch.Generator(device).manual_seed(seed)
    stops = set(tok.eos_ids)
    tokens, modes = [], []

    def emit(token: int, mode: str) -> None:
        if constraint:
            constraint.advance(token)
        tokens.append(token)
        modes.append(mode)
        if on_token:
            on_token(classes.token_bytes[token], mode)

    def propose(k: int) -> list[int]:
        """Up to k tokens to verify along with the next one: the quote's continuation, or a lookup's."""
        if constraint and constraint.mode == EEC:
            return constraint.draft(k) if speculate else []
        return lookup_draft(tree, classes, tokens, k) if lookup else []

    def choose(h: torch.Tensor, draft: int | None) -> int:
        """One step of the paper's loop for hidden state h [dim]: mask for the mode, then sample."""
        if constraint and constraint.dead_end():
            constraint.forced_closes += 1
            return classes.close_id  # no token extends the quote: close it without sampling
        rows = constraint.rows() if constraint else None
        logits = model.logits(h, rows if rows is not None and len(rows) <= V // 8 else None).float()
        masked = constraint.mask(logits) if constraint else logits + free_bias
        return sample(masked, temperature, top_p, generator, draft)

    hidden = forward_hidden(model, prompt, 0)[-1:]  # [1, dim]: the prefill
    t1 = time.perf_counter()
    pos, passes, pending, drafts, done = len(prompt), 1, [], [], False
    draft_len = SPECULATE_K  # shrinks after rejections, so that a quote about to close costs no long pass
    if quote_first and constraint and constraint.can_quote:
        no_answer = tok.encode(NO_ANSWER)
        passes += len(no_answer) > 1
        if no_answer_likelier(model, model.logits(hidden[0]).float(), no_answer, pos):
            for token in no_answer:
                emit(token, STANDARD)
            done = True
        else:  # as if the model had written `[`
            emit(classes.open_id, STANDARD)
            pending = [classes.open_id]

    while not done:
        if pending:  # feed the last token, and a draft to verify with it
            drafts = propose(draft_len)
            hidden = forward_hidden(model, pending + drafts, pos)[len(pending) - 1:]
            pos, passes, pending = pos + len(pending), passes + 1, []
        for i, h in enumerate(hidden):  # h follows the last fed token, then each drafted one
            draft = drafts[i] if i < len(drafts) else None
            mode = constraint.mode if constraint else STANDARD
            token = choose(h, draft)
            if token in stops:
                done = True
                break
            emit(token, mode)
            # the budget ends the answer, but never inside an empty quote or a UTF-8 character
            if len(tokens) >= max_new_tokens and not (constraint and constraint.mode == EEC and not constraint.closable):
                done = True
                break
            if token != draft:  # a rejected draft, or none: the rest of the pass is stale
                pending = [token]
                if drafts:
                    draft_len = min(SPECULATE_K, 2 * i + 1)
                break
            pos += 1  # an accepted draft token is in the cache already
    if constraint and constraint.mode == EEC:  # budget reached inside a quote
        constraint.forced_closes += 1
        emit(classes.close_id, EEC)
    t2 = time.perf_counter()
    text = tok.decode(tokens)
    return Result(text, find_spans(text, contexts), tokens, modes, len(prompt),
                  constraint.opened if constraint else text.count("["),
                  constraint.forced_closes if constraint else 0, t1 - t0, t2 - t1, passes)


@dataclass
class Passage:
    text: str
    file: str
    line: int  # line of the file the passage starts on, from 1
    char: int  # offset of the passage in the file, in characters


def read_contexts(paths: list[str], whole: bool = False) -> list[Passage]:
    """Each file, split into passages at blank lines (kept whole with `whole`)."""
    passages = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ValueError(f"context file {p} does not exist")
        data = path.read_bytes()
        if b"\0" in data:
            raise ValueError(f"context file {p} is binary, not text")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"context file {p} is not UTF-8 text (byte {e.start})") from None
        if not text.strip():
            raise ValueError(f"context file {p} is empty")
        pieces = [(m.start(), m.group()) for m in re.finditer(r"\S(?:.|\n(?!\s*\n))*", text)] if not whole \
            else [(0, text)]
        for start, piece in pieces:
            passages.append(Passage(piece, p, text.count("\n", 0, start) + 1, start))
    return passages


def describe_source(passages: list[Passage], index: int, offset: int, length: int) -> str:
    p = passages[index]
    line = p.line + p.text.count("\n", 0, offset)
    start = p.char + offset
    return f"passage {index + 1} ({p.file}, line {line}, chars {start}-{start + length})"


class StreamPrinter:
    """Prints the answer as it is generated, quotes highlighted on a colour terminal."""

    def __init__(self, out, colour: bool):
        import codecs

        self.out, self.colour, self.in_quote = out, colour, False
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


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="chyd.py", description="Answer from passages; every [quote] is verbatim by construction.")
    p.add_argument("--model", default="smollm2", help="alias, hub repo id, local folder or .gguf file")
    p.add_argument("--ctx", action="append", required=True, metavar="FILE",
                   help="context file; blank lines separate passages (repeatable)")
    p.add_argument("--whole", action="store_true", help="keep each context file as one passage")
    p.add_argument("-q", "--question", help="the question (else read from stdin, or asked in a loop on a terminal)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the streamed answer")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--greedy", action="store_true", help="temperature 0")
    p.add_argument("--trigger-bias", type=float, default=0.0, help="added to the logits of `[` tokens outside quotes")
    p.add_argument("--quote-first", action=argparse.BooleanOptionalAction, default=None,
                   help="open the answer with a quote unless the model prefers 'No answer' (default: on for smollm2)")
    p.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=True,
                   help="inside a quote, draft its continuation from the passage and verify it in one pass")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=False,
                   help="outside quotes, draft what follows the answer's last tokens in a passage and verify it in one pass")
    p.add_argument("--compile", action="store_true",
                   help="compile the one-token step (torch.compile; one to two minutes the first time, then cached)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--no-constraint", action="store_true", help="decode freely (quotes are not checked)")
    p.add_argument("--show-prompt", action="store_true", help="print the rendered prompt to stderr")
    return p


def check_generation_args(args) -> None:
    if args.greedy:
        args.temperature = 0.0
    if not args.temperature >= 0:
        raise CliError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise CliError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.quote_first is None:
        args.quote_first = args.model in QUOTE_FIRST_MODELS


def answer_one(model, tok, question: str, passages: list[Passage], args) -> None:
    contexts = [p.text for p in passages]
    if args.show_prompt:
        print(build_prompt(tok, question, contexts), file=sys.stderr)
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    printer = None if args.json else StreamPrinter(sys.stdout, colour)
    r = generate(model, tok, question, contexts, constrained=not args.no_constraint, temperature=args.temperature,
                 top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed,
                 trigger_bias=args.trigger_bias, quote_first=args.quote_first, speculate=args.speculate,
                 lookup=args.lookup, on_token=printer)
    if args.json:
        print(json.dumps({
            "answer": r.text,
            "spans": [{"text": s.text, "sources": [
                {"passage": i + 1, "file": passages[i].file, "line": passages[i].line + passages[i].text.count("\n", 0, o),
                 "start": passages[i].char + o, "end": passages[i].char + o + len(s.text)} for i, o in s.sources]}
                for s in r.spans],
            "tokens": len(r.tokens), "prompt_tokens": r.prompt_tokens,
            "quotes_opened": r.quotes_opened, "quotes_forced": r.quotes_forced,
            "timings": {"prefill_s": round(r.prefill_s, 4), "decode_s": round(r.decode_s, 4),
                        "tokens_per_s": round(r.tokens_per_s, 2), "forward_passes": r.forward_passes},
        }, ensure_ascii=False))
        return
    print()
    for n, s in enumerate(r.spans, 1):
        where = "; ".join(describe_source(passages, i, o, len(s.text)) for i, o in s.sources) or "not in the passages"
        print(f"[{n}] {where}")


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_generation_args(args)
        passages = read_contexts(args.ctx, args.whole)
        question = args.question
        if question is None and not sys.stdin.isatty():
            question = sys.stdin.read()
        if question is not None and not question.strip():
            raise CliError("the question is empty")
        from model import load

        dtype = getattr(torch, args.dtype) if args.dtype else None
        model, tok = load(args.model, dtype=dtype, device=args.device)
        if args.compile:
            model.compile_decode_step()
        if question is not None:
            answer_one(model, tok, question, passages, args)
            return 0
        while True:  # a terminal: keep the model loaded and ask
            try:
                question = input("question> ")
            except EOFError:
                print()
                return 0
            if question.strip():
                answer_one(model, tok, question, passages, args)
    except (CliError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"chyd.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
