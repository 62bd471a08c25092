"""suffix_tree.py against brute force (bytes.find), on random, repetitive and unicode contexts."""
import random

from hypothesis import given, settings, strategies as st

from suffix_tree import SuffixTree, TokenTrie, allowed_tokens


def brute_occurrences(contexts, s):
    out = []
    for i, c in enumerate(contexts):
        at = c.find(s)
        while at != -1:
            out.append((i, at))
            at = c.find(s, at + 1)
    return sorted(out)


def repetitive(draw):
    kind = draw(st.sampled_from(["aaaa", "abab", "edits", "unicode", "random"]))
    n = draw(st.integers(0, 60))
    if kind == "aaaa":
        return b"a" * n
    if kind == "abab":
        return (b"ab" * n)[:n] + b"a" * draw(st.integers(0, 3))
    if kind == "edits":
        base = draw(st.binary(min_size=1, max_size=8))
        out = bytearray(base * draw(st.integers(1, 6)))
        for _ in range(draw(st.integers(0, 3))):
            if out:
                out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
        return bytes(out)
    if kind == "unicode":
        return draw(st.text(alphabet="aé東🙂 [] ", max_size=20)).encode()
    return draw(st.binary(max_size=n))


contexts_strategy = st.lists(st.composite(repetitive)(), min_size=0, max_size=5)


@settings(max_examples=300, deadline=None)
@given(contexts_strategy, st.lists(st.binary(min_size=1, max_size=6), max_size=20))
def test_contains_and_occurrences_match_brute_force(contexts, probes):
    tree = SuffixTree(contexts)
    for c in contexts:
        for a in range(len(c)):
            for b in range(a + 1, min(len(c), a + 12) + 1):
                cur = tree.root().step(c[a:b])
                assert cur is not None and cur.depth == b - a
                assert cur.occurrences() == brute_occurrences(contexts, c[a:b])
    for p in probes:
        assert tree.contains(p) == any(p in c for c in contexts)
        cur = tree.root().step(p)
        assert (cur is None) == (not any(p in c for c in contexts))
        if cur is not None:
            assert cur.occurrences() == brute_occurrences(contexts, p)


@settings(max_examples=200, deadline=None)
@given(contexts_strategy, st.data())
def test_stepping_byte_by_byte_equals_one_step(contexts, data):
    tree = SuffixTree(contexts)
    joined = b"".join(contexts)
    if not joined:
        assert tree.root().step(b"x") is None
        return
    i = data.draw(st.integers(0, len(contexts) - 1))
    c = contexts[i] or joined
    a = data.draw(st.integers(0, len(c) - 1))
    s = c[a:a + data.draw(st.integers(1, 10))] + data.draw(st.binary(max_size=2))
    cur = tree.root()
    for k in range(len(s)):
        cur = cur.step(s[k:k + 1]) if cur is not None else None
    whole = tree.root().step(s)
    assert (cur is None) == (whole is None)
    if whole is not None:
        assert (cur.node, cur.child, cur.offset, cur.depth) == (whole.node, whole.child, whole.offset, whole.depth)


# A vocabulary with multi-byte and partial UTF-8 tokens, as byte-level BPE has them
VOCAB_PIECES = [b"a", b"b", b"ab", b"aa", b"aba", b"bab", b" ", b" a", b"\xc3", b"\xa9", b"\xc3\xa9", b"\xe6\x9d\xb1",
                b"\xe6", b"\x9d\xb1", b"\xf0\x9f", b"\x99\x82", b"[", b"]", b"] ", b"a[", b"abab", b"aaaa"]


@settings(max_examples=300, deadline=None)
@given(contexts_strategy, st.lists(st.binary(min_size=1, max_size=4), max_size=30), st.data())
def test_allowed_tokens_match_brute_force(contexts, extra_vocab, data):
    vocab = VOCAB_PIECES + extra_vocab + [bytes([b]) for b in range(256)]
    trie = TokenTrie(vocab)
    tree = SuffixTree(contexts)
    nonempty = [c for c in contexts if c]
    prefixes = [b""]
    for _ in range(4):
        if nonempty:
            c = data.draw(st.sampled_from(nonempty))
            a = data.draw(st.integers(0, len(c) - 1))
            prefixes.append(c[a:a + data.draw(st.integers(1, 8))])
    for s in prefixes:
        cur = tree.root().step(s)
        expected = [i for i, v in enumerate(vocab) if any(s + v in c for c in contexts)]
        assert sorted(allowed_tokens(cur, trie).tolist()) == expected


def test_allowed_tokens_respect_a_subset_vocabulary_and_root_cache():
    vocab = [b"ab", b"b", b"c", b"[", b"abc"]
    trie = TokenTrie(vocab, token_ids=[0, 1, 4])  # `c` and `[` left out of the trie
    tree = SuffixTree([b"abc", b"x[y"])
    first = allowed_tokens(tree.root(), trie)
    assert sorted(first.tolist()) == [0, 1, 4]
    assert allowed_tokens(tree.root(), trie) is first  # computed once per tree and trie
    assert sorted(allowed_tokens(tree.root().step(b"a"), trie).tolist()) == [1]
    assert allowed_tokens(tree.root().step(b"abc"), trie).tolist() == []


def test_no_match_crosses_two_contexts():
    tree = SuffixTree([b"abc", b"def"])
    assert tree.contains(b"abc") and tree.contains(b"def")
    assert not tree.contains(b"cd") and not tree.contains(b"abcdef")
    assert SuffixTree([]).root().step(b"a") is None
    assert SuffixTree([b""]).contains(b"") and not SuffixTree([b""]).contains(b"a")


def test_construction_is_linear():
    rng = random.Random(0)
    per_byte, nodes_per_byte = [], []
    for n in (1_000, 10_000, 100_000):
        for text in (bytes(rng.choice(b"ab") for _ in range(n)), b"a" * n, (b"abcab" * n)[:n],
                     bytes(rng.randrange(256) for _ in range(n))):
            tree = SuffixTree([text[: n // 2], text[n // 2:]])
            per_byte.append(tree.steps / n)
            nodes_per_byte.append(len(tree.start) / n)
    # Ukkonen's amortised bound: at most a few steps and two nodes per input symbol, whatever the size
    assert max(per_byte) <= 4.0, per_byte
    assert max(nodes_per_byte) <= 2.01, nodes_per_byte
