"""jdet.tokenizer.FastTokenizer answers exactly as transformers' tokenizer of the same directory.

The embedded model's tokenizer and the serving tests' tiny checkpoint (written by transformers'
save_pretrained) are compared with AutoTokenizer on a few hundred strings: encode with and
without special tokens, decode with and without skip_special_tokens (also of random id lists,
partial UTF-8 included), the special tokens and ids, the vocab sizes, convert_ids_to_tokens. The
control: a FastTokenizer whose backend is changed in one setting is caught by the same checks.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jdet.loader import DEFAULT_MODEL_DIR, load_tokenizer
from jdet.tokenizer import FastTokenizer, fast_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PIECES = [
    "Return a list of", " the", "hello", "world", "  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n ",
    "café", "naïve", "Ωμέγα", "日本語のテキスト", "中文", "한국어", "emoji 🎉👍🏽", "👨‍👩‍👧",
    "e\u0301", "\u200b", "\u00a0", "مرحبا", "שלום", "0123456789", "3.14159", "+-*/=<>",
    "{\"a\": [1, 2]}", "def f(x):\n    return x", "<|im_", "|>", "<|", "<|endoftext", "ÿ", "\x00",
    "\ufffd", "A" * 40, "'s", "n't", "?!", "...", "—", "ﬁ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]  # fmt: skip


def strings(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = ["", " ", "a", *SPECIALS, "".join(SPECIALS), " <|im_start|>user\nhi<|im_end|>\n"]
    while len(out) < n:
        parts = rng.choices(PIECES + SPECIALS, k=rng.randint(1, 8))
        out.append("".join(p if rng.random() < 0.7 else " " + p for p in parts))
    return out


def id_lists(vocab: int, n: int = 200, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    out = [[], [0], [1, 2], list(range(12))]
    while len(out) < n:
        out.append([rng.randrange(vocab) for _ in range(rng.randint(1, 12))])
    return out


def differences(fast, hf, texts: list[str]) -> list[str]:
    """Every call where `fast` and `hf` disagree (empty when they answer alike)."""
    bad = []
    for s in texts:
        for add in (True, False):
            if dict(fast(s, add_special_tokens=add)) != dict(hf(s, add_special_tokens=add)):
                bad.append(f"call {s!r} add_special_tokens={add}")
            if fast.encode(s, add_special_tokens=add) != hf.encode(s, add_special_tokens=add):
                bad.append(f"encode {s!r} add_special_tokens={add}")
        ids = hf(s)["input_ids"]
        for skip in (True, False):
            kw = {"skip_special_tokens": skip}
            if fast.decode(ids, **kw) != hf.decode(ids, **kw):
                bad.append(f"decode {ids} skip_special_tokens={skip}")
    for ids in id_lists(len(hf)):
        for skip in (True, False):
            kw = {"skip_special_tokens": skip}
            if fast.decode(ids, **kw) != hf.decode(ids, **kw):
                bad.append(f"decode {ids} skip_special_tokens={skip}")
        if fast.decode(ids[0] if ids else 0) != hf.decode(ids[0] if ids else 0):
            bad.append(f"decode int {ids[:1]}")
        if fast.convert_ids_to_tokens(ids) != hf.convert_ids_to_tokens(ids):
            bad.append(f"convert_ids_to_tokens {ids}")
    for name in ("bos", "eos", "pad", "unk"):
        for attr in (f"{name}_token", f"{name}_token_id"):
            if getattr(fast, attr) != getattr(hf, attr):
                bad.append(attr)
    if (fast.vocab_size, len(fast)) != (hf.vocab_size, len(hf)):
        bad.append("vocab sizes")
    if fast.convert_tokens_to_ids(SPECIALS) != hf.convert_tokens_to_ids(SPECIALS):
        bad.append("convert_tokens_to_ids")
    return bad


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from tests.serving.conftest import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tok") / "m")


@pytest.fixture(params=["embedded", "tiny"])
def pair(request, tiny_dir):
    from transformers import AutoTokenizer

    d = DEFAULT_MODEL_DIR if request.param == "embedded" else tiny_dir
    fast = load_tokenizer(d)
    assert isinstance(fast, FastTokenizer) and fast._hf is None
    return fast, AutoTokenizer.from_pretrained(str(d))


def test_backend_serialises_as_transformers_backend(pair):
    fast, hf = pair
    assert json.loads(fast._tok.to_str()) == json.loads(hf.backend_tokenizer.to_str())


def test_encode_decode_equal_transformers_on_varied_strings(pair):
    fast, hf = pair
    texts = strings()
    assert len(texts) >= 300
    assert differences(fast, hf, texts) == []
    assert fast._hf is None  # all of it answered without transformers' tokenizer


def test_control_a_changed_backend_is_caught(pair):
    from tokenizers import pre_tokenizers

    fast, hf = pair
    broken = fast_tokenizer(Path(fast._path))
    broken._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert differences(broken, hf, strings(40)) != []
    assert differences(fast, hf, strings(40)) == []


def test_everything_else_goes_to_the_transformers_tokenizer(pair):
    from transformers import PreTrainedTokenizerFast

    fast, hf = pair
    fast = copy.deepcopy(fast)  # the fixture's stays unloaded
    msgs = [{"role": "user", "content": "hi"}]
    assert fast.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )
    assert isinstance(fast.hf, PreTrainedTokenizerFast) and fast._hf is not None
    assert fast("a b").tokens() == hf("a b").tokens()  # BatchEncoding's own methods
    assert fast("a b").input_ids == hf("a b").input_ids
    # once loaded, every call goes to it: a change made through the wrapper is seen by encode
    fast.add_tokens(["zzqq"])
    assert fast.encode("zzqq") == [len(hf)] and fast.decode([len(hf)]) == "zzqq"
    fast.chat_template = None
    assert fast.chat_template is None and fast.hf.chat_template is None


def test_other_tokenizer_configs_get_transformers_own(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL_DIR, d, ignore=shutil.ignore_patterns("*.safetensors", "*.png"))
    assert isinstance(load_tokenizer(d), FastTokenizer)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "split_special_tokens": True}))
    tok = load_tokenizer(d)
    assert not isinstance(tok, FastTokenizer)
    assert tok.encode("<|im_start|>") != [1]  # split_special_tokens does change the ids


def test_jdet_generate_does_not_import_transformers():
    code = (
        "import sys\n"
        "from jdet.cli import main\n"
        "assert main(['generate', 'Return a list of', '--max-tokens', '4']) == 0\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "import jdet\n"
        "llm = jdet.LLM(warmup=False)\n"
        # seeded: an unseeded draw can give an output with empty text (EOS first, or bytes of an
        # unfinished character); a clean-clone CI run saw one in session 14
        "sp = jdet.SamplingParams(max_tokens=3, seed=0)\n"
        "out = llm.generate(['Return a list of', 'hello'], sp)\n"
        "assert all(o.outputs[0].text for o in out)\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("Return a list of")
