"""retrieve.py and encoder.py: chunks, provenance, rankings, the embedder against sentence-transformers, the index
on disk, and the command line on documents larger than the model's window."""
import json
import random
from dataclasses import replace

import pytest
import torch

import chyd
from conftest import ROOT
from retrieve import Document, DocumentError, Index, chunk_tokenizer, chunks, paragraphs, read_documents

WORDS = ("check the wheel brake pressure before every flight and record the oil level in the log when the engine "
         "is cold then torque each nut to the value given in the table").split()


def plain_text(n_sentences: int, seed: int = 0) -> str:
    """Sentences of common words, each one token of the embedder's vocabulary, lines of a few sentences."""
    rng = random.Random(seed)
    out = []
    for i in range(n_sentences):
        out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 7))).capitalize() + ".")
        out.append("\n" if i % 5 == 4 else " ")
    return "".join(out)


def make_pdf(path, pages: list[list[str]]) -> None:
    """A PDF with one line of Helvetica text a string, written by hand (ASCII only)."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", None, b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for lines in pages:
        body = "BT /F1 10 Tf 12 TL 40 800 Td " + " ".join(
            "(" + l.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)") + ") Tj T*" for l in lines) + " ET"
        objects.append(f"<< /Length {len(body)} >>\nstream\n{body}\nendstream".encode())
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 595 842] /Resources << /Font << /F1 3 0 R >> >> "
                       f"/Contents {len(objects)} 0 R >>".encode())
        kids.append(f"{len(objects)} 0 R")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>".encode()
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    path.write_bytes(bytes(out))


def token_span(enc, passage) -> tuple[int, int]:
    """The passage as token indices [s, e) of the document's own tokenization."""
    starts = [o[0] for o in enc.offsets]
    ends = [o[1] for o in enc.offsets]
    return starts.index(passage.start), ends.index(passage.end) + 1


@pytest.mark.parametrize("size,overlap", [(300, 50), (100, 20), (60, 0)])
def test_chunks_have_the_size_and_overlap_asked_for(size, overlap):
    tokenizer = chunk_tokenizer()
    doc = Document("known.txt", None, plain_text(400))
    enc = tokenizer.encode(doc.text, add_special_tokens=False)
    assert all(not t.startswith("##") for t in enc.tokens)  # one token a word: the overlap is exact
    cs = chunks(doc, tokenizer, size, overlap)
    spans = [token_span(enc, c) for c in cs]
    assert spans[0][0] == 0 and spans[-1][1] == len(enc.tokens) and len(cs) > 5
    for (s, e), (s2, _) in zip(spans, spans[1:]):
        assert size - size // 6 < e - s <= size  # cut near the limit ...
        assert "\n" in doc.text[enc.offsets[e - 1][1]:enc.offsets[e][0]] or enc.tokens[e - 1] == "."  # ... at a line or sentence end
        assert s2 == e - overlap
    assert spans[-1][1] - spans[-1][0] <= size


def test_chunks_of_a_real_text_start_and_end_on_whole_words():
    tokenizer = chunk_tokenizer()
    text = "\n\n".join((ROOT / "data" / f).read_text() for f in ("manual.txt", "leaflet.txt")) * 3
    doc = Document("real.txt", None, text)
    enc = tokenizer.encode(text, add_special_tokens=False)
    cs = chunks(doc, tokenizer, 60, 15)
    for c, (s, e) in zip(cs, map(lambda c: token_span(enc, c), cs)):
        assert e - s <= 60 and not enc.tokens[s].startswith("##")
        assert e == len(enc.tokens) or not enc.tokens[e].startswith("##")
        assert c.text == text[c.start:c.end]


def test_provenance_is_exact_for_a_text_file_and_a_pdf(tmp_path, monkeypatch):
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    text = "Naïve café — line one.\r\nSecond line [ref 2].\n\n\nThird paragraph, 東京 🙂\n" + plain_text(300, seed=1)
    (tmp_path / "notes.md").write_bytes(text.encode())
    page_lines = [[f"Page {n} line {i}: " + " ".join(WORDS[(n * 7 + i) % 20:][:9]) for i in range(40)] for n in range(1, 4)]
    make_pdf(tmp_path / "manual.pdf", page_lines)
    (tmp_path / "skip.bin").write_bytes(b"\0\1")  # not a document: skipped in a folder
    docs = read_documents([str(tmp_path)])
    assert [(d.file.split("/")[-1], d.page) for d in docs] == [("manual.pdf", 1), ("manual.pdf", 2), ("manual.pdf", 3), ("notes.md", None)]
    assert docs[3].text == text  # newlines as in the file
    again = read_documents([str(tmp_path / "notes.md"), str(tmp_path), str(tmp_path / "." / "notes.md")])
    assert [(d.file, d.page) for d in again] == [(docs[3].file, None)] + [(d.file, d.page) for d in docs[:3]]  # each file once
    for n, d in enumerate(docs[:3], 1):
        assert page_lines[n - 1][0] in d.text and page_lines[n - 1][-1] in d.text
    tokenizer = chunk_tokenizer()
    for d in docs:
        for p in chunks(d, tokenizer, 50, 10) + paragraphs(d):
            assert p.text == d.text[p.start:p.end] and p.text.strip()
            assert (p.file, p.page) == (d.file, d.page) and p.line == d.text.count("\n", 0, p.start) + 1
    assert [p.line for p in paragraphs(docs[3])][:2] == [1, 5]


def test_pdf_text_is_extracted_once_and_a_damaged_copy_again(tmp_path, monkeypatch, capsys):
    import pypdf

    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    make_pdf(tmp_path / "m.pdf", [["Torque the nut to 45 lbf.ft."], [], ["Inflate to 150 psi."]])
    first = read_documents([str(tmp_path / "m.pdf")])
    assert [(d.page, d.text.strip()) for d in first] == [(1, "Torque the nut to 45 lbf.ft."), (3, "Inflate to 150 psi.")]
    monkeypatch.setattr(pypdf, "PdfReader", None)  # a second extraction would fail
    assert read_documents([str(tmp_path / "m.pdf")]) == first
    (cached,) = (tmp_path / "cache" / "pdf-text").iterdir()
    cached.write_text('{"broken"')
    monkeypatch.undo()
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    assert read_documents([str(tmp_path / "m.pdf")]) == first
    assert "is damaged" in capsys.readouterr().err
    assert json.loads(cached.read_text()) == {"texts": [first[0].text, "", first[1].text], "labels": None}  # every page


def labelled_pdf(path, pages: list[list[str]]) -> None:
    """make_pdf's PDF whose first two sheets are printed i, ii and the rest 1, 2, ... (a manual's front matter)."""
    from pypdf import PdfWriter

    make_pdf(path, pages)
    w = PdfWriter(clone_from=str(path))
    w.set_page_label(0, 1, style="/r")
    w.set_page_label(2, len(pages) - 1, style="/D")
    w.write(str(path))


def test_pdf_pages_carry_their_printed_label_and_the_cache_keeps_it(tmp_path, monkeypatch, capsys):
    import pypdf

    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    labelled_pdf(tmp_path / "m.pdf", [["Contents."], ["Foreword."], [], ["Torque the nut to 45 lbf.ft."], ["Inflate to 150 psi."]])
    make_pdf(tmp_path / "plain.pdf", [["Torque the nut."], ["Inflate."]])
    docs = read_documents([str(tmp_path / "m.pdf"), str(tmp_path / "plain.pdf"), str(ROOT / "data" / "manual.txt")])
    assert [(d.page, d.page_label) for d in docs] == [(1, "i"), (2, "ii"), (4, "2"), (5, "3"), (1, None), (2, None), (None, None)]
    assert [(p.page, p.page_label) for p in paragraphs(docs[2]) + chunks(docs[2], chunk_tokenizer())] == [(4, "2")] * 2
    built, again = Index(docs[:4], 8, 2), Index(docs[:4], 8, 2)  # a few chunks a page; then read back
    assert again.build_s == 0 and again.chunks == built.chunks and len(built.chunks) > 4
    assert {(c.page, c.page_label) for c in again.chunks} == {(1, "i"), (2, "ii"), (4, "2"), (5, "3")}
    unlabelled = Index([replace(d, page_label=None) for d in docs[:4]], 8, 2)  # the same texts: the same index on disk
    assert unlabelled.build_s == 0 and {c.page_label for c in unlabelled.chunks} == {None}  # labels come from the pages
    (cached,) = [f for f in (tmp_path / "cache" / "pdf-text").iterdir() if "Foreword" in f.read_text()]
    monkeypatch.setattr(pypdf, "PdfReader", None)  # read back: the labels come from the cache
    assert read_documents([str(tmp_path / "m.pdf")]) == docs[:4]
    monkeypatch.undo()
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    cached.write_text(json.dumps(json.loads(cached.read_text())["texts"]))  # the format before labels: texts alone
    assert read_documents([str(tmp_path / "m.pdf")]) == docs[:4] and capsys.readouterr().err == ""
    assert json.loads(cached.read_text())["labels"] == ["i", "ii", "1", "2", "3"]  # extracted again, labels and all



def test_json_and_the_source_line_give_the_printed_page_and_the_sheet(tmp_path, monkeypatch, capsys, tiny_folder):
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    labelled_pdf(tmp_path / "m.pdf", [["Contents: wheels, brakes."], ["Foreword: read the manual."],
                                      ["Torque the axle nut to 45 lbf.ft."], ["Inflate the tyres to 150 psi."]])
    labels = {1: "i", 2: "ii", 3: "1", 4: "2"}  # every label differs from its sheet
    args = ["--model", str(tiny_folder), "--ctx", str(tmp_path / "m.pdf"), "--whole", "--greedy", "--quote-first",
            "--max-new-tokens", "12", "-q", "What pressure?"]
    assert chyd.main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(p["page"], p["page_label"]) for p in out["passages"]] == list(labels.items())
    sources = [s for q in out["quotes"] for s in q["sources"]]
    assert sources and all(s["page_label"] == labels[s["page"]] for s in sources)
    assert chyd.main(args) == 0
    shown = capsys.readouterr().out  # the same greedy answer, its sources a line a quote
    assert "\n[1] passage " in shown and all(f"m.pdf, p. {labels[s['page']]} (sheet {s['page']}), line {s['line']}, "
                                              in shown for s in sources)
    src = {"file": "m.pdf", "page": 4, "page_label": "4", "line": 2, "start": 0, "end": 5}  # a label that says no more
    assert chyd.describe(src, 0) == chyd.describe({**src, "page_label": None}, 0) == "passage 1 (m.pdf, page 4, line 2, chars 0-5)"


CORPUS = {
    "tyres": "Inflate the main wheel tyres to 185 psi with dry nitrogen. Check tyre pressure when the tyres are cold.",
    "torque": "Torque the axle nut to 45 lbf.ft while rotating the wheel, then back it off and retorque to 30 lbf.ft.",
    "oil": "Check the engine oil level 10 minutes after shutdown. Add oil of the approved grade up to the full mark.",
    "dose": "Adults may take one or two tablets every four to six hours, and no more than eight tablets in 24 hours.",
    "storage": "Store the tablets below 25 degrees Celsius in the original package, out of the sight and reach of children.",
}


@pytest.fixture(scope="module")
def corpus_index(tmp_path_factory):
    with pytest.MonkeyPatch.context() as m:
        m.setenv("CHYD_CACHE", str(tmp_path_factory.mktemp("cache")))
        return Index([Document(name, None, text) for name, text in CORPUS.items()])


@pytest.mark.parametrize("retriever,question,expected", [
    ("bm25", "What torque for the axle nut?", "torque"),
    ("bm25", "How many tablets in 24 hours?", "dose"),
    ("dense", "How tight should the wheel fastener be tightened?", "torque"),
    ("dense", "Where do I keep the medicine?", "storage"),
    ("dense", "When can I measure the lubricant after the motor stops?", "oil"),
    ("hybrid", "What gas fills the tyres?", "tyres"),
])
def test_each_retriever_ranks_the_right_passage_first(corpus_index, retriever, question, expected):
    hits = corpus_index.search(question, 3, retriever)
    assert hits[0].file == expected and len(hits) == 3
    assert hits[0].score >= hits[1].score >= hits[2].score


def test_embedder_matches_sentence_transformers():
    from sentence_transformers import SentenceTransformer

    from encoder import Encoder, model_folder

    texts = ["Torque the axle nut to 45 lbf.ft.", "Naïve café — 東京 🙂", "x", plain_text(60)]  # the last is cut at 256
    texts += [(ROOT / "data" / "manual.txt").read_text()[i:i + 700] for i in range(0, 1400, 350)]
    theirs = torch.from_numpy(SentenceTransformer(str(model_folder()), device="cpu").encode(texts, normalize_embeddings=True))
    exact = Encoder.load(bf16=False).embed(texts, batch_size=3)
    assert exact.shape == (len(texts), 384) and (exact * theirs).sum(-1).min() >= 0.99999
    fast = Encoder.load(bf16=True).embed(texts)  # bf16 products, as on this CPU
    assert (fast * theirs).sum(-1).min() >= 0.9999


def test_the_index_is_read_back_and_a_damaged_part_rebuilt(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path))
    docs = [Document(name, None, text) for name, text in CORPUS.items()]
    first = Index(docs, 40, 10)
    first.vectors
    assert first.build_s > 0 and not capsys.readouterr().err
    again = Index(docs, 40, 10)
    assert torch.equal(again.vectors, first.vectors) and [c.text for c in again.chunks] == [c.text for c in first.chunks]
    assert again.build_s == 0  # nothing made again
    (again.folder / "chunks.json").write_text("[[0, 5")
    (again.folder / "dense.safetensors").write_bytes(b"\0" * 10)
    (again.folder / "bm25" / "params.index.json").write_text("{")
    mended = Index(docs, 40, 10)
    assert mended.search("torque", 1, "hybrid")[0].file == "torque" and mended.build_s > 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all("is damaged" in line and "rebuilding" in line for line in err)
    assert Index(docs, 41, 10).folder != first.folder  # other chunk settings, another index


def big_pdf(path) -> str:
    """A 30-page PDF, about 12,000 tokens: filler, and the manual's tyre paragraph on page 17. Returns it."""
    manual = (ROOT / "data" / "manual.txt").read_text()
    tyre = next(p for p in manual.split("\n\n") if "nose wheel" in p)
    rng = random.Random(3)
    pages = [[" ".join(rng.choice(WORDS) for _ in range(14)) for _ in range(30)] for _ in range(30)]
    pages[16][10:10] = tyre.splitlines()
    make_pdf(path, pages)
    return tyre


def test_a_document_larger_than_the_window_is_answered_from_retrieved_pages(tmp_path, smollm2_gguf_path):
    import os
    import subprocess
    import sys

    folder = tmp_path / "docs"
    folder.mkdir()
    big_pdf(folder / "big.pdf")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir())
    cache = tmp_path / "cache"  # a fresh index cache, with the model of the real one
    cache.mkdir()
    (cache / smollm2_gguf_path.parent.name).symlink_to(smollm2_gguf_path.parent)
    env = dict(os.environ, CHYD_CACHE=str(cache))
    args = [sys.executable, str(ROOT / "chyd.py"), "--ctx", str(folder), "--json", "--greedy", "--max-new-tokens", "24",
            "-q", "What is the nominal inflation pressure of the nose wheel tyres?"]
    runs = [subprocess.run(args, capture_output=True, text=True, env=env, timeout=600) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    first, second = (json.loads(r.stdout) for r in runs)
    assert "do not fit the prompt; the top 5 of" in runs[0].stderr
    assert "(hybrid, reranked by smollm2 from its top 10 and BM25's top 5), the best last" in runs[0].stderr  # the defaults
    docs = read_documents([str(folder)])
    pages = {d.page: d.text for d in docs}
    assert len(first["passages"]) == 5 and all(p["page"] for p in first["passages"])
    for p in first["passages"]:
        assert pages[p["page"]][p["start"]:p["end"]] == p["text"] and p["score"] < 0  # a mean log-probability
    scores = [p["score"] for p in first["passages"]]
    assert scores == sorted(scores) and scores[0] < scores[-1]  # the best last, next to the question
    assert any("nose wheel" in p["text"] for p in first["passages"])
    assert first["quotes"] and first["prompt_tokens"] < 8192 - 24
    for q in first["quotes"]:
        assert q["sources"]
        for s in q["sources"]:
            assert s["file"].endswith("big.pdf") and s["page"] in pages
            assert pages[s["page"]][s["start"]:s["end"]] == q["text"]
            assert s["line"] == pages[s["page"]].count("\n", 0, s["start"]) + 1
    assert first["timings"]["index_s"] > 0 and second["timings"]["index_s"] == 0  # the second run reads the index back
    assert second["answer"] == first["answer"] and second["passages"] == first["passages"]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir()) == before  # the user's files are only read


def test_passages_that_fit_are_all_shown_and_top_k_0_never_retrieves(smollm2, monkeypatch, tmp_path):
    model, tok = smollm2
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path))
    args = chyd.build_parser().parse_args(["--ctx", str(ROOT / "data" / "manual.txt"), "--top-k", "3", "--retriever", "bm25"])
    assert args.rerank == "smollm2"  # the default reranker
    loads = []

    def load_rerank():  # a reranker that prefers the retriever's last of its ten
        loads.append(1)
        return lambda q, texts: [float(i) for i in range(len(texts))]
    library = chyd.Library(read_documents(args.ctx), args, load_rerank)
    passages, timings = library.passages(model.config.max_position_embeddings, tok, "What torque?", chyd.DecodeOptions())
    assert passages == library.everything and len(passages) > 3 and library.index is None
    assert timings == {"index_s": 0.0, "retrieve_s": 0.0} and not loads  # no retrieval, no reranker loaded
    huge = [Document("big", None, plain_text(4000))]
    library = chyd.Library(huge, args, load_rerank)
    assert not chyd.prompt_fits(model.config.max_position_embeddings, tok, "What torque?", [p.text for p in library.everything], 64)
    for question in ("What torque?", "What pressure?"):
        passages, _ = library.passages(model.config.max_position_embeddings, tok, question, chyd.DecodeOptions())
        pool = library.index.search(question, 10, "bm25")
        assert [p.text for p in passages] == [p.text for p in pool[-3:]]  # the reranker's top 3, the best last
    assert len(loads) == 1  # loaded when a question first needed it, then kept
    args.rerank = None  # --rerank none: the retriever's top 3, the best last
    library = chyd.Library(huge, args)
    passages, _ = library.passages(model.config.max_position_embeddings, tok, "What torque?", chyd.DecodeOptions())
    assert passages == library.index.search("What torque?", 3, "bm25")[::-1]
    args.top_k = 0
    passages, _ = chyd.Library(huge, args).passages(model.config.max_position_embeddings, tok, "What torque?", chyd.DecodeOptions())
    assert passages == chyd.Library(huge, args).everything


def encrypted_pdf(src, dst) -> None:
    from pypdf import PdfWriter

    w = PdfWriter(clone_from=str(src))
    w.encrypt("secret", algorithm="RC4-128")
    w.write(str(dst))


@pytest.mark.parametrize("case,message", [
    ("empty_folder", "has no text, Markdown or PDF file"),
    ("no_documents", "has no text, Markdown or PDF file"),
    ("binary", "is binary, not text"),
    ("latin1", "is not UTF-8 text (byte 3)"),
    ("encrypted", "is an encrypted PDF"),
    ("corrupt", "is not a readable PDF"),
    ("no_text_pdf", "has no text to extract"),
])
def test_bad_documents_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, case, message):
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    target = tmp_path / case
    target.mkdir()
    if case == "no_documents":
        (target / "photo.png").write_bytes(b"\x89PNG")
    elif case == "binary":
        target = target / "data.txt"
        target.write_bytes(b"ab\0cd")
    elif case == "latin1":
        target = target / "old.txt"
        target.write_bytes("café".encode("latin-1"))
    elif case in ("encrypted", "corrupt", "no_text_pdf"):
        make_pdf(tmp_path / "plain.pdf", [["Torque the nut."]] if case != "no_text_pdf" else [[]])
        target = target / "doc.pdf"
        if case == "encrypted":
            encrypted_pdf(tmp_path / "plain.pdf", target)
        elif case == "corrupt":
            target.write_bytes((tmp_path / "plain.pdf").read_bytes()[:200])
        else:
            target.write_bytes((tmp_path / "plain.pdf").read_bytes())
    listing = lambda: sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if "cache" not in p.parts)
    before = listing()
    assert chyd.main(["--ctx", str(target), "-q", "x"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("chyd.py: error: ") and message in err
    assert str(target) in err  # names the file or folder
    assert listing() == before  # the user's files are only read


def test_a_folder_leaves_out_the_files_it_cannot_read_and_names_each(tmp_path, capsys):
    folder = tmp_path / "manuals"
    folder.mkdir()
    (folder / "a.txt").write_text("Torque the nut to 25 Nm.\n")
    (folder / "b.txt").write_bytes(b"ab\0cd")
    (folder / "c.txt").write_bytes("café".encode("latin-1"))
    make_pdf(folder / "d.pdf", [[]])  # a scan: no text layer
    docs = read_documents([str(folder)])
    assert [(d.file, d.text) for d in docs] == [(str(folder / "a.txt"), "Torque the nut to 25 Nm.\n")]
    assert capsys.readouterr().err.splitlines() == [
        f"chyd: left out: {folder / 'b.txt'} is binary, not text",
        f"chyd: left out: {folder / 'c.txt'} is not UTF-8 text (byte 3)",
        f"chyd: left out: {folder / 'd.pdf'} has no text to extract (a scanned PDF needs OCR first)"]
    for paths in ([folder, folder / "b.txt"], [folder / "b.txt", folder]):  # named, it is refused wherever it stands
        with pytest.raises(DocumentError, match="b.txt is binary, not text"):
            read_documents([str(p) for p in paths])
    (folder / "a.txt").unlink()
    with pytest.raises(DocumentError, match=f"no file of {folder} could be read"):
        read_documents([str(folder)])


def test_a_file_given_twice_is_read_once_under_the_first_name_given(tmp_path):
    folder = tmp_path / "manuals"
    folder.mkdir()
    (folder / "a.txt").write_text("Torque the nut to 25 Nm.\n")
    (folder / "b.txt").write_text("Bleed the brakes.\n")
    other = str(tmp_path / "manuals" / ".." / "manuals" / "a.txt")  # the same file, spelt otherwise
    assert [d.file for d in read_documents([other, str(folder)])] == [other, str(folder / "b.txt")]
    assert [d.file for d in read_documents([str(folder), other])] == [str(folder / "a.txt"), str(folder / "b.txt")]


@pytest.mark.parametrize("flags,message", [
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--chunk-tokens", "0"], "--chunk-tokens must be >= 1"),
    (["--chunk-overlap", "300"], "--chunk-overlap must be >= 0 and below --chunk-tokens (300)"),
    (["--retriever", "tfidf"], "invalid choice: 'tfidf'"),
    (["--rerank", "nosuch"], "unknown model 'nosuch'"),
])
def test_bad_retrieval_flags_are_one_line_and_exit_2(capsys, flags, message):
    assert chyd.main(["--ctx", str(ROOT / "data" / "manual.txt"), "-q", "x", *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err


def test_a_reranker_orders_the_retrievers_top_10_and_keeps_k(tmp_path, monkeypatch):
    from retrieve import RERANK_POOL

    monkeypatch.setenv("CHYD_CACHE", str(tmp_path))
    rng = random.Random(5)
    index = Index([Document(f"doc{i}", None, " ".join(rng.choice(WORDS) for _ in range(12)) + f" item{i}.")
                   for i in range(2 * RERANK_POOL)])
    question = "torque the nut when the engine is cold"
    pool = index.search(question, RERANK_POOL, "bm25")
    seen = []

    def score(q, texts):  # prefers the retriever's 8th and, tied, keeps the retriever's order among the rest
        seen.append((q, texts))
        return [5.0 if t == pool[7].text else 1.0 for t in texts]

    hits = index.search(question, 3, "bm25", rerank=score)
    assert seen == [(question, [p.text for p in pool])]  # the retriever's top 10, best first, scored once
    assert [h.text for h in hits] == [pool[7].text, pool[0].text, pool[1].text]
    assert [h.score for h in hits] == [5.0, 1.0, 1.0]  # the reranker's scores replace the retriever's
    assert index.search(question, 3, "bm25") == pool[:3]  # without it, the retriever's own
    many = index.search(question, 12, "bm25", rerank=lambda q, texts: [float(-i) for i in range(len(texts))])
    assert [h.text for h in many] == [h.text for h in index.search(question, 12, "bm25")]  # k above the pool: k scored


def test_a_reranker_also_scores_bm25s_top_5_beside_another_retriever(tmp_path, monkeypatch):
    from retrieve import RERANK_POOL, RERANK_WORDS

    monkeypatch.setenv("CHYD_CACHE", str(tmp_path))
    rng = random.Random(6)
    n = 3 * RERANK_POOL
    index = Index([Document(f"doc{i}", None, " ".join(rng.choice(WORDS) for _ in range(12)) + f" item{i}.")
                   for i in range(n)])
    monkeypatch.setattr(index, "dense_scores", lambda q: torch.arange(n, dtype=torch.float))  # the last chunks first
    question = "torque the nut when the engine is cold"
    dense = index.search(question, RERANK_POOL, "dense")
    words = [h for h in index.search(question, RERANK_WORDS, "bm25") if h.text not in {d.text for d in dense}]
    assert words and all(h.score > 0 for h in words)
    seen = []
    hits = index.search(question, 2, "dense", rerank=lambda q, texts: seen.extend(texts) or [0.0] * len(texts))
    assert seen == [h.text for h in dense + words]  # the retriever's pool, then BM25's best that it lacks
    assert [h.text for h in hits] == [h.text for h in dense[:2]]  # tied: the pool's order
    seen.clear()
    index.search("zzz qqq", 2, "dense", rerank=lambda q, texts: seen.extend(texts) or [0.0] * len(texts))
    assert seen == [h.text for h in dense]  # no word shared with the question: BM25 adds nothing


def test_rerank_shows_the_top_k_of_the_answering_models_own_scores(tmp_path, monkeypatch, smollm2, smollm2_gguf_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / smollm2_gguf_path.parent.name).symlink_to(smollm2_gguf_path.parent)
    monkeypatch.setenv("CHYD_CACHE", str(cache))
    big = tmp_path / "big.txt"
    big.write_text(plain_text(4000))
    question = "What torque for the nut in the table?"
    rc = chyd.main(["--ctx", str(big), "-q", question, "--json", "--greedy", "--max-new-tokens", "8", "--dtype",
                    "float32", "--retriever", "bm25", "--top-k", "2", "--rerank", "smollm2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "reranking with smollm2 (the answering model)" in err and "(bm25, reranked by smollm2 from its top 10)" in err
    pool = Index(read_documents([str(big)])).search(question, 10, "bm25")
    scores = chyd.question_scorer(*smollm2)(question, [p.text for p in pool])  # the fixture: the same fp32 weights
    best = sorted(zip(scores, range(len(pool))), key=lambda x: -x[0])[:2]
    shown = json.loads(out)["passages"][::-1]  # shown the best last
    assert [p["text"] for p in shown] == [pool[i].text for _, i in best]
    assert [p["score"] for p in shown] == pytest.approx([s for s, _ in best], abs=1e-4)
    assert [i for _, i in best] != [0, 1]  # the reranker moved a chunk: the check above is not the retriever's order
    rc = chyd.main(["--ctx", str(big), "-q", question, "--json", "--greedy", "--max-new-tokens", "8", "--dtype",
                    "float32", "--retriever", "bm25", "--top-k", "2", "--rerank", "none"])
    out, err = capsys.readouterr()
    assert rc == 0 and "reranking" not in err and "(bm25), the best last" in err, err
    shown = json.loads(out)["passages"]
    assert [p["text"] for p in shown] == [p.text for p in pool[1::-1]]  # the retriever's top 2, the best last
    assert [p["score"] for p in shown] == pytest.approx([p.score for p in pool[1::-1]], abs=1e-4)
