"""CHyD through a serving engine: an OpenAI-compatible server (vLLM with `--structured-outputs-config.backend
guidance`) decodes under constraint.lark_grammar; chyd keeps the prompt, the quote-first rule, the sources and
the check of every quote that comes back.

    server = connect("http://127.0.0.1:8765")          # the served model: the only one, or model_name
    for i, r in server_stream(server, tok, questions, contexts, options, concurrency=8):
        r.text, r.spans, r.not_verbatim, r.engine

The prompt is sent as token ids (`chyd.prompt_for` encoded by our tokenizer, which must be the served
model's), so the engine continues exactly our tokens. Quote-first is ours, not a grammar: p("No answer") from
the server's log-probabilities, one token a request (the prompt stays in its prefix cache), and if it is not
above 1/2 the answer goes on from the prompt and `[` under a grammar that starts inside the quote.
Nothing that comes back is trusted: a quote found in no passage (a server that ignores the grammar) is listed
in not_verbatim and has no sources; a quote left open at the token limit is closed with `]`, as ours is.
Standard library only (urllib and threads): the client needs no package of its own.
"""
from __future__ import annotations

import http.client
import json
import math
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from checkpoints import open_checkpoint
from chyd import ANSWER_STOPS, DecodeOptions, Result, Span, before_blanks, prompt_for, stop_cut
from constraint import EEC, SPAN_RE, STANDARD, Constraint, extract_spans, holds_word, lark_grammar, token_classes
from model import ModelConfig

TIMEOUT_S = 600.0  # one request: a CPU server with many requests queued answers slowly
PROBE = "No answer. [45 lbf.ft] Naïve café 東京"  # tokenized by the server and by us: the same tokenizer?
GRAMMAR_BYTES = 16_000  # passages above this are compiled here first (grammar_fits): from about 50 KB, vLLM's fail


class ServerError(ValueError):
    """The server unreachable, a wrong URL, a model it does not serve, a request it refused: one line naming
    the server and what it said."""


@dataclass
class ServedResult(Result):
    engine: str = ""  # "vllm 0.32.0 at URL, model NAME"
    not_verbatim: list[str] = field(default_factory=list)  # quotes in no passage (never given sources), stray brackets
    finish_reason: str = ""  # the server's: "stop" or "length" ("" when chyd wrote "No answer" itself)

    @property
    def verbatim(self) -> bool:
        return not self.not_verbatim


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def error_message(body: bytes) -> str:
    """What an error response says: vLLM's {"error": {"message"}}, {"message"} or FastAPI's {"detail"}, else the
    body itself."""
    try:
        data = json.loads(body)
    except ValueError:
        return one_line(body.decode(errors="replace")) or "no message"
    error = data.get("error", data) if isinstance(data, dict) else data
    message = error.get("message", error.get("detail", error)) if isinstance(error, dict) else error
    return one_line(message)


class Server:
    """An OpenAI-compatible endpoint and the model it serves."""

    def __init__(self, url: str, model: str, engine: str, max_model_len: int | None = None, timeout: float = TIMEOUT_S):
        self.url, self.model, self.engine, self.max_model_len, self.timeout = url, model, engine, max_model_len, timeout
        self.send_grammar = True  # False plays a server that ignores the grammar (tests): the quotes are checked anyway

    def open(self, path: str, body: dict | None = None, timeout: float | None = None):
        url = self.url + path
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
        try:
            return urllib.request.urlopen(request, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as e:
            raise ServerError(f"{url}: HTTP {e.code}: {error_message(e.read())}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise ServerError(f"{url}: cannot reach the server ({one_line(getattr(e, 'reason', e))})") from None

    def request(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        """The JSON answer to a GET (or, with a body, a POST)."""
        url = self.url + path
        try:
            with self.open(path, body, timeout) as r:
                return json.loads(r.read())
        except ServerError:
            raise
        except ValueError:
            raise ServerError(f"{url}: the answer is not JSON") from None
        except (OSError, http.client.HTTPException) as e:  # dropped while reading
            raise ServerError(f"{url}: the connection broke ({one_line(e)})") from None

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """The chunks of a streamed answer (server-sent events), each as it arrives."""
        url = self.url + path
        try:
            with self.open(path, dict(body, stream=True)) as r:
                for line in r:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ServerError(f"{url}: {error_message(data)}")
                    yield chunk
        except ServerError:
            raise
        except ValueError:
            raise ServerError(f"{url}: a streamed chunk is not JSON") from None
        except (OSError, http.client.HTTPException) as e:
            raise ServerError(f"{url}: the connection broke ({one_line(e)})") from None

    def check_tokenizer(self, tok) -> None:
        """Our tokenizer must be the served model's: the prompt goes as our token ids. Checked on a probe text
        with vLLM's /tokenize; a server without it is taken on trust."""
        try:
            theirs = self.request("/tokenize", {"model": self.model, "prompt": PROBE, "add_special_tokens": False}).get("tokens")
        except ServerError as e:
            if "HTTP 404" in str(e):
                return
            raise
        if theirs != tok.encode(PROBE):
            raise ServerError(f"{self.url}: the served model {self.model} tokenizes text differently from --model's "
                              f"tokenizer: give the checkpoint it serves")


def connect(url: str, model_name: str | None = None, timeout: float = TIMEOUT_S) -> Server:
    """The server at url (with or without /v1) and its model: the only one it serves, else the one named
    model_name (vLLM names a model by its --served-model-name, by default the --model path it was given)."""
    base = url.strip().rstrip("/").removesuffix("/v1").rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ServerError(f"{url}: not an http:// or https:// URL")
    probe = Server(base, "", "", timeout=timeout)
    data = probe.request("/v1/models", timeout=30)
    data = data.get("data") if isinstance(data, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and "id" in m for m in data):
        raise ServerError(f"{base}/v1/models: not an OpenAI-compatible model list")
    served = {m["id"]: m for m in data}
    if model_name is not None and model_name not in served:
        raise ServerError(f"{base}: serves {', '.join(served) or 'no model'}, not {model_name}")
    if model_name is None and len(served) != 1:
        raise ServerError(f"{base}: serves {len(served)} models ({', '.join(served)}): name one")
    name = model_name or next(iter(served))
    info = served[name]
    kind = info.get("owned_by") or "server"
    try:
        version = probe.request("/version", timeout=30).get("version")
    except ServerError:
        version = None
    engine = f"{kind}{' ' + version if version else ''} at {base}, model {name}"
    return Server(base, name, engine, info.get("max_model_len"), timeout)


def grammar_fits(grammar: str, tok) -> str | None:
    """None if llguidance compiles the grammar with its default limits, as vLLM builds it (vLLM cannot raise
    them), else llguidance's error. vLLM refuses a request only from about 90 KB of passages (its check does not
    build the lexer); from about 50 KB (70 KB with whole words) its matcher fails after that check, and a failed
    matcher allows only the stop token: an empty answer, said nowhere but in the server's log."""
    import llguidance

    from constraint import ll_tokenizer

    m = llguidance.LLMatcher(ll_tokenizer(tok, tok.vocab_size), grammar, log_level=0)
    return m.get_error().splitlines()[0] if m.is_error() else None


def token_logprobs(server: Server, prompt: list[int], ids: list[int]) -> list[float]:
    """The log-probabilities of the tokens ids after prompt (raw, before any sampling setting), from one request
    for one position: vLLM's logprob_token_ids, so the server finds the prompt in its prefix cache and computes
    the one position."""
    r = server.request("/v1/completions", {"model": server.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                                           "logprobs": len(ids), "logprob_token_ids": ids,
                                           "return_tokens_as_token_ids": True})
    try:
        top = r["choices"][0]["logprobs"]["top_logprobs"][0]
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"{server.url}: no log-probabilities in the answer") from None
    if missing := [t for t in ids if f"token_id:{t}" not in top]:
        raise ServerError(f"{server.url}: the log-probability of token {missing[0]} was not returned (chyd needs "
                          f"vLLM's logprob_token_ids and return_tokens_as_token_ids)")
    return [top[f"token_id:{t}"] for t in ids]


def no_answer_likelier(server: Server, prompt: list[int], no_answer: list[int], above: float) -> bool:
    """Our quote_first rule, p(the answer starts with no_answer) > above, from the server's log-probabilities: one
    request a token of no_answer (token_logprobs), stopping as soon as the rule cannot hold."""
    logp = 0.0
    for j, t in enumerate(no_answer):
        logp += token_logprobs(server, prompt + no_answer[:j], [t])[0]
        if logp <= math.log(above):
            return False
    return True


def modes_of(tok, tokens: list[int]) -> list[str]:
    """The mode each token was written in: EEC after a `[` until the next `]`."""
    modes, mode = [], STANDARD
    for t in tokens:
        modes.append(mode)
        b = tok.token_bytes[t]
        last = max(b.rfind(b"["), b.rfind(b"]"))
        if last >= 0:
            mode = EEC if b[last:last + 1] == b"[" else STANDARD
    return modes


def answer(server: Server, tok, prompt: list[int], contexts: list[str], o: DecodeOptions,
           no_answer: list[int]) -> ServedResult:
    """One answer through the server, checked: see the module's docstring."""
    classes = token_classes(tok, tok.vocab_size)
    c = Constraint(classes, contexts, whole_words=o.whole_words)  # the suffix tree of the passages; can_quote
    t0 = time.perf_counter()
    weigh = o.constrained and o.quote_first and c.can_quote
    try:
        grammar = lark_grammar(contexts, whole_words=o.whole_words, inside_quote=weigh) if o.constrained else None
    except ValueError:  # our decoder could open a quote where the grammar has none to hold: answer as without quote_first
        weigh, grammar = False, lark_grammar(contexts, whole_words=o.whole_words)
    head = []  # what chyd writes itself before the server's tokens
    if weigh:
        if no_answer_likelier(server, prompt, no_answer, o.no_answer_above):
            return checked(tok, c, list(no_answer), len(prompt), "", time.perf_counter() - t0, 0.0, server.engine)
        head = [classes.open_id]
    body = {"model": server.model, "prompt": prompt + head, "max_tokens": max(1, o.max_new_tokens - len(head)),
            "temperature": o.temperature, "top_p": o.top_p, "seed": o.seed, "return_token_ids": True,
            "skip_special_tokens": False, "stop": [s.decode() for s in ANSWER_STOPS]}
    if grammar is not None and server.send_grammar:
        body["structured_outputs"] = {"grammar": grammar}
    if o.trigger_bias:
        body["logit_bias"] = {str(i): o.trigger_bias for i in classes.trigger.nonzero().flatten().tolist()}
    tokens, finish, first = [], "", None
    for chunk in server.stream("/v1/completions", body):
        choice = (chunk.get("choices") or [{}])[0]
        if choice.get("prompt_token_ids") not in (None, body["prompt"]):
            raise ServerError(f"{server.url}: the server changed the prompt's tokens (added a BOS token?)")
        if choice.get("token_ids") is None and choice.get("text"):
            raise ServerError(f"{server.url}: the answer has no token ids (vLLM's return_token_ids)")
        tokens += choice.get("token_ids") or []
        first = first or time.perf_counter()
        finish = choice.get("finish_reason") or finish
    end = time.perf_counter()
    while tokens and tokens[-1] in tok.eos_ids:  # the stop token ends the answer, it is not part of it
        tokens.pop()
    tokens = head + tokens
    # an engine stops at ANSWER_STOPS anywhere, inside a quote too (then the quote is closed, below), and sends their
    # tokens: they are left out as chyd's loop leaves them out
    tokens = tokens[:stop_cut([tok.token_bytes[t] for t in tokens], modes_of(tok, tokens))]
    first = first or end
    return checked(tok, c, tokens, len(prompt), finish, first - t0, end - first, server.engine)


def checked(tok, c: Constraint, tokens: list[int], prompt_tokens: int, finish: str, prefill_s: float,
            decode_s: float, engine: str) -> ServedResult:
    """The result of tokens that came back: a quote left open closed with `]`, or with whole-word quotes left out
    if it holds no word yet and text stands before it, as chyd's loop does at the budget (an engine stops there);
    every quote looked up in the passages' suffix tree."""
    text = tok.decode(tokens)
    forced = 0
    if text.rfind("[") > text.rfind("]"):
        at = max(i for i, t in enumerate(tokens) if b"[" in tok.token_bytes[t])  # the token that opened it
        opener = tok.token_bytes[tokens[at]]
        quote = opener[opener.rfind(b"[") + 1:] + b"".join(tok.token_bytes[t] for t in tokens[at + 1:])
        kept = before_blanks([tok.token_bytes[t] for t in tokens], at)
        if c.whole_words and b"]" not in opener and not holds_word(quote) and kept:
            tokens = tokens[:kept]
            text = tok.decode(tokens)
        else:
            tokens, text, forced = tokens + [c.c.close_id], text + "]", 1
    # brackets outside a [quote] (a server that ignores the grammar may write any): what follows each is reported
    paired = {i for m in SPAN_RE.finditer(text) for i in (m.start(), m.end() - 1)}
    bad = [re.match(r".[^\[\]]*", text[i:]).group() for i, ch in enumerate(text) if ch in "[]" and i not in paired]
    spans = []
    for s in extract_spans(text):
        sources = c.sources(s)
        spans.append(Span(s, sources))
        if not sources:
            bad.append(s)
    return ServedResult(text, spans, tokens, modes_of(tok, tokens), prompt_tokens, text.count("["), forced, prefill_s,
                        decode_s, 0, engine, bad, finish)


def unsupported(o: DecodeOptions) -> list[str]:
    """The options an engine does not apply, for the command line to say so: it has no n-gram ban or
    repetition penalty over the answer alone (vLLM's penalties count the prompt's tokens, the passages), and quote
    search is ours."""
    out = []
    if o.no_repeat_ngram:
        out.append(f"no_repeat_ngram={o.no_repeat_ngram}")
    if o.repetition_penalty != 1.0:
        out.append(f"repetition_penalty={o.repetition_penalty}")
    if o.quote_search:
        out.append(f"quote_search={o.quote_search}")
    return out


def server_stream(server: Server, tok, questions: list[str], contexts: list[list[str]], options: DecodeOptions,
                  concurrency: int = 8) -> Iterator[tuple[int, ServedResult]]:
    """Answer questions[i] from contexts[i] with CHyD's prompt through the server, `concurrency` requests in
    flight; (i, its result) as each answer ends (prompt_stream)."""
    prompts = [tok.encode(prompt_for(tok, q, c, options)) for q, c in zip(questions, contexts)]
    return prompt_stream(server, tok, prompts, contexts, options, concurrency)


def prompt_stream(server: Server, tok, prompts: list[list[int]], contexts: list[list[str]], options: DecodeOptions,
                  concurrency: int = 8) -> Iterator[tuple[int, ServedResult]]:
    """Continue each prompt (token ids) through the server with an answer whose quotes come from contexts[i],
    `concurrency` requests in flight; (i, its result) as each answer ends. Every prompt and grammar is checked
    before the first request: a prompt too long for the served window, or passages too large for the engine's
    grammar limits, is one ServerError. options.quote_first and no_answer_above must be decided
    (chyd.with_model_defaults)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    o = options
    if o.quote_first is None or (o.quote_first and o.no_answer_above is None):
        raise ValueError("quote_first or no_answer_above is None: decide them from the model first (chyd.with_model_defaults)")
    for i, (p, ctx) in enumerate(zip(prompts, contexts)):
        if server.max_model_len and len(p) + o.max_new_tokens > server.max_model_len:
            raise ServerError(f"{server.url}: prompt {i + 1} of {len(p)} tokens plus {o.max_new_tokens} new "
                              f"tokens exceeds the served window of {server.max_model_len} tokens")
        size = sum(len(s.encode()) for s in ctx)
        if o.constrained and size > GRAMMAR_BYTES and (error := grammar_fits(lark_grammar(ctx, whole_words=o.whole_words), tok)):
            raise ServerError(f"{server.url}: question {i + 1}'s passages ({size:,} bytes) are too large for the "
                              f"engine's grammar limits (llguidance's defaults, which vLLM cannot raise): show fewer "
                              f"or shorter passages ({error})")
    if prompts:
        server.check_tokenizer(tok)
        token_classes(tok, tok.vocab_size)  # computed once here, not by every thread at once
    stop = tok.encode(o.no_answer)
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        futures = {pool.submit(answer, server, tok, p, ctx, o, stop): i for i, (p, ctx) in enumerate(zip(prompts, contexts))}
        for f in as_completed(futures):
            yield futures[f], f.result()
    finally:  # an error, or a consumer that stops early: no new requests
        pool.shutdown(wait=False, cancel_futures=True)


def open_served(url: str, model: str, served_name: str | None = None) -> tuple[Server, object, ModelConfig]:
    """The server at url, and the tokenizer and config of the checkpoint `model` (an alias, folder or GGUF, as
    --model names it) whose tokenizer builds the prompts; no weights are loaded. Says on stderr what decodes."""
    ckpt = open_checkpoint(model)
    cfg = ModelConfig.from_hf(ckpt.config)
    cfg.name = ckpt.name
    server = connect(url, served_name)
    print(f"chyd: decoding on {server.engine}", file=sys.stderr)
    return server, ckpt.tokenizer, cfg
