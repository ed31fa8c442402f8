"""`jdet.train.logprobs`: the sampler's bits going forward, the XLA forward's gradient going back.

The checkpoint has F = 192: 6 K tiles of the f32 tree kernel, reduced as 2 leaves of 3 tiles
unpadded but as 8 leaves after the engine pads F to 256 (jdet/plan.py). So a forward that
forgets the engine's padding reduces down_proj over another tree, and the negative control below
shows that this is visible in the bits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet
from jdet import train
from jdet.ops import Ops
from tests.conftest import write_hf_checkpoint

PROMPTS = [[5, 17, 33, 2, 9, 100, 7], [44, 1, 250], [8, 8, 120, 3, 77]]
# One token bucket (8, the CPU's smallest) for every engine here: each step shape is a compile of
# ~10-30 s on the CI's CPU, and bits do not depend on the budget (tests/jdet/test_invariance.py).
BUDGET = 8
# Every test of this module shares the fixtures below (minutes of compiles): one xdist worker.
pytestmark = pytest.mark.xdist_group("train")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("train") / "q3", "qwen3", seed=3,
                               intermediate_size=192)  # fmt: skip


@pytest.fixture(scope="module")
def model(model_dir):
    return jdet.load(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def sampled(model):
    """Per mode: (sequences = prompt + sampled completion, sampler log-probs, score() log-probs)."""
    out = {}
    sp = jdet.SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    for mode in ("tp", "batch"):
        llm = jdet.LLM(model, invariance=mode, max_num_batched_tokens=BUDGET)
        gens = llm.generate(PROMPTS, sp)
        seqs = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, gens, strict=True)]
        out[mode] = (seqs, [o.outputs[0].logprobs for o in gens], llm.score(seqs))
    return out


def _weights(tokens: np.ndarray) -> np.ndarray:
    """Fresh random per-target weights, so every gradient term is exercised."""
    return np.random.default_rng(1).standard_normal((tokens.shape[0], tokens.shape[1] - 1))


def _value_and_grad(model, seqs, mode: str, tp: int = 1):
    """(log-probs, gradient of sum(w * log-probs)) from one jitted value_and_grad: the forward
    as a training step runs it."""
    tokens, mask = train.right_pad(seqs)
    w = _weights(tokens)

    def loss(params):
        lp = train.logprobs(params, tokens, cfg=model.cfg, invariance=mode, mask=mask, tp=tp)
        return jnp.sum(lp * w), lp

    (_, lp), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(model.params)
    return np.asarray(lp), grad


@pytest.fixture(scope="module")
def tp_step(model, sampled):
    return _value_and_grad(model, sampled["tp"][0], "tp")


@pytest.mark.parametrize("mode", ["tp", "batch"])
def test_forward_bits_are_the_samplers_and_scores(model, sampled, tp_step, mode):
    seqs, sampler_lp, scores = sampled[mode]
    tokens, mask = train.right_pad(seqs)
    lp = np.asarray(train.logprobs(model.params, tokens, cfg=model.cfg, invariance=mode,
                                   mask=mask))  # fmt: skip
    for b, (p, s) in enumerate(zip(PROMPTS, seqs, strict=True)):
        assert np.array_equal(lp[b, : len(s) - 1], scores[b]), b
        assert np.array_equal(lp[b, len(p) - 1 : len(s) - 1], sampler_lp[b]), b
        assert not lp[b, len(s) - 1 :].any()  # masked targets are 0
    if mode == "tp":  # the same bits inside a jitted value_and_grad (a training step)
        assert np.array_equal(tp_step[0], lp)


def test_other_plans_give_other_bits(model, sampled):
    """Negative control: the comparison above can fail. The "tp" kernels on the *unpadded*
    weights (issue 14's trap: another down_proj tree) and the plain XLA forward both miss the
    sampler's bits on this checkpoint."""
    seqs, _, scores = sampled["tp"]
    tokens, mask = train.right_pad(seqs)
    n = [len(s) - 1 for s in seqs]
    from jdet.step import make_score_fn

    batch, targets, pages = train._flat_batch(jnp.asarray(tokens), 16)
    kv = train._kv(model.cfg, model.cfg.num_kv_heads, pages, 16, jnp.float32)
    _, unpadded = make_score_fn(model.cfg, Ops("tp"))(model.params, kv, batch, targets)
    unpadded = np.asarray(unpadded)[: tokens.size - len(seqs)].reshape(len(seqs), -1)
    xla = np.asarray(train.logprobs(model.params, tokens, cfg=model.cfg, invariance="none"))
    for other in (unpadded, xla):
        rows = [other[b, : n[b]] for b in range(len(seqs))]
        assert not all(np.array_equal(r, s) for r, s in zip(rows, scores, strict=True))
        # ... while being the same function to float rounding
        for r, s in zip(rows, scores, strict=True):
            np.testing.assert_allclose(r, s, atol=1e-4)


def _xla_reference_grad(model, seqs, w):
    """jax.grad of the "none" forward through jdet.model.forward, with another batch layout than
    train.py's (page size 4, pages in reverse order, no padding), so the packing, positions and
    masking are checked too."""
    from jdet.batch import build_batch
    from jdet.kv_cache import init_kv_cache
    from jdet.model import forward
    from jdet.sampling import token_logprobs

    cfg, ops = model.cfg, Ops("none")
    items, first = [], 0
    for s in seqs:
        k = -(-(len(s) - 1) // 4)
        items.append((s[:-1], 0, list(range(first + k - 1, first - 1, -1))))
        first += k
    batch = jax.tree.map(jnp.asarray, build_batch(items, 4, logits="all")[0])
    targets = jnp.asarray(np.concatenate([s[1:] for s in seqs]), jnp.int32)
    weights = jnp.asarray(np.concatenate([w[b, : len(s) - 1] for b, s in enumerate(seqs)]))

    def loss(params):
        kv = init_kv_cache(cfg, first, 4, jnp.float32)
        _, logits = forward(params, cfg, kv, batch, ops)
        return jnp.sum(token_logprobs(logits, targets, ops) * weights)

    return jax.jit(jax.grad(loss))(model.params)


def _close(got, ref, err_msg: str = "") -> None:
    """float32 gradients of one function computed in two orders: equal to rounding."""
    ref = np.asarray(ref)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(),
                               err_msg=err_msg)  # fmt: skip


def test_gradient_is_the_xla_forwards_and_transformers(model, model_dir, sampled, tp_step):
    import torch
    from transformers import AutoModelForCausalLM

    seqs = sampled["tp"][0]
    w = _weights(train.right_pad(seqs)[0])
    got = tp_step[1]
    ref = _xla_reference_grad(model, seqs, w)
    for path, g in jax.tree_util.tree_flatten_with_path(got)[0]:
        _close(g, _at(ref, path), jax.tree_util.keystr(path))

    # transformers (PyTorch autograd) on the same checkpoint, float32
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total = 0.0
    for b, s in enumerate(seqs):
        logits = hf(torch.tensor([s])).logits[0, :-1]
        lp = torch.log_softmax(logits, -1)[torch.arange(len(s) - 1), torch.tensor(s[1:])]
        total = total + (lp * torch.tensor(w[b, : len(s) - 1], dtype=torch.float32)).sum()
    total.backward()
    pairs = {
        ("embed",): hf.model.embed_tokens.weight.grad,  # tied: lm_head's gradient included
        ("final_norm",): hf.model.norm.weight.grad,
        ("layers", "wq", 0): hf.model.layers[0].self_attn.q_proj.weight.grad.T,
        ("layers", "k_norm", 1): hf.model.layers[1].self_attn.k_norm.weight.grad,
        ("layers", "w_down", 1): hf.model.layers[1].mlp.down_proj.weight.grad.T,
    }
    for key, t in pairs.items():
        g = got
        for k in key:
            g = g[k]
        r = t.detach().numpy()
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-3, atol=1e-4 * np.abs(r).max(),
                                   err_msg=str(key))  # fmt: skip


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_tensor_parallel_forward(model, sampled, tp_step):
    """TP > 1 under shard_map: "tp" at tp = 2 and 4 gives the tp = 1 bits (at 2 inside a jitted
    value_and_grad, whose gradient does not depend on tp), "batch" at tp = 2 the bits of the TP
    engine in "batch" mode."""
    seqs = sampled["tp"][0]
    tokens, mask = train.right_pad(seqs)
    lp2, g2 = _value_and_grad(model, seqs, "tp", tp=2)
    assert np.array_equal(lp2, tp_step[0])
    jax.tree.map(_close, g2, tp_step[1])
    # 4 > the 2 kv heads: kv heads replicated, as the engine does
    lp4 = train.logprobs(model.params, tokens, cfg=model.cfg, mask=mask, invariance="tp", tp=4)
    assert np.array_equal(np.asarray(lp4), tp_step[0])

    scores = jdet.LLM(model, tp=2, invariance="batch", max_num_batched_tokens=BUDGET).score(seqs)
    lp = np.asarray(train.logprobs(model.params, tokens, cfg=model.cfg, mask=mask,
                                   invariance="batch", tp=2))  # fmt: skip
    for b, s in enumerate(seqs):
        assert np.array_equal(lp[b, : len(s) - 1], scores[b]), b


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(invariance="fast"), "invariance"),
        (dict(tp=3), "tp=3"),
        (dict(invariance="none", tp=2), "tp=1"),
        (dict(tokens=np.array([1, 2, 3])), r"\[B, T\]"),
        (dict(tokens=np.array([[1, 2, 99999]])), "outside the vocabulary"),
        (dict(tokens=np.array([[1.0, 2.0]])), "integer"),
        (dict(mask=np.array([[0, 1, 1]])), "right padding"),
        (dict(mask=np.array([[1, 1]])), "shape of tokens"),
    ],
)
def test_bad_arguments_are_refused_by_name(model, kwargs, match):
    args = dict(tokens=np.array([[1, 2, 3]]), cfg=model.cfg)
    args.update(kwargs)
    tokens = args.pop("tokens")
    with pytest.raises(ValueError, match=match):
        train.logprobs(model.params, tokens, **args)


def test_exported_as_jdet_train():
    assert jdet.train.logprobs is train.logprobs


def test_chunked_ragged_dot_is_ragged_dots_values_and_gradient():
    """The gradient's experts in chunks of rows (jdet/train.py `RAGGED_ROWS`): the chunks' group
    sizes cut every group where the chunk boundaries fall, so values and gradients are the
    whole ragged_dot's (f32, a chunk of 24 slots over 3-row tiles of 5 groups)."""
    from jdet.train import ragged_dot_chunked
    from pallas_kernels import grouped_layout as gl
    from pallas_kernels import grouped_matmul as gm

    rng = np.random.default_rng(0)
    g, k, n, per_src = 5, 16, 12, 2
    x = jnp.asarray(rng.standard_normal((19, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, g, k, n)), jnp.float32)
    ids = rng.integers(0, g + 1, 19 * per_src)  # id g: a row left out
    tiles = gl.group_tiles(jnp.asarray(ids, jnp.int32), g, 8)
    layer = jnp.int32(1)

    def whole(x, w):
        return gm.grouped_matmul_xla(x, w, tiles, jnp.float32, per_src=per_src, layer=layer)

    def chunked(x, w):
        return ragged_dot_chunked(x, w, tiles, jnp.float32, per_src, layer, chunk=24)

    assert tiles.num_slots > 24 * 2
    np.testing.assert_allclose(chunked(x, w), whole(x, w), rtol=1e-5, atol=1e-5)
    assert not np.asarray(chunked(x, w))[ids == g].any()
    ct = jnp.asarray(rng.standard_normal((19 * per_src, n)), jnp.float32)
    gw = jax.grad(lambda x, w: jnp.sum(whole(x, w) * ct), argnums=(0, 1))(x, w)
    gc = jax.grad(lambda x, w: jnp.sum(chunked(x, w) * ct), argnums=(0, 1))(x, w)
    for a, b in zip(gc, gw, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
