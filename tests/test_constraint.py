"""constraint.py on its own: each forced close through the one place that decides it, and the import layout."""
import ast

import torch

from conftest import ROOT
from constraint import EEC, STANDARD, ChydLogitsProcessor, Constraint, holds_word, token_classes


def token_id(tok, s: str) -> int:
    return next(i for i, b in enumerate(tok.token_bytes) if b == s.encode())


def quote(tok, contexts, pieces, **kw) -> Constraint:
    """A constraint in a quote opened with `[` and continued with pieces (token strings)."""
    c = Constraint(token_classes(tok, tok.vocab_size), contexts, **kw)
    c.advance(token_id(tok, "["))
    for p in pieces:
        assert c.forced() is None
        c.advance(token_id(tok, p))
    return c


def test_dead_end_forces_the_close_and_counts_it(toy_tok):
    c = quote(toy_tok, ["abc", "xabd"], ["ab"])
    assert c.mode == EEC and c.forced() is None  # "c" and "d" may follow
    c.advance(token_id(toy_tok, "c"))
    assert c.forced() == c.c.close_id and c.forced_closes == 1  # "abc" ends its only occurrence
    c.advance(c.c.close_id)
    assert c.mode == STANDARD and c.forced() is None and c.forced_closes == 1


def test_dead_end_in_transformers_leaves_only_the_close(toy_tok):
    c = Constraint(token_classes(toy_tok, toy_tok.vocab_size), ["abc"])
    ids = [token_id(toy_tok, s) for s in ("[", "ab", "c")]
    scores = torch.randn(1, toy_tok.vocab_size)
    out = ChydLogitsProcessor(c, 2)(torch.tensor([[5, 6] + ids]), scores)
    assert out[0].isfinite().nonzero().flatten().tolist() == [c.c.close_id] and c.forced_closes == 1


def test_a_stop_token_in_a_quote_becomes_the_close(toy_tok):
    c = quote(toy_tok, ["Torque the nut to 45 lbf.ft."], [" nut"])
    eos, close = next(iter(toy_tok.eos_ids)), c.c.close_id
    logits = torch.randn(toy_tok.vocab_size)
    logits[eos] = 3.0
    masked = c.mask(logits)
    assert masked[eos] == float("-inf")
    assert torch.isclose(masked[close], torch.logsumexp(logits[[close, eos]], 0))
    assert masked[token_id(toy_tok, " to")] == logits[token_id(toy_tok, " to")]  # continuations untouched
    assert masked[token_id(toy_tok, " 45")] == float("-inf")  # " nut 45" is not in the context


def test_an_empty_quote_can_neither_close_nor_stop(toy_tok):
    c = quote(toy_tok, ["Torque the nut to 45 lbf.ft."], [])
    masked = c.mask(torch.zeros(toy_tok.vocab_size))
    assert masked[c.c.close_id] == float("-inf") and masked[c.c.exit_ids].eq(float("-inf")).all()
    assert masked[c.c.stop_ids].eq(float("-inf")).all() and not c.may_end()


def test_the_budget_closes_an_open_quote_and_only_that(toy_tok):
    c = Constraint(token_classes(toy_tok, toy_tok.vocab_size), ["Torque the nut."])
    assert c.close() is None and c.forced_closes == 0  # no quote open
    c = quote(toy_tok, ["Torque the nut."], [" the"])
    assert c.may_end() and c.close() == c.c.close_id and c.forced_closes == 1


def test_free_decoding_masks_nothing_and_biases_the_triggers(toy_tok):
    classes = token_classes(toy_tok, toy_tok.vocab_size)
    c = Constraint(classes, ["Torque the nut."], trigger_bias=2.0, verbatim=False)
    logits = torch.zeros(toy_tok.vocab_size)
    assert torch.equal(c.mask(logits), classes.trigger.float() * 2.0)
    for s in ("[", " 45", "]"):  # a bracket opens nothing: no quote to check or to close
        c.advance(token_id(toy_tok, s))
        assert c.mode == STANDARD and c.forced() is None
    assert c.opened == 1 and c.close() is None


def test_sources_come_from_the_tree_in_characters(toy_tok):
    c = Constraint(token_classes(toy_tok, toy_tok.vocab_size), ["café nut, nut", "nut"])
    assert c.sources("nut") == [(0, 5), (0, 10), (1, 0)]  # "é" is two bytes, one character
    assert c.sources("bolt") == [] and c.sources("") == []


def project_imports() -> dict[str, set[str]]:
    files = {p.stem: p for p in ROOT.glob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                deps.add(node.module.split(".")[0])
        graph[name] = deps & set(files) - {name}
    return graph


def test_imports_run_one_way():
    graph = project_imports()
    assert graph["constraint"] == {"suffix_tree"}
    assert "eval" not in graph["chyd"] and "chyd" not in graph["model"] | graph["constraint"]
    # the one edge back: chyd.py's command loads the server client (which builds on chyd.py) where --server asks for it
    assert graph["chyd"] & {"server"} and all(n.module != "server" for n in ast.parse((ROOT / "chyd.py").read_text()).body
                                              if isinstance(n, ast.ImportFrom))
    graph["chyd"].discard("server")

    def reaches(a, b, seen=()):
        return any(d == b or d not in seen and reaches(d, b, seen + (d,)) for d in graph[a])

    assert not [name for name in graph if reaches(name, name)]  # no circle


WORDS = "The Pressure is 45 psi, since 2004 (see [1] and optronics). Check the pres"


def byte_id(tok, b: int) -> int:
    return next(i for i, t in enumerate(tok.token_bytes) if t == bytes([b]))


def write(tok, contexts, text, whole_words=True) -> Constraint | None:
    """A constraint after `[` and text, spelled one byte a token; None if some byte is not allowed there."""
    c = Constraint(token_classes(tok, tok.vocab_size), contexts, whole_words=whole_words)
    c.advance(token_id(tok, "["))
    for b in text.encode():
        t = byte_id(tok, b)
        if t not in c.allowed().tolist():
            return None
        c.advance(t)
    return c


def test_whole_word_quotes_start_and_end_on_word_boundaries(toy_tok):
    ctx = [WORDS]
    assert write(toy_tok, ctx, "ressure") is None  # never between two letters of one word
    assert write(toy_tok, ctx, "ressure", whole_words=False).closable  # the paper's rule alone allows it
    assert write(toy_tok, ctx, "Pressure").closable
    assert not write(toy_tok, ctx, "Pressu").closable  # it may go on, but not close mid-word
    assert not write(toy_tok, ctx, "Pressure is 4").closable and write(toy_tok, ctx, "Pressure is 45").closable
    assert write(toy_tok, ctx, "2004").closable and write(toy_tok, ctx, "optronics").closable
    assert write(toy_tok, ctx, "1") is None  # "[1]" has no word before its bracket: no quote starts there
    assert not write(toy_tok, ctx, ",").closable and not write(toy_tok, ctx, "45").closable  # [45]: two bytes
    assert write(toy_tok, ctx, "45 psi").closable
    assert write(toy_tok, ctx, ", since").closable  # punctuation may start a quote that holds a word


def test_whole_word_quotes_hold_a_word_of_two_letters_or_digits(toy_tok):
    ctx = ["a 1 b, 7 x; it 12 ok"]
    for text in ("a", "1", "a 1", "a 1 b,", ", 7", "12"):
        c = write(toy_tok, ctx, text)
        assert c is not None and not c.closable, text
        assert write(toy_tok, ctx, text, whole_words=False).closable, text
    assert write(toy_tok, ctx, "x; it").closable and write(toy_tok, ctx, "it 12").closable
    assert write(toy_tok, ctx, "it").closable  # two letters alone: a term, as a command's zR is


def test_a_word_keeps_its_leading_dashes(toy_tok):
    ctx = ["Use ssh -y host or tar --create; it holds at -40 degrees on pages 10-20 by e-mail."]
    assert not write(toy_tok, ctx, "ssh -").closable and write(toy_tok, ctx, "ssh -y").closable  # no [ssh -]
    assert not write(toy_tok, ctx, "tar --").closable and write(toy_tok, ctx, "tar --create").closable
    assert write(toy_tok, ctx, "y host") is None and write(toy_tok, ctx, "-create") is None
    assert write(toy_tok, ctx, "40 degrees") is None and write(toy_tok, ctx, "-40 degrees").closable  # the sign
    assert write(toy_tok, ctx, "20 by").closable and write(toy_tok, ctx, "mail.").closable  # inner dashes part words
    assert write(toy_tok, ctx, "y host", whole_words=False).closable


def test_a_number_keeps_its_point_and_its_commas(toy_tok):
    ctx = ["Protrusion 0.25 inch at 1,000 rpm, since 2004. 25 more, 3, 4"]
    assert write(toy_tok, ctx, "25 inch") is None and write(toy_tok, ctx, "0.25 inch").closable  # not a quarter's 100x
    assert not write(toy_tok, ctx, "Protrusion 0.").closable
    assert write(toy_tok, ctx, "000 rpm") is None and write(toy_tok, ctx, "1,000 rpm").closable
    assert write(toy_tok, ctx, "since 2004").closable and write(toy_tok, ctx, "25 more").closable  # not between digits
    assert write(toy_tok, ctx, "more, 3").closable
    assert write(toy_tok, ["25 inch at 1,000 rpm 42."], "25 inch").closable  # a passage's first byte: a boundary


def test_the_ends_of_a_passage_are_word_boundaries(toy_tok):
    ctx = [WORDS, "ressure is low"]  # a passage that ends mid-word, and one that starts mid-word
    c = write(toy_tok, ctx, "the pres")
    assert c.closable and c.forced() == c.c.close_id  # the end of the passage: a dead end, closed
    assert write(toy_tok, ctx, "ressure is").closable  # from the second passage's own first byte


def test_cjk_text_is_not_hindered(toy_tok):
    ctx = ["東京は大きい。Tokyo"]
    assert write(toy_tok, ctx, "京は").closable  # any character may start or end a quote in unspaced text
    assert not write(toy_tok, ctx, "京").closable  # one character: no two letters in a row
    assert write(toy_tok, ["東京 Tokyo"], "東京").closable  # two: six bytes
    assert write(toy_tok, ctx, "い。Tokyo").closable and write(toy_tok, ctx, "okyo") is None


def test_a_whole_word_quote_at_a_dead_end_holds_a_word(toy_tok):
    ctx = ["see [1] then [the nut] now"]
    c = write(toy_tok, ctx, "the nut")
    assert c.closable and c.forced() == c.c.close_id  # the passage's bracket ends it
    first = Constraint(token_classes(toy_tok, toy_tok.vocab_size), ctx, whole_words=True)
    first.advance(token_id(toy_tok, "["))
    starts = {first.c.token_bytes[i][:1] for i in first.allowed().tolist()}
    assert b"1" not in starts and b"t" in starts and b"n" in starts  # "1]" would be a dead end without a word
    assert write(toy_tok, ["[1] [x]"], "1") is None and write(toy_tok, ["[1] [x]"], "x") is None
    assert write(toy_tok, ["[12] [ab] it"], "12") is None and write(toy_tok, ["[12] [ab] it"], "ab").closable  # a term


def test_a_term_of_a_reference_manual_is_a_whole_quote(toy_tok):
    # vim's "zR", ssh's "-y": shorter than the word rule's three bytes, they were forced on, into `[zm*]`
    assert [holds_word(q.encode()) for q in ["zR", "-y", " -S ", "C-b", "-6", "--count", "é1", "ok"]] == [True] * 8
    assert [holds_word(q.encode()) for q in ["12", "1", "z", ",", "C-", "-", "3.3", "a 1", "[x"]] == [False] * 9
    ctx = ["zR\t\tOpen all folds.\n -y      Send log information.\n C-b is the prefix; gzip -6, 12 levels [3] [zz]"]
    for term in ["zR", "-y", "C-b", "-6", "zz"]:
        assert write(toy_tok, ctx, term).closable, term
    for part in ["z", "C-", "12", "-"]:
        c = write(toy_tok, ctx, part)
        assert c is not None and not c.closable, part
    assert write(toy_tok, ctx, "3") is None  # "[3]": no term or word lies ahead, so no quote starts there


def test_a_quote_that_starts_at_a_term_with_no_word_ahead_ends_with_the_term(toy_tok):
    # "[-F." would reach the passage's end, a dead end, holding no word (hypothesis found "-F\x800\x80..."): so
    # after "-F" the only way on is `]`; where a word lies ahead, the same term may go on to it
    for ctx in (["grep -F."], ["grep -F.", "[-F 1]"]):
        c = write(toy_tok, ctx, "-F")
        assert c.closable and c.forced() == c.c.close_id and write(toy_tok, ctx, "-F.") is None, ctx
    assert write(toy_tok, ["grep -F. ok"], "-F. ok").closable
    assert write(toy_tok, ["grep -F.", "-F. ok"], "-F.").live == [(1, 0)]


def test_whole_word_drafts_follow_an_occurrence_that_starts_on_a_boundary(toy_tok):
    c = write(toy_tok, ["xthe nut; the bolt"], "the ")
    assert c.live == [(0, 10)]
    assert toy_tok.decode(c.draft(4)).startswith("bolt")
