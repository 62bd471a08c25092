"""constraint.py on its own: each forced close through the one place that decides it, and the import layout."""
import ast

import torch

from conftest import ROOT
from constraint import EEC, STANDARD, ChydLogitsProcessor, Constraint, token_classes


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

    def reaches(a, b, seen=()):
        return any(d == b or d not in seen and reaches(d, b, seen + (d,)) for d in graph[a])

    assert not [name for name in graph if reaches(name, name)]  # no circle
