"""Save -> load keeps behaviour: the same bits, the same EOS ids (generation_config.json), the
same chat template and the same `system_fingerprint`; relative paths work; and the same requests
give the same bits in two fresh processes.

The fixture is a tiny Qwen3 with a BPE tokenizer, a chat template and a generation_config.json
whose extra EOS id is a token the model actually emits, so losing it changes the output (the
negative control deletes it and sees the difference).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jdet

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(
    invariance="tp", max_num_seqs=8, max_model_len=128, page_size=8, num_pages=64,
    max_num_batched_tokens=32,
)  # fmt: skip
MESSAGES = [{"role": "user", "content": "hello there, tell me about the quick brown fox"}]


def chat_prompt(model) -> list[int]:
    text = model.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return list(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def requests(model) -> tuple[list[list[int]], list]:
    ids = chat_prompt(model)
    sps = [jdet.SamplingParams(temperature=0.0, max_tokens=24)]
    sps += [jdet.SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=24) for s in (1, 2)]
    return [ids] * len(sps), sps


def run(model) -> tuple[str, list]:
    llm = jdet.LLM(model, **ENGINE)
    prompts, sps = requests(model)
    outs = llm.generate(prompts, sps)
    got = [(o.token_ids, np.asarray(o.logprobs, np.float32).tobytes().hex(), o.finish_reason)
           for o in outs]  # fmt: skip
    return llm.fingerprint(), got


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    """generation_config.json adds, as EOS, the 4th token greedy decoding emits (first seen)."""
    from tests.serving.conftest import write_tiny_model

    d = write_tiny_model(tmp_path_factory.mktemp("rt") / "hf")
    m = jdet.load(d, dtype="float32")
    prompts, _ = requests(m)
    free = jdet.LLM(m, **ENGINE).generate(
        prompts[:1], jdet.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )[0]
    toks = free.token_ids
    eos = next(t for t in toks[3:] if t not in m.cfg.eos_token_ids and t not in toks[:3])
    gen = {"bos_token_id": 0, "eos_token_id": [0, eos], "do_sample": False}
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def test_save_load_keeps_bits_eos_chat_template_and_fingerprint(chat_model_dir, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    a = jdet.load(chat_model_dir, dtype="float32")
    fp_a, out_a = run(a)
    assert out_a[0][2] == "stop" and out_a[0][0][-1] == a.cfg.eos_token_ids[-1]  # EOS matters
    monkeypatch.chdir(tmp_path)
    jdet.save(a, "ckpt/")  # relative paths, as in the README
    b = jdet.load("ckpt/", dtype="float32")
    assert b.cfg == a.cfg and b.cfg.eos_token_ids == a.cfg.eos_token_ids
    assert b.tokenizer.chat_template == a.tokenizer.chat_template
    assert chat_prompt(b) == chat_prompt(a)
    fp_b, out_b = run(b)
    assert fp_b == fp_a
    assert out_b == out_a  # token ids, the f32 log-prob bytes and finish reasons
    jdet.save(b, Path("again"))  # a second hop from the jdet format itself
    c = jdet.load("again", dtype="float32")
    assert run(c) == (fp_a, out_a)


def test_negative_control_a_copy_without_the_generation_config_differs(chat_model_dir, tmp_path):
    """What jdet.save used to do (drop generation_config.json): the EOS id is lost, the greedy
    answer runs past it and the fingerprint changes: the test above can fail."""
    a = jdet.load(chat_model_dir, dtype="float32")
    fp_a, out_a = run(a)
    jdet.save(a, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "generation_config.json").unlink()
    b = jdet.load(tmp_path / "ckpt", dtype="float32")
    assert b.cfg.eos_token_ids != a.cfg.eos_token_ids
    fp_b, out_b = run(b)
    assert fp_b != fp_a
    assert len(out_b[0][0]) > len(out_a[0][0]) and out_b[0][0][: len(out_a[0][0])] == out_a[0][0]


_CHILD = """
import json, sys
import numpy as np
import jdet
from tests.jdet.test_checkpoint_roundtrip import run
fp, out = run(jdet.load(sys.argv[1], dtype="float32"))
print("RESULT " + json.dumps({"fp": fp, "out": out}))
"""


def test_the_same_requests_give_the_same_bits_in_two_fresh_processes(chat_model_dir, tmp_path):
    ckpt = jdet.save(jdet.load(chat_model_dir, dtype="float32"), tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    results = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    assert results[0] == results[1]
    fp, out = run(jdet.load(ckpt, dtype="float32"))  # and this process agrees with both
    assert results[0] == {"fp": fp, "out": json.loads(json.dumps(out))}
