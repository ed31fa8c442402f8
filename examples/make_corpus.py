"""Build the training corpus and the tokenizer of jdet's embedded default model.

The corpus is text every Python installation carries, so the model can be rebuilt on any machine
without a network: the docstrings of the standard library (module, class, function and method
docstrings, each its own document headed by its qualified name) and the `pydoc_data.topics`
help pages. Documents come out in a deterministic order (sorted module names, sorted member
names, duplicates dropped at their second occurrence); every 20th document is held out.

The corpus depends on the Python that runs this script (the shipped model was built on CPython
3.11.7). Importing every stdlib module is safe only with a skip list: modules with side effects on
import (`antigravity` opens a browser, `this` prints, `__hello__` prints), GUI toolkits, IDLE, and
test packages are skipped; modules that fail to import are skipped too.

Outputs (train_tiny.py reads them):
  <out>/corpus_train.txt, <out>/corpus_heldout.txt   documents joined by EOT (for inspection)
  <out>/train_ids.npy, <out>/heldout_ids.npy          uint16 token ids, EOT before every document
  <model_dir>/tokenizer.json, tokenizer_config.json, special_tokens_map.json

Usage: python examples/make_corpus.py [--out build/tiny] [--model-dir jdet/default_model]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import pkgutil
import re
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]
VOCAB_SIZE = 8192
HELDOUT_EVERY = 20

# Qwen-style chat template: system/user/assistant turns as <|im_start|>role\n...<|im_end|>\n.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Top-level modules never imported: side effects on import, GUI, IDLE, tests, interactive helpers.
SKIP_TOP = {
    "antigravity",
    "this",
    "__hello__",
    "__phello__",
    "__phello_alias__",
    "__main__",
    "tkinter",
    "turtle",
    "turtledemo",
    "idlelib",
    "test",
    "lib2to3",
    "ensurepip",
    "venv",
    "pydoc_data",
    "xxsubtype",
    "distutils",  # deprecated; setuptools may shadow it with its own copy
}


_STDLIB_DIRS = tuple(sorted({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}))
_SITE_DIRS = tuple(sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")}))


# Reprs of default values carry memory addresses ("<object object at 0x7f...>"): drop them, or the
# corpus (and the tokenizer) would differ from one run to the next.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _skip(name: str) -> bool:
    parts = name.split(".")
    if parts[0] in SKIP_TOP or parts[-1] == "__main__":
        return True
    return any(p in ("test", "tests", "idle_test") or p.startswith("_test") for p in parts)


def stdlib_module_names() -> list[str]:
    """Every importable stdlib module and submodule, sorted (import failures dropped)."""
    names: set[str] = set()
    for top in sorted(sys.stdlib_module_names):
        if _skip(top):
            continue
        mod = _try_import(top)
        if mod is None:
            continue
        names.add(top)
        path = getattr(mod, "__path__", None)
        if path is None:
            continue
        for info in pkgutil.walk_packages(path, prefix=top + ".", onerror=lambda _n: None):
            if not _skip(info.name) and _try_import(info.name) is not None:
                names.add(info.name)
    return sorted(names)


def _try_import(name: str):
    """Import quietly; None when the module fails (missing C extension, wrong platform, ...) or
    lives outside the standard library's directories (a site-packages shim)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            mod = importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - SystemExit/ImportError/OSError all mean "skip it"
            return None
    file = getattr(mod, "__file__", None)
    if file is not None and (not file.startswith(_STDLIB_DIRS) or file.startswith(_SITE_DIRS)):
        return None
    return mod


def _own_doc(obj: object) -> str | None:
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    doc = inspect.cleandoc(doc).strip()
    return doc if len(doc) >= 20 else None


def _signature(obj: object) -> str:
    """The call signature with only literal defaults spelled out; any other default is `...`.

    Default values' reprs can carry the running process's state (`cgi.parse(environ=os.environ)`
    would print every environment variable; objects print memory addresses), which must never
    reach the corpus: it would leak the build machine's environment into the model and make the
    corpus differ between runs.
    """
    try:
        sig = inspect.signature(obj)
    except Exception:  # noqa: BLE001 - C functions' text signatures can fail in many ways
        return ""
    params = []
    for p in sig.parameters.values():
        d = p.default
        if d is not inspect.Parameter.empty and not _is_literal(d):
            p = p.replace(default=_Ellipsis())
        params.append(p.replace(annotation=inspect.Parameter.empty))
    try:
        return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))
    except ValueError:
        return ""


class _Ellipsis:
    def __repr__(self) -> str:
        return "..."


def _is_literal(value: object) -> bool:
    if value is None or isinstance(value, bool | int | float):
        return True
    if isinstance(value, str | bytes):
        # Short, and no file paths: `platform.architecture(executable=sys.executable)`.
        sep = "/\\" if isinstance(value, str) else b"/\\"
        return len(value) <= 40 and (len(value) <= 1 or not any(c in value for c in sep))
    if isinstance(value, tuple | frozenset) and len(value) <= 4:
        return all(_is_literal(v) for v in value)
    return False


def module_documents(name: str) -> list[str]:
    """The module docstring, then its own classes (with their methods) and functions, by name."""
    mod = sys.modules[name]
    docs = []
    doc = _own_doc(mod)
    if doc:
        docs.append(f"Module {name}\n\n{doc}")
    for attr in sorted(vars(mod)):
        obj = vars(mod)[attr]
        if getattr(obj, "__module__", None) != name or attr.startswith("__"):
            continue
        if isinstance(obj, type):
            doc = _own_doc(obj)
            if doc:
                docs.append(f"class {name}.{attr}{_signature(obj)}\n\n{doc}")
            for meth in sorted(vars(obj)):
                m = vars(obj)[meth]
                if isinstance(m, (staticmethod, classmethod)):
                    m = m.__func__
                if meth.startswith("__") and meth != "__init__":
                    continue
                if not callable(m) and not isinstance(m, property):
                    continue
                doc = _own_doc(m)
                if doc:
                    sig = "" if isinstance(m, property) else _signature(m)
                    docs.append(f"{name}.{attr}.{meth}{sig}\n\n{doc}")
        elif callable(obj):
            doc = _own_doc(obj)
            if doc:
                docs.append(f"{name}.{attr}{_signature(obj)}\n\n{doc}")
    return docs


def _chunks(text: str, max_chars: int = 3000) -> list[str]:
    """Split a long help topic at paragraph breaks into pieces of about max_chars, so a single
    60k-character topic cannot dominate either side of the train/held-out split."""
    parts: list[str] = []
    cur = ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) > max_chars:
            parts.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        parts.append(cur)
    return parts


def build_documents() -> list[str]:
    """All documents in their fixed order, exact duplicates dropped."""
    docs: list[str] = []
    for name in stdlib_module_names():
        docs.extend(module_documents(name))
    import pydoc_data.topics

    for key in sorted(pydoc_data.topics.topics):
        for part in _chunks(pydoc_data.topics.topics[key].strip()):
            docs.append(f"Help topic {key}\n\n{part}")
    seen: set[str] = set()
    unique = []
    for d in (_ADDRESS.sub("", d) for d in docs):
        body = d.split("\n\n", 1)[-1]
        if body not in seen and EOT not in d:
            seen.add(body)
            unique.append(d)
    return unique


CHAT_EVERY = 3


def as_chat(doc: str) -> str:
    """Render a document as one chat exchange in the template's format, so the <|im_start|> and
    <|im_end|> tokens are trained and `chat` on the default model answers in kind."""
    header, body = doc.split("\n\n", 1)
    if header.startswith("Module "):
        question = f"What is the {header[len('Module ') :]} module for?"
    elif header.startswith("class "):
        question = f"Explain the class {header[len('class ') :]}."
    elif header.startswith("Help topic "):
        question = f"Show the Python help on {header[len('Help topic ') :]}."
    else:
        question = f"What does {header} do?"
    return f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n{body}{IM_END}\n"


def render(docs: list[str]) -> list[str]:
    """Every CHAT_EVERY-th document (index % 3 == 1, so both splits get some) becomes a chat."""
    return [as_chat(d) if i % CHAT_EVERY == 1 else d for i, d in enumerate(docs)]


def split(docs: list[str]) -> tuple[list[str], list[str]]:
    heldout = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    train = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    return train, heldout


def train_tokenizer(train_docs: list[str], model_dir: Path) -> None:
    """Byte-level BPE (GPT-2 style pre-tokenizer), saved so AutoTokenizer loads the directory."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer=trainer, length=len(train_docs))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (model_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def encode(docs: list[str], model_dir: Path) -> np.ndarray:
    """Token ids of EOT + doc for every doc, concatenated (uint16: the vocabulary is 8192)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.append(eot)
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.uint16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("build/tiny"))
    ap.add_argument("--model-dir", type=Path, default=Path("jdet/default_model"))
    args = ap.parse_args()
    docs = render(build_documents())
    train, heldout = split(docs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "corpus_train.txt").write_text(f"\n{EOT}\n".join(train))
    (args.out / "corpus_heldout.txt").write_text(f"\n{EOT}\n".join(heldout))
    train_tokenizer(train, args.model_dir)
    train_ids, heldout_ids = (
        encode(train, args.model_dir),
        encode(heldout, args.model_dir),
    )
    np.save(args.out / "train_ids.npy", train_ids)
    np.save(args.out / "heldout_ids.npy", heldout_ids)
    stats = {
        "python": sys.version.split()[0],
        "documents": len(docs),
        "train_documents": len(train),
        "heldout_documents": len(heldout),
        "train_chars": sum(map(len, train)),
        "heldout_chars": sum(map(len, heldout)),
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(heldout_ids.size),
    }
    (args.out / "corpus_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
