"""Documents -> passages with exact provenance -> a BM25 + dense index on disk -> the top k for a question.

    docs = read_documents(["manual.pdf", "notes/"])     # a file's text, or a PDF page's
    index = Index.open(docs)                            # chunked, indexed, cached under CHYD_CACHE
    passages = index.search("What torque?", k=5)        # hybrid: BM25 and all-MiniLM-L6-v2, fused by rank
    passages = index.search("What torque?", k=3, rerank=score)  # the top RERANK_POOL (+ BM25's) reordered by score(question, texts)

Every passage knows its file, page (PDF, from 1) and the page's printed label, line (from 1) and character
offsets into its document's text, so that passage.text == document.text[passage.start:passage.end].
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import tokenizers
import torch

from checkpoints import cache_dir
from encoder import Encoder, model_folder, vectors_id

CHUNK_TOKENS, CHUNK_OVERLAP = 300, 50  # the facet-tracing paper's chunks
RRF_K = 60  # reciprocal rank fusion: score = sum of 1 / (RRF_K + rank), the constant of Cormack et al.
RETRIEVERS = ("hybrid", "bm25", "dense")
RERANK_POOL = 10  # chunks a reranker scores: SmolLM2 2.7 s a question here (from 20: dev recall@3 54 of 56 against 53, at twice the time)
RERANK_WORDS = 5  # and BM25's top 5 beside another retriever's: dev recall@5 of hybrid's pool reranked 51 of 56 to 54
TEXT_SUFFIXES = {".txt", ".text", ".md", ".markdown", ".rst"}
INDEX_VERSION = 1  # bump when the files of an index change shape


class DocumentError(ValueError):
    pass


@dataclass
class Document:
    file: str
    page: int | None  # PDF page, from 1; None for a text file
    text: str  # the file's text, or the page's extracted text
    page_label: str | None = None  # the PDF's printed page number ("iv", "T-2", "4"); None without /PageLabels

    @cached_property
    def newlines(self) -> list[int]:
        return [m.start() for m in re.finditer("\n", self.text)]

    def line_of(self, offset: int) -> int:
        """The line (from 1) of a character offset: a bisection, so that 1,000s of chunks of one long file cost little."""
        return bisect_right(self.newlines, offset - 1) + 1


@dataclass
class Passage:
    text: str
    file: str
    page: int | None
    page_label: str | None
    line: int  # line of the document the passage starts on, from 1
    start: int  # character offsets into the document's text
    end: int
    score: float | None = None  # the retriever's, when it was retrieved

    def line_at(self, offset: int) -> int:
        """The line of a character offset inside the passage."""
        return self.line + self.text.count("\n", 0, offset)


def passage(doc: Document, start: int, end: int) -> Passage:
    return Passage(doc.text[start:end], doc.file, doc.page, doc.page_label, doc.line_of(start), start, end)


def read_text(path: Path) -> str:
    data = path.read_bytes()
    if b"\0" in data:
        raise DocumentError(f"{path} is binary, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DocumentError(f"{path} is not UTF-8 text (byte {e.start})") from None


def read_pdf(path: Path) -> list[Document]:
    """One document a page that has text. The pages' text and labels are kept under CHYD_CACHE, keyed by the
    file's bytes and pypdf's version, since extracting a long PDF again on every question takes seconds."""
    import pypdf

    digest = hashlib.sha256(path.read_bytes() + pypdf.__version__.encode()).hexdigest()[:24]
    cached = cache_dir() / "pdf-text" / f"{digest}.json"
    pdf = None
    if cached.is_file():
        try:
            pdf = json.loads(cached.read_text(encoding="utf-8"))
            if isinstance(pdf, list):  # the format before labels: extracted again, no warning
                pdf = None
            elif not is_pdf_text(pdf):
                raise ValueError("not page texts and labels")
        except (ValueError, UnicodeDecodeError) as e:
            print(f"chyd: cached text {cached} is damaged ({type(e).__name__}); extracting {path} again", file=sys.stderr)
            pdf = None
    if pdf is None:
        pdf = extract_pdf_text(path)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(pdf), encoding="utf-8")
        os.replace(tmp, cached)
    labels = pdf["labels"] or [None] * len(pdf["texts"])
    pages = [Document(str(path), n, t, label) for n, (t, label) in enumerate(zip(pdf["texts"], labels), 1) if t.strip()]
    if not pages:
        raise DocumentError(f"{path} has no text to extract (a scanned PDF needs OCR first)")
    return pages


def is_pdf_text(pdf) -> bool:
    """Whether a cached entry has the shape extract_pdf_text returns."""
    if not (isinstance(pdf, dict) and set(pdf) == {"texts", "labels"} and isinstance(pdf["texts"], list)):
        return False
    texts, labels = pdf["texts"], pdf["labels"]
    return all(isinstance(t, str) for t in texts) and (labels is None or isinstance(labels, list) and len(labels) == len(texts)
                                                       and all(l is None or isinstance(l, str) for l in labels))


def extract_pdf_text(path: Path) -> dict:
    """{"texts": the text of every page, "labels": its printed page number (None where empty), or None when the
    PDF defines no /PageLabels (pypdf then numbers the pages 1, 2, ..., which says nothing the page does not)}."""
    import logging

    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # its warnings about odd but readable files
    try:
        reader = PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):
            raise DocumentError(f"{path} is an encrypted PDF; give a decrypted copy")
        labels = [label or None for label in reader.page_labels] if "/PageLabels" in reader.root_object else None
        return {"texts": [page.extract_text() or "" for page in reader.pages], "labels": labels}
    except (PyPdfError, ValueError, KeyError, TypeError, OSError) as e:
        if isinstance(e, DocumentError):
            raise
        raise DocumentError(f"{path} is not a readable PDF ({type(e).__name__}: {e})") from None


def read_file(path: Path) -> list[Document]:
    if path.suffix.lower() == ".pdf":
        return read_pdf(path)
    text = read_text(path)
    if not text.strip():
        raise DocumentError(f"{path} is empty")
    return [Document(str(path), None, text)]


def read_documents(paths: list[str]) -> list[Document]:
    """Files and folders (recursive: text, Markdown and PDF files, hidden ones skipped), in a stable order,
    each file once however often it is named. A file named that cannot be read is an error; one found in a
    folder (a scan, a binary .txt) is left out with a line on stderr, so that one bad file does not stop a
    folder of manuals, unless none is left. A user's files are only read."""
    files, folders, named = [], [], set()  # named: the files given by name, resolved
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts)
                           and (f.suffix.lower() in TEXT_SUFFIXES or f.suffix.lower() == ".pdf"))
            if not found:
                raise DocumentError(f"folder {p} has no text, Markdown or PDF file")
            files += found
            folders.append(p)
        elif path.is_file():
            files.append(path)
            named.add(path.resolve())
        else:
            raise DocumentError(f"context file {p} does not exist")
    first_names = {}  # each file once, by the first name it was given, in order
    for f in files:
        first_names.setdefault(f.resolve(), f)
    docs = []
    for real, f in first_names.items():
        try:
            docs += read_file(f)
        except DocumentError as e:
            if real in named:
                raise
            print(f"chyd: left out: {e}", file=sys.stderr)
    if not docs:
        raise DocumentError(f"no file of {', '.join(folders)} could be read (each left out above)")
    return docs


def paragraphs(doc: Document) -> list[Passage]:
    """The document split at blank lines: the passages shown when every one of them fits the prompt."""
    return [passage(doc, m.start(), m.end()) for m in re.finditer(r"\S(?:.|\n(?!\s*\n))*", doc.text)]


def chunk_tokenizer() -> tokenizers.Tokenizer:
    """The embedder's WordPiece tokenizer, which counts a chunk's tokens: see README, Documents and retrieval."""
    tokenizer = tokenizers.Tokenizer.from_file(str(model_folder() / "tokenizer.json"))
    tokenizer.no_truncation()  # its file cuts at 128 tokens and pads to 128, for the embedder
    tokenizer.no_padding()
    return tokenizer


def chunks(doc: Document, tokenizer: tokenizers.Tokenizer, size: int = CHUNK_TOKENS, overlap: int = CHUNK_OVERLAP) -> list[Passage]:
    """Windows of at most `size` tokens, each starting `overlap` tokens before the last one ended.

    A window ends at a line or sentence end when one lies within its last `size // 6` tokens, else after
    a whole word; a window starts at the first piece of a word. So the overlap is `overlap` tokens, or
    the few more that reach back to the start of a word.
    """
    enc = tokenizer.encode(doc.text, add_special_tokens=False)
    offsets, n = enc.offsets, len(enc.offsets)
    word_start = [not t.startswith("##") for t in enc.tokens]
    text, slack = doc.text, min(size // 6, (size - overlap) // 2)
    out, s = [], 0

    def ends_line_or_sentence(j: int) -> bool:  # between tokens j - 1 and j
        gap = text[offsets[j - 1][1]:offsets[j][0]]
        return "\n" in gap or bool(gap) and text[offsets[j - 1][1] - 1] in ".!?"

    out, s = [], 0
    while n:
        e = min(s + size, n)
        if e < n:
            near = [j for j in range(e, e - slack, -1) if ends_line_or_sentence(j)]
            e = near[0] if near else next((j for j in range(e, s, -1) if word_start[j]), e)
        out.append(passage(doc, offsets[s][0], offsets[e - 1][1]))
        if e == n:
            break
        nxt = e - overlap
        while nxt > s + 1 and not word_start[nxt]:
            nxt -= 1
        s = max(nxt, s + 1)  # always forward, even past a word longer than the window
    return out


class Index:
    """BM25 (bm25s) and dense (all-MiniLM-L6-v2, cosine) over the chunks of a document set, kept on disk.

    The folder is keyed by the documents' texts (hashed), the chunk settings and the embedder, so that a second
    question on the same documents reads it back. Each part is written atomically (a temporary name, then a
    rename); a damaged part is rebuilt with a one-line warning. The dense part is made when first needed.
    """

    def __init__(self, docs: list[Document], size: int = CHUNK_TOKENS, overlap: int = CHUNK_OVERLAP):
        if not 0 <= overlap < size:
            raise ValueError(f"--chunk-overlap must be >= 0 and below --chunk-tokens ({size}), got {overlap}")
        self.docs, self.size, self.overlap = docs, size, overlap
        key = hashlib.sha256(json.dumps([INDEX_VERSION, size, overlap, vectors_id(), chunk_tokenizer_id(),
                                         [hashlib.sha256(d.text.encode()).hexdigest() for d in docs]]).encode())
        self.folder = cache_dir() / "index" / key.hexdigest()[:24]
        self.built: dict[str, float] = {}  # seconds spent making each part that was not read back
        self.chunks = self.cached("chunks.json", self.make_chunks, self.save_chunks, self.read_chunks)
        self.bm25 = self.cached("bm25", self.make_bm25, lambda b, path: b.save(str(path), show_progress=False),
                                self.read_bm25)
        self._vectors = self._encoder = None

    def cached(self, name: str, make, save, read):
        """read(path) if the part is on disk and whole; else make(), saved atomically."""
        path = self.folder / name
        if path.exists():
            try:
                return read(path)
            except Exception as e:  # whatever is wrong with it, the documents can make it again
                print(f"chyd: index part {path} is damaged ({type(e).__name__}); rebuilding it", file=sys.stderr)
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        t0 = time.perf_counter()
        value = make()
        self.built[name] = time.perf_counter() - t0
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{name}.{os.getpid()}.tmp"
        save(value, tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # a folder that another process has just put in place: keep that one
            shutil.rmtree(tmp)
        return value

    @property
    def build_s(self) -> float:
        """Seconds spent making parts of the index; 0 when every part was read back."""
        return sum(self.built.values())

    def make_chunks(self) -> list[Passage]:
        tokenizer = chunk_tokenizer()
        return [c for d in self.docs for c in chunks(d, tokenizer, self.size, self.overlap)]

    def save_chunks(self, value: list[Passage], path: Path) -> None:
        where = {(d.file, d.page): i for i, d in enumerate(self.docs)}
        path.write_text(json.dumps([[where[c.file, c.page], c.start, c.end] for c in value]))

    def read_chunks(self, path: Path) -> list[Passage]:
        out = []
        for i, start, end in json.loads(path.read_text()):
            if not 0 <= start < end <= len(self.docs[i].text):
                raise ValueError(f"chunk {start}-{end} outside document {i}")
            out.append(passage(self.docs[i], start, end))
        return out

    def make_bm25(self):
        import bm25s

        bm25 = bm25s.BM25()
        bm25.index(bm25_tokens([c.text for c in self.chunks]), show_progress=False)
        return bm25

    def read_bm25(self, path: Path):
        import bm25s

        bm25 = bm25s.BM25.load(str(path), show_progress=False)
        if bm25.scores["num_docs"] != len(self.chunks):
            raise ValueError("BM25 index of another size")
        return bm25

    @property
    def encoder(self) -> Encoder:
        if self._encoder is None:  # loaded when first needed: BM25 alone does without it
            self._encoder = Encoder.load()
        return self._encoder

    @property
    def vectors(self) -> torch.Tensor:
        """[chunks, 384] unit vectors, embedded once (with a progress bar on a terminal)."""
        if self._vectors is None:
            from safetensors.torch import load_file, save_file

            def read(path):
                v = load_file(path)["vectors"]
                if v.shape[0] != len(self.chunks):
                    raise ValueError("vectors of another size")
                return v

            self._vectors = self.cached("dense.safetensors", self.embed_chunks,
                                        lambda v, path: save_file({"vectors": v}, path), read)
        return self._vectors

    def embed_chunks(self) -> torch.Tensor:
        from tqdm import tqdm

        with tqdm(total=len(self.chunks), desc="chyd: embedding chunks", unit="chunk", disable=not sys.stderr.isatty(),
                  file=sys.stderr) as bar:
            return self.encoder.embed([c.text for c in self.chunks], progress=bar.update)

    def search(self, question: str, k: int = 5, retriever: str = "hybrid",
               rerank: Callable[[str, list[str]], list[float]] | None = None) -> list[Passage]:
        """The top k chunks for the question, best first, each with its retriever's score (RRF when hybrid); with
        rerank, the retriever's top max(k, RERANK_POOL) and BM25's top RERANK_WORDS (manual pages are asked about
        in their own words: an option's name that the fusion ranks low) ordered by rerank(question, their texts)
        instead, each with that score."""
        if retriever not in RETRIEVERS:
            raise ValueError(f"unknown retriever {retriever!r}; choose one of {', '.join(RETRIEVERS)}")
        bm25 = self.bm25_scores(question) if retriever != "dense" or rerank else None
        if retriever == "bm25":
            scores = bm25
        elif retriever == "dense":
            scores = self.dense_scores(question)
        else:  # reciprocal rank fusion; a chunk that shares no word with the question gets nothing from BM25
            scores = reciprocal_ranks(self.dense_scores(question)) + torch.where(bm25 > 0, reciprocal_ranks(bm25), 0.0)
        top = scores.topk(min(max(k, RERANK_POOL) if rerank else k, len(self.chunks)))
        chosen = top.indices.tolist()
        hits = [replace(self.chunks[i], score=round(float(v), 6)) for v, i in zip(top.values, chosen)]
        if rerank:  # a stable sort: equal scores keep the pool's order
            best = bm25.topk(min(RERANK_WORDS, len(self.chunks)))
            words = [i for v, i in zip(best.values, best.indices.tolist()) if v > 0 and i not in chosen]
            hits += [self.chunks[i] for i in words]
            hits = [replace(h, score=round(s, 6)) for s, h in zip(rerank(question, [h.text for h in hits]), hits)]
            hits.sort(key=lambda h: -h.score)
        return hits[:k]

    def bm25_scores(self, question: str) -> torch.Tensor:
        return torch.from_numpy(self.bm25.get_scores(bm25_tokens([question])[0])).float()

    def dense_scores(self, question: str) -> torch.Tensor:
        return self.vectors @ self.encoder.embed([question])[0]  # cosines: both sides have unit length


def reciprocal_ranks(scores: torch.Tensor) -> torch.Tensor:
    """1 / (RRF_K + rank) of every entry, rank 1 for the highest score, [n]."""
    order = scores.argsort(descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(1, len(order) + 1)
    return 1 / (RRF_K + rank)


def chunk_tokenizer_id() -> str:
    return hashlib.sha256((model_folder() / "tokenizer.json").read_bytes()).hexdigest()[:16]


def bm25_tokens(texts: list[str]) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)
