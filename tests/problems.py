"""Small seeded random problems for tests that do not use the committed fixtures."""

from __future__ import annotations

import numpy as np

SMALL = dict(
    emb_dim=64, q_lora_rank=32, index_n_heads=8, index_head_dim=32, rope_head_dim=16,
    compress_ratio=4, index_topk=4, num_query_heads=8, head_dim=32, sliding_window=8,
)


def random_problem(cfg: dict, batch: int, seq: int, seed: int = 0, docs: list[list[int]] | None = None):
    """(params, inputs) as float32/int32 numpy, seeded, with every input of SPEC section 4
    (the joint teacher's too). `docs[b]` lists document lengths of row b."""
    rng = np.random.default_rng(seed)
    e, r, hi, di = cfg["emb_dim"], cfg["q_lora_rank"], cfg["index_n_heads"], cfg["index_head_dim"]
    m, h, d = cfg["compress_ratio"], cfg["num_query_heads"], cfg["head_dim"]

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    params = {
        "indexer.wkv": normal(e, 2 * di, scale=e**-0.5),
        "indexer.wgate": normal(e, 2 * di, scale=e**-0.5),
        "indexer.ape": normal(m, 2 * di, scale=0.5),
        "indexer.kv_norm": (1.0 + normal(di, scale=0.1)).astype(np.float32),
        "indexer.wq_b": normal(r, hi * di, scale=r**-0.5),
        "indexer.weights_proj": normal(e, hi, scale=e**-0.5),
    }
    if docs is None:
        docs = [[seq]] * batch
    pos = np.zeros((batch, seq), np.int32)
    seg = np.zeros((batch, seq), np.int32)
    for b, lengths in enumerate(docs):
        assert sum(lengths) == seq
        start = 0
        for k, n in enumerate(lengths):
            pos[b, start:start + n] = np.arange(n)
            seg[b, start:start + n] = k + 1
            start += n
    inputs = {
        "hidden_states": normal(batch, seq, e),
        "q_latent": normal(batch, seq, r),
        "position_ids": pos,
        "segment_ids": seg,
        "teacher_query": normal(batch, seq, h, d, scale=d**-0.5 * 3.0),
        "teacher_kv": normal(batch, seq // m, d),
    }
    # Drawn last, so the draws above are the same with or without them: the joint teacher's
    # window keys (every token, shared by the heads) and per-head sink logits.
    inputs["teacher_window_kv"] = normal(batch, seq, d)
    inputs["attention_sink"] = normal(h)
    return params, inputs
