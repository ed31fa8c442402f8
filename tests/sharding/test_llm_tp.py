"""The public API with tensor parallelism: `jdet.LLM(model, tp=N)` gives the same bits for
N = 1, 2, 4 on the shared tiny Qwen3 checkpoint (head_dim 32: column shards narrower than one
128-wide tile, so this also pins the kernel's fixed MMA shape)."""

import numpy as np

import jdet


def test_llm_score_and_greedy_tokens_do_not_depend_on_tp(hf_checkpoints):
    model = jdet.load(hf_checkpoints["qwen3"], dtype="float32")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (30, 9)]
    sp = jdet.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    ref_scores = ref_tokens = None
    for tp in (1, 2, 4):
        # budget 8: one step and one score shape per TP size on a CPU (each a compile of
        # 10-30 s there); the 30-token sequence is prefilled in chunks, whose bits are the same
        llm = jdet.LLM(model, tp=tp, invariance="tp", max_num_batched_tokens=8)
        scores = llm.score(seqs)
        tokens = [o.token_ids for o in llm.generate(seqs, sp)]
        if ref_scores is None:
            ref_scores, ref_tokens = scores, tokens
            continue
        assert all(np.array_equal(a, b) for a, b in zip(ref_scores, scores, strict=True)), tp
        assert tokens == ref_tokens, tp
