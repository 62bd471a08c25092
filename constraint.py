"""The CHyD constraint: what each token is, the mask of each step, the transitions, every forced close.

    classes = token_classes(tok, model.config.vocab_size)
    c = Constraint(classes, contexts)
    token = c.forced()                       # `]` when no token can extend the quote, else None
    token = sample(c.mask(logits)) if token is None else token
    c.advance(token)                         # delta(STANDARD, trigger) = EEC, delta(EEC, exit) = STANDARD

In STANDARD mode the model writes freely but may not write a bracket except a trigger token ending in
`[`. That switches to EEC mode (extraction), where only tokens that keep the quote a verbatim substring
of some context, or an exit token `]...`, may be chosen. Matching is on UTF-8 bytes.
"""
from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache

import torch

from suffix_tree import SuffixTree, TokenTrie, allowed_tokens

STANDARD, EEC = "STANDARD", "EEC"
LOOKUP_TOKENS = 3  # outside quotes, the answer's last tokens looked up in the contexts for a draft
EXIT_RE = re.compile(rb"\s*\][^\[\]]*")  # optional whitespace, the bracket, then a tail of free text
SPAN_RE = re.compile(r"\[([^\[\]]*)\]")
WORD_RE = re.compile(r"[^\W_]{2}")  # two letters or digits in a row: a quote holds at least one such word
TERM_RE = re.compile(r"(-+[^\W_]|[^\W_]*[^\W\d_])[^\W_]*(-[^\W_]+)*")  # or is one term: -y, zR, C-b, -6; not 12


def extract_spans(answer: str) -> list[str]:
    """The non-empty bracketed spans of an answer, outer whitespace stripped."""
    return [s.strip() for s in SPAN_RE.findall(answer) if s.strip()]


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
    longest: int  # bytes of the longest quotable token


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
                                      if b else True for b in token_bytes]),
                        max(len(token_bytes[i]) for i in quotable.nonzero().flatten().tolist()))


def utf8_complete(data: bytes) -> bool:
    """Whether data does not end inside a multi-byte UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b < 0x80:
            return back == 1
        if b >= 0xC0:  # a lead byte: how many bytes its character needs
            return back == (2 if b < 0xE0 else 3 if b < 0xF0 else 4)
    return not data


def ends_on_char(quote: bytes) -> bool:
    """Whether a quote is non-blank and does not end inside a UTF-8 character: `]` may follow."""
    return utf8_complete(quote) and bool(quote.decode("utf-8", errors="ignore").strip())


def joins_words(a: str, b: str) -> bool:
    """Whether two adjacent characters belong to one word: letters or digits of a script written with spaces
    (in Chinese, Japanese or Thai any character may begin a quote)."""
    return a.isalnum() and b.isalnum() and not (unspaced(a) or unspaced(b))


def unspaced(ch: str) -> bool:
    return ch >= "\u0e00" and (unicodedata.east_asian_width(ch) in "WF" or "\u0e00" <= ch <= "\u0eff"
                                or "\u1000" <= ch <= "\u109f" or "\u1780" <= ch <= "\u17ff")


def holds_word(quote: bytes) -> bool:
    """Two letters or digits in a row, in more than two bytes, or one term of two characters or more with a letter
    or a leading dash (a command, an option, a key: reference manuals answer with them): no [1], [,] or [12];
    [psi], [2004], two Chinese characters (six bytes), [zR], [-y], [C-b] and [-6] may close."""
    text = quote.decode().strip()  # str.strip: a quote's own rule
    return (len(text.encode()) > 2 and WORD_RE.search(text) is not None
            or len(text) > 1 and TERM_RE.fullmatch(text) is not None)


@lru_cache(maxsize=64)
def word_edges(text: bytes) -> tuple[bytes, bytes, dict[int, int]]:
    """Where a whole-words quote may end and where it may start, as two masks of len(text) + 1 bytes (1: yes), and
    where a quote that starts at a term with no word ahead must end: {its start: the term's end}.

    It may end at a character's first byte that does not split a word, and at either end of the text. A word's
    leading dashes (an option's, a minus sign: "-y", "--count", "-40") and a number's point or comma between
    digits ("0.25", "1,000") belong to it: no quote ends or starts inside "-40" or "0.25". It may start there
    too, if what follows up to the next bracket or the end would hold a word, or the next term would
    (holds_word); from a term alone it may not run past the term (`[-F]`, not `[-F.]`): so a quote never reaches
    a dead end without one.
    """
    s = text.decode()
    ends = bytearray(len(text) + 1)
    starts = bytearray(len(text) + 1)
    term_ends = {}
    joint = lambda j: 0 < j < len(s) - 1 and s[j] in ".," and s[j - 1].isdigit() and s[j + 1].isdigit()  # 0.25
    at, prev, leading_dash, positions = 0, "", False, []
    for i, ch in enumerate(s):
        inside = joint(i) or joint(i - 1) or leading_dash and (ch == "-" or ch.isalnum())  # "0.25", "-y", "--count"
        ends[at] = not (joins_words(prev, ch) or inside)
        positions.append(at)
        at += 1 if ch < "\x80" else len(ch.encode())
        leading_dash = ch == "-" and (leading_dash if prev == "-" else not prev.isalnum())  # "10-20": not leading
        prev = ch
    ends[at] = 1
    positions.append(at)
    word_ahead, last_end, next_char = False, 0, 0  # up to the next bracket: a word; the last non-blank's end
    term_next = False  # the next non-blank character begins a term that may close (TERM_RE)
    for i in range(len(s) - 1, -1, -1):
        ch = s[i]
        if ch in "[]":
            word_ahead, last_end, term_next = False, 0, False
            continue
        if not ch.isspace():
            next_char = positions[i]
            last_end = last_end or positions[i + 1]
            term = TERM_RE.match(s, i) if ends[positions[i]] else None
            term_next = term is not None and term.end() - i > 1 and ends[positions[term.end()]] == 1
        word_ahead = word_ahead or WORD_RE.match(s, i, i + 2) is not None
        starts[positions[i]] = ends[positions[i]] and (word_ahead and last_end - next_char > 2 or term_next)
        if starts[positions[i]] and not (word_ahead and last_end - next_char > 2):
            term_ends[positions[i]] = positions[term.end()]
    return bytes(ends), bytes(starts), term_ends


class Rules:
    """What the decoding loop asks of a language of answers: the mode, the mask of each step and the transition.
    The loop also asks for a forced token, the vocabulary rows a step needs and drafts to verify; these defaults
    force nothing, need every row and draft nothing. Constraint answers all of them from the suffix tree;
    GrammarConstraint, llguidance's matcher, only masks and advances."""

    def __init__(self, classes: TokenClasses, contexts: list[str]):
        self.c = classes
        self.tree = SuffixTree([s.encode() for s in contexts])
        self.mode = STANDARD
        self.quote = b""  # the open quote's bytes so far
        self.on_char = False  # the quote is non-blank and ends on a whole character
        self.opened = self.forced_closes = 0
        self.can_quote = False  # whether anything can be quoted: set by each language

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> logits with every token the current mode forbids at -inf."""
        raise NotImplementedError

    def advance(self, token: int) -> None:
        """The transition on the token written."""
        raise NotImplementedError

    def forced(self) -> int | None:
        """The token to write without sampling, if any."""
        return None

    def rows(self) -> torch.Tensor | None:
        """The ids whose logits this step needs, None: all."""
        return None

    def draft(self, k: int) -> list[int]:
        """Up to k tokens likely to follow inside a quote, to verify in one pass."""
        return []

    def lookup_draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow the answer's tokens outside quotes."""
        return []

    def may_end(self) -> bool:
        """Whether the answer may stop here: never inside an empty quote or a UTF-8 character."""
        return self.mode == STANDARD or self.on_char

    def close(self) -> int | None:
        """At the token budget: `]` if a quote is open, so that no answer ends inside one; else None."""
        if self.mode == EEC:
            self.forced_closes += 1
            return self.c.close_id
        return None

    def sources(self, span: str) -> list[tuple[int, int]]:
        """(context index, char offset) of every occurrence of span in the contexts, sorted."""
        cursor = self.tree.root().step(span.encode()) if span else None
        if cursor is None:
            return []
        contexts = self.tree.contexts
        return [(i, len(contexts[i][:at].decode("utf-8", errors="ignore"))) for i, at in cursor.occurrences()]


class Constraint(Rules):
    """The CHyD state machine: mode, the quote's cursor in the suffix tree, and the mask of each step.

    With verbatim=False the same object runs free decoding (the baseline): nothing is masked, triggers
    get the same bias, and the mode never leaves STANDARD, so one decoding loop serves both.

    With whole_words, a quote also starts and ends on word boundaries of the passage and holds a word of
    two or more letters or digits, or is a term, before it may close (no `[1]`, `[,]` or `[ressure]`; `[zR]`,
    `[-y]`; holds_word): it follows only
    its occurrences that start on a boundary (`live`). A dead end still closes it; at the budget chyd's loop closes
    it, or leaves it out while it holds no word.
    """

    def __init__(self, classes: TokenClasses, contexts: list[str], trigger_bias: float = 0.0, verbatim: bool = True,
                 whole_words: bool = False):
        super().__init__(classes, contexts)
        self.verbatim, self.whole_words = verbatim, whole_words
        self.closable = False  # `]` may follow: on_char, and with whole_words at a word's end after a word
        self.cursor = self.tree.root()
        self.live: list[tuple[int, int]] = []  # whole_words: (context, start) of the quote's occurrences on a boundary
        self.edges = [word_edges(c) for c in self.tree.contexts] if whole_words else []  # (ends, starts, term_ends)
        self._first_allowed = None
        self._allowed = self._rows = None  # both follow the cursor: reset on every transition
        self.can_quote = verbatim and len(self.allowed()) > 0  # False with no (or blank) contexts
        bias = classes.trigger.float() * trigger_bias
        if verbatim:
            bias[classes.standard_banned] = float("-inf")
            bias[classes.trigger] = trigger_bias if self.can_quote else float("-inf")
        self.standard_bias = bias  # [V], added to the logits in STANDARD mode

    def allowed(self) -> torch.Tensor:
        """Ids that extend the quote verbatim (EEC mode), computed once per cursor."""
        if self._allowed is None:
            if not self.whole_words:
                ids = allowed_tokens(self.cursor, self.c.trie)
            elif self.quote:
                ids = self.tokens_at([(i, s + len(self.quote), self.end_of(i, s)) for i, s in self.live])
            else:  # the same at every quote's start: computed once
                if self._first_allowed is None:
                    self._first_allowed = self.tokens_at([(i, at, self.end_of(i, at)) for i, (_, starts, _) in
                                                          enumerate(self.edges) for at, ok in enumerate(starts) if ok])
                ids = self._first_allowed
            # a quote starts on a character with something to read, so that it never ends up blank or garbled
            self._allowed = ids[~self.c.cannot_start[ids]] if not self.quote.strip() else ids
        return self._allowed

    def end_of(self, i: int, start: int) -> int:
        """How far a quote that starts at this byte of context i may run: the end of its term, or of the context."""
        return self.edges[i][2].get(start, len(self.tree.contexts[i]))

    def tokens_at(self, positions: list[tuple[int, int, int]]) -> torch.Tensor:
        """Ids of the tokens that spell the text at some (context, byte offset) before an end, walked in the token trie."""
        children, trie_ids, contexts = self.c.trie.children, self.c.trie.ids, self.tree.contexts
        out = set()
        for text in {contexts[i][at:min(at + self.c.longest, end)] for i, at, end in positions}:
            node = 0
            for b in text:
                node = children[node].get(b)
                if node is None:
                    break
                out.update(trie_ids[node])
        return torch.tensor(sorted(out), dtype=torch.long)

    def rows(self) -> torch.Tensor | None:
        """The ids whose logits this step needs, None (all) outside a quote: in a quote, the continuations,
        and once it may close, the exits, `]` and the stop tokens (whose probability goes to `]`)."""
        if self.mode == STANDARD:
            return None
        if self._rows is None:
            c = self.c
            self._rows = torch.cat([self.allowed(), c.exit_ids, c.stop_ids, torch.tensor([c.close_id])]) \
                if self.closable else self.allowed()
        return self._rows

    def forced(self) -> int | None:
        """The token to write without sampling: `]` in a quote that no token can extend (a dead end)."""
        if self.mode == EEC and len(self.allowed()) == 0:
            self.forced_closes += 1
            return self.c.close_id
        return None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> logits with every token the current mode forbids at -inf.

        In a quote, a stop token closes the quote: its probability goes to `]`, and decoding goes on.
        """
        if self.mode == STANDARD:
            if self.standard_bias.device != logits.device:  # moved once, not on every step
                self.standard_bias = self.standard_bias.to(logits.device)
            return logits + self.standard_bias
        ids = self.rows().to(logits.device)
        out = torch.full_like(logits, float("-inf"))
        out[ids] = logits[ids]
        if self.closable:
            c = self.c
            stops = torch.cat([torch.tensor([c.close_id]), c.stop_ids]).to(logits.device)
            out[c.close_id] = torch.logsumexp(logits[stops].float(), 0).to(logits.dtype)
            out[c.stop_ids] = float("-inf")
        return out

    def advance(self, token: int) -> None:
        """The transition: delta(STANDARD, trigger) = EEC, delta(EEC, exit) = STANDARD, else the same mode."""
        if self.mode == STANDARD:
            if not self.verbatim:
                self.opened += self.c.token_bytes[token].count(b"[")
            elif self.c.trigger[token]:
                self.mode, self.quote, self.on_char, self.closable, self.cursor = EEC, b"", False, False, self.tree.root()
                self._allowed = self._rows = None
                self.opened += 1
            return
        if token == self.c.close_id or bool((self.c.exit_ids == token).any()):
            self.mode = STANDARD
            return
        b = self.c.token_bytes[token]
        cursor = self.cursor.step(b)
        if cursor is None:
            raise AssertionError(f"token {token} {b!r} leaves the contexts: the mask was not applied")
        self.cursor, self.quote, self._allowed, self._rows = cursor, self.quote + b, None, None
        self.on_char = self.closable = ends_on_char(self.quote)
        if self.whole_words:
            contexts, n = self.tree.contexts, len(self.quote)
            if n == len(b):  # the first token: its occurrences that start on a boundary
                self.live = [(i, at) for i, at in cursor.occurrences() if self.edges[i][1][at]]
            else:
                self.live = [(i, at) for i, at in self.live if contexts[i].startswith(b, at + n - len(b))]
            self.live = [(i, at) for i, at in self.live if at + n <= self.end_of(i, at)]
            self.closable = (self.on_char and holds_word(self.quote)
                             and any(self.edges[i][0][at + n] for i, at in self.live))

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that continue the quote along one of its occurrences, longest token first."""
        if self.mode != EEC or self.cursor.depth == 0:
            return []
        i, offset = self.live[0] if self.whole_words else self.cursor.first_occurrence()
        return spell(self.tree.contexts[i], offset + self.cursor.depth, self.c.trie, k)

    def lookup_draft(self, tokens: list[int], k: int) -> list[int]:
        """Prompt lookup: where the answer's last LOOKUP_TOKENS tokens (else its last 2) occur in a context,
        the up to k tokens that follow them there. One token alone matches too often to be worth a pass."""
        for n in range(min(LOOKUP_TOKENS, len(tokens)), 1, -1):
            recent = b"".join(self.c.token_bytes[t] for t in tokens[-n:])
            cursor = self.tree.root().step(recent)
            if cursor is not None:
                i, offset = cursor.first_occurrence()
                return spell(self.tree.contexts[i], offset + len(recent), self.c.trie, k)
        return []


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


def lark_grammar(contexts: list[str], quote_first: bool = False, whole_words: bool = False,
                 inside_quote: bool = False) -> str:
    """The CHyD language as a Lark grammar for llguidance, which vLLM, SGLang and llama.cpp run: free text
    without brackets, and quotes `[` + a non-blank substring of a passage + `]`, the passage's own brackets
    cutting it into stretches that may be quoted up to, not across (llguidance's substring_chars over each).
    With whole_words, Constraint's rules: a stretch is cut into chunks where a quote may start or end
    (word_edges), a quote is a run of whole chunks (substring_chunks) and holds a word or is a term (holds_word).

    Where our decoder and a grammar cannot agree, the grammar is the stricter: the model must write `]`
    itself (our decoder closes a quote at a dead end, turns a stop token in a quote into `]`, and closes a
    quote left open at the token budget, where an engine stops with the quote open: finish_reason "length");
    no special token, and no bytes that are not UTF-8, may be written outside quotes.

    inside_quote: the text starts inside a quote, its `[` already written (ours at the prompt's end): our
    quote_first rule on an engine, which weighs "No answer" first and then continues from `[`.
    """
    lines = ["%llguidance {}", 'FREE: /[^\\[\\]]*/']
    spaces = "".join(f"\\x{{{ord(ch):x}}}" for ch in map(chr, range(0x3001)) if ch.isspace())
    blank, solid = f"[{spaces}]", f"[^{spaces}]"  # str.strip()'s whitespace: ours (ends_on_char, holds_word)
    if whole_words:
        runs = list(dict.fromkeys(tuple(r) for c in contexts for r in word_chunks(c)))
        quotes = ["%regex " + json.dumps({"substring_chunks": list(r)}) for r in runs]
        letters = sorted({ch for r in runs for piece in r for ch in piece if WORD_RE.match(ch + ch)})
        word = char_class(letters)
        # holds_word: two letters or digits in a row, in more than two bytes once stripped, or one term (TERM_RE)
        wide = f"[^\\x00-\\x7f{spaces}]"  # a character of two bytes or more, not blank
        has_word = f"/(?s:.*{word}{{2}}.*)/ & /(?s:{blank}*({solid}.+{solid}|{wide}{solid}|{solid}{wide}){blank}*)/"
        alpha = [ch for ch in letters if re.match(r"[^\W\d_]", ch)]
        first = f"-+{word}" + (f"|{word}*{char_class(alpha)}" if alpha else "")  # a leading dash, or up to a letter
        is_term = f"/(?s:{blank}*({first}){word}*(-{word}+)*{blank}*)/ & /(?s:{blank}*{solid}.*{solid}{blank}*)/"
        rule = f"(({has_word}) | ({is_term}))"
    else:
        stretches = list(dict.fromkeys(s for c in contexts for s in re.split(r"[\[\]]", c) if s.strip()))
        quotes = ["%regex " + json.dumps({"substring_chars": s}) for s in stretches]
        rule = f"/(?s:{blank}*{solid}.*)/"  # not blank
    if not quotes:  # nothing to quote: no `[` at all
        if inside_quote:
            raise ValueError("the passages hold nothing to quote: no answer can start inside a quote")
        return "\n".join(lines + ["start: FREE", ""])
    lines += [f"QUOTE: ({' | '.join(quotes)}) & {rule}",
              "CLOSE: /[ \\t\\n\\r\\x0b\\x0c]*\\]/",  # an exit token's whitespace is not the quote's (EXIT_RE)
              'quote: "[" QUOTE CLOSE',
              "start: " + ("QUOTE CLOSE FREE" if inside_quote else '(quote | "No answer") FREE' if quote_first
                           else "FREE") + " (quote FREE)*"]
    return "\n".join(lines + [""])


def char_class(chars: list[str]) -> str:
    """A regex class of these characters, for a Lark grammar."""
    return "[" + "".join(ch if ch.isascii() else f"\\x{{{ord(ch):x}}}" for ch in chars) + "]"


def word_chunks(context: str) -> list[list[str]]:
    """The context's stretches between brackets where a quote may start (word_edges' starts: a word or a term
    lies ahead), each cut where a whole-words quote may start or end: a quote is then a run of whole chunks.
    Where it may start is no further rule: from anywhere a quote can end, what holds a word is what may be
    quoted."""
    ends, starts, _ = word_edges(context.encode())
    stretches, chunks, piece, at, quotable = [], [], "", 0, False
    for ch in context + "[":  # a last bracket ends the last stretch
        if (ch in "[]" or ends[at]) and piece:
            chunks.append(piece)
            piece = ""
        if ch in "[]":
            if quotable:
                stretches.append(chunks)
            chunks, quotable = [], False
        else:
            piece += ch
            quotable = quotable or starts[at] == 1
        at += len(ch.encode())
    return stretches


@lru_cache(maxsize=4)
def ll_tokenizer(tok, vocab_size: int):
    import llguidance

    return llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=vocab_size, eos_token=min(tok.eos_ids))


class GrammarConstraint(Rules):
    """The same decoding loop with the mask taken from llguidance's matcher over lark_grammar(contexts): a
    second, independent implementation of the language. The mode follows the brackets written; llguidance
    forces nothing here (no dead-end close, no stop token turned into `]`: the grammar masks the stop token
    inside a quote) and drafts nothing."""

    def __init__(self, classes: TokenClasses, contexts: list[str], tok, trigger_bias: float = 0.0,
                 quote_first: bool = False, whole_words: bool = False):
        import llguidance
        import llguidance.torch

        super().__init__(classes, contexts)
        grammar = lark_grammar(contexts, quote_first, whole_words)
        self.can_quote = "QUOTE:" in grammar  # the grammar has no quote rule when nothing can be quoted
        size = sum(len(c.encode()) for c in contexts)  # llguidance's default limits refuse passages over ~100 KB
        limits = llguidance.LLParserLimits(initial_lexer_fuel=max(1_000_000, 20 * size),
                                           step_lexer_fuel=max(200_000, 4 * size), max_lexer_states=max(250_000, 4 * size))
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tok, len(classes.token_bytes)),
                                            grammar, log_level=0, limits=limits)
        if self.matcher.is_error():
            raise ValueError(f"llguidance refused the grammar: {self.matcher.get_error().splitlines()[0]}")
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, len(classes.token_bytes))  # [1, V / 32] int32
        self._fill = llguidance.torch.fill_next_token_bitmask
        self.bits = torch.arange(32, dtype=torch.int32)
        self.trigger_bias = classes.trigger.float() * trigger_bias

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        self._fill(self.matcher, self.bitmask, 0)
        allowed = ((self.bitmask[0, :, None] >> self.bits) & 1).bool().flatten()[:logits.shape[-1]]  # unpacked, [V]
        out = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        return out + self.trigger_bias.to(out.device) if self.mode == STANDARD else out

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise AssertionError(f"token {token} {self.c.token_bytes[token]!r} is outside the grammar: the mask was not applied")
        b = self.c.token_bytes[token]
        if b"[" in b or b"]" in b:  # the last bracket decides the mode; the quote is what follows its `[`
            self.opened += b.count(b"[")
            last = max(b.rfind(b"["), b.rfind(b"]"))
            self.mode, self.quote = (EEC, b[last + 1:]) if b[last:last + 1] == b"[" else (STANDARD, b"")
        elif self.mode == EEC:
            self.quote += b
        self.on_char = ends_on_char(self.quote)


class ChydLogitsProcessor:
    """CHyD for transformers' `generate`: pass it in `logits_processor=[...]` with the prompt's length.

    transformers stops at max_new_tokens even inside a quote; our own `generate` closes it.
    """

    def __init__(self, constraint: Constraint, prompt_len: int):
        self.constraint, self.seen = constraint, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for token in input_ids[0, self.seen:].tolist():  # batch 1: catch up with the tokens chosen since
            self.constraint.advance(token)
        self.seen = input_ids.shape[1]
        forced = self.constraint.forced()
        if forced is not None:  # a mask that leaves only the forced token
            out = torch.full_like(scores, float("-inf"))
            out[:, forced] = 0.0
            return out
        return self.constraint.mask(scores[0])[None]
