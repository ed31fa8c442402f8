"""A tokenizer that answers the hot calls with the `tokenizers` library and loads transformers' only
when something else is asked of it.

Importing transformers on a small CPU takes longer than the rest of `jdet generate`'s run. What
the engine and `LLM.generate` need (encode a text, decode ids, the special token ids, the vocab
size) is the Rust `tokenizers.Tokenizer` that transformers wraps, loaded from the same
tokenizer.json with the same changes transformers' generic `TokenizersBackend` makes at load
(the post-processor it rebuilds when tokenizer_config.json sets add_bos_token/add_eos_token).

`FastTokenizer` is used only for directories whose tokenizer transformers loads as that generic
class (tokenizer_class PreTrainedTokenizerFast or TokenizersBackend) and whose files hold nothing
it would change at load beyond that (truncation, padding, special tokens missing from
tokenizer.json, added_tokens.json, split_special_tokens, model_input_names, a Mistral regex
patch, ...); any other directory gets `AutoTokenizer` as before (`load_tokenizer`).

Everything else (apply_chat_template, save_pretrained, batch or tensor calls, keyword arguments
beyond add_special_tokens / skip_special_tokens, setting attributes) goes to the full transformers
tokenizer, loaded on first use (`.hf`); from then on every call goes to it, so a tokenizer a user
changed (added tokens, a new chat template) is the one that answers. Call sites that need a real
`PreTrainedTokenizerFast` (llguidance) take `.hf`. tests/jdet/test_tokenizer.py checks that the
Rust backends serialise identically and that encode/decode agree on a few hundred strings.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, processors

GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MISTRAL_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")
# tokenizer_config.json keys that only describe files, names or things this class reproduces.
KNOWN_KEYS = {
    "tokenizer_class", "backend", *NAMED, "add_bos_token", "add_eos_token", "added_tokens_decoder",
    "additional_special_tokens", "extra_special_tokens", "clean_up_tokenization_spaces",
    "model_max_length", "chat_template", "padding_side", "truncation_side", "name_or_path",
    "errors", "add_prefix_space", "legacy", "use_default_system_prompt", "processor_class",
    "tokenizer_file",
}  # fmt: skip


def _content(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("content")
    return str(v)


class Encoded(dict):
    """`tokenizer(text)`'s result: input_ids and attention_mask as transformers returns them, by key
    or attribute; anything else of a BatchEncoding (tokens(), encodings, ...) from the full one."""

    def __init__(self, data: dict, tok: FastTokenizer, text: str, add_special_tokens: bool) -> None:
        super().__init__(data)
        self._args = (tok, text, add_special_tokens)

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        if name.startswith("__") or name == "_args":
            raise AttributeError(name)
        tok, text, add = self._args
        return getattr(tok.hf(text, add_special_tokens=add), name)


class FastTokenizer:
    """transformers' tokenizer of `path` without importing transformers for encode/decode."""

    _OWN = ("_path", "_tok", "_hf", "_lock", "_special", "_input_names")

    def __init__(self, path: Path, backend: Any, special: dict, input_names: tuple) -> None:
        object.__setattr__(self, "_path", Path(path))
        object.__setattr__(self, "_tok", backend)
        object.__setattr__(self, "_hf", None)
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_special", special)
        object.__setattr__(self, "_input_names", input_names)

    # ---------------------------------------------------------------- the full tokenizer
    @property
    def hf(self) -> Any:
        """The transformers tokenizer of the same directory (loaded on first use)."""
        if self._hf is None:
            with self._lock:
                if self._hf is None:
                    from transformers import AutoTokenizer  # seconds to import: on demand

                    object.__setattr__(self, "_hf", AutoTokenizer.from_pretrained(str(self._path)))
        return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in FastTokenizer._OWN:
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.hf, name, value)

    def __bool__(self) -> bool:
        return True

    def __getstate__(self) -> dict:  # copy.deepcopy, pickle: everything but the lock
        return {k: self.__dict__[k] for k in FastTokenizer._OWN if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def __repr__(self) -> str:
        state = "loaded" if self._hf is not None else "not loaded"
        return f"FastTokenizer({str(self._path)!r}, transformers tokenizer {state})"

    # ---------------------------------------------------------------- the hot calls
    def __call__(self, text: Any = None, *args: Any, add_special_tokens: bool = True, **kw: Any):
        if self._hf is not None or args or kw or type(text) is not str:
            return self.hf(text, *args, add_special_tokens=add_special_tokens, **kw)
        e = self._tok.encode(text, add_special_tokens=bool(add_special_tokens))
        data = {"input_ids": e.ids}
        for name in self._input_names:
            if name == "token_type_ids":
                data[name] = e.type_ids
            elif name == "attention_mask":
                data[name] = e.attention_mask
        return Encoded(data, self, text, add_special_tokens)

    def encode(self, text: Any, *args: Any, add_special_tokens: bool = True, **kw: Any) -> Any:
        if self._hf is not None or args or kw or type(text) is not str:
            return self.hf.encode(text, *args, add_special_tokens=add_special_tokens, **kw)
        return self._tok.encode(text, add_special_tokens=bool(add_special_tokens)).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kw: Any) -> Any:
        ids = _int_list(token_ids)
        if self._hf is not None or kw or ids is None:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kw)
        return self._tok.decode(ids, skip_special_tokens=bool(skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        if type(ids) is int and self._hf is None:
            return self._tok.id_to_token(ids)
        if self._hf is not None or skip_special_tokens or _int_list(ids) is None:
            return self.hf.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)
        return [self._tok.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if self._hf is None and self._special.get("unk_token") is None:
            if type(tokens) is str:
                return self._tok.token_to_id(tokens)
            if isinstance(tokens, list) and all(type(t) is str for t in tokens):
                return [self._tok.token_to_id(t) for t in tokens]
        return self.hf.convert_tokens_to_ids(tokens)

    @property
    def vocab_size(self) -> int:
        if self._hf is not None:
            return self._hf.vocab_size
        return self._tok.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        if self._hf is not None:
            return len(self._hf)
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _named(self, key: str) -> Any:
        if self._hf is not None:
            return getattr(self._hf, key)
        if key.endswith("_id"):
            content = self._special.get(key[:-3])
            return None if content is None else self._tok.token_to_id(content)
        return self._special.get(key)

    bos_token = property(lambda s: s._named("bos_token"))
    eos_token = property(lambda s: s._named("eos_token"))
    unk_token = property(lambda s: s._named("unk_token"))
    pad_token = property(lambda s: s._named("pad_token"))
    bos_token_id = property(lambda s: s._named("bos_token_id"))
    eos_token_id = property(lambda s: s._named("eos_token_id"))
    unk_token_id = property(lambda s: s._named("unk_token_id"))
    pad_token_id = property(lambda s: s._named("pad_token_id"))


def _int_list(ids: Any) -> list[int] | None:
    """`ids` as transformers' decode would pass them to the backend, or None (let it do so)."""
    if type(ids) is int:
        return [ids]
    if isinstance(ids, (list, tuple)) and all(type(i) is int for i in ids):
        return list(ids)
    return None


def _read(p: Path) -> Any:
    return json.loads(p.read_text(encoding="utf-8")) if p.exists() else None


def fast_tokenizer(d: Path) -> FastTokenizer | None:
    """A FastTokenizer for directory `d` where it is sure to match transformers', else None."""
    d = Path(d)
    tj, cfg = _read(d / "tokenizer.json"), _read(d / "tokenizer_config.json")
    if not isinstance(tj, dict) or not isinstance(cfg, dict):
        return None
    if cfg.get("tokenizer_class") not in GENERIC_CLASSES or set(cfg) - KNOWN_KEYS:
        return None
    if (d / "added_tokens.json").exists() or cfg.get("add_prefix_space") is not None:
        return None
    if tj.get("truncation") is not None or tj.get("padding") is not None:
        return None
    special: dict[str, str | None] = {k: _content(cfg.get(k)) for k in NAMED}
    extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
    if not isinstance(extra, list):
        return None
    extra = [_content(t) for t in extra]
    stm = _read(d / "special_tokens_map.json")
    if stm is not None:  # transformers reads it only without added_tokens_decoder: must agree
        if not isinstance(stm, dict):
            return None
        for k, v in stm.items():
            if k in NAMED and _content(v) != special[k]:
                return None
            if k in ("additional_special_tokens", "extra_special_tokens"):
                if not isinstance(v, list) or [_content(t) for t in v] != extra:
                    return None
    added = {t["content"]: t for t in tj.get("added_tokens", [])}
    plain = {"special": True, "normalized": False, "lstrip": False, "rstrip": False,
             "single_word": False}  # fmt: skip
    for content in [*special.values(), *extra]:  # transformers re-adds them with these flags
        if content is not None and {k: added.get(content, {}).get(k) for k in plain} != plain:
            return None
    for idx, t in (cfg.get("added_tokens_decoder") or {}).items():
        mine = added.get(t.get("content")) if isinstance(t, dict) else None
        if mine is None or {k: v for k, v in mine.items()} != {"id": int(idx), **t}:
            return None
    model = tj.get("model") or {}
    if cfg.get("clean_up_tokenization_spaces") and model.get("type") != "BPE":
        return None  # BPE: transformers ignores the clean-up
    try:
        tok = Tokenizer.from_str(json.dumps(tj))
    except Exception:  # noqa: BLE001 - transformers will say what is wrong with the file
        return None
    if tok.get_vocab_size(with_added_tokens=True) > 100_000:
        hf_cfg = _read(d / "config.json") or {}
        if not isinstance(hf_cfg, dict) or hf_cfg.get("model_type") in MISTRAL_TYPES:
            return None
    if tok.post_processor is None:  # TokenizersBackend.update_post_processor (add_bos_token and
        # add_eos_token are dropped from the config when tokenizer.json exists: both False)
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = False
    return FastTokenizer(d, tok, special, ("input_ids", "attention_mask"))
