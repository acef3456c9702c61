"""The reference driven over row blocks (torch_ref.row_blocks) against the plain unblocked
reference: the same numbers up to summation order in float64, on cases that plant packing,
ragged S, windows, YaRN, no blocks and no valid block, with block sizes that do not divide S."""

import numpy as np
import pytest
from needs import skip_module_without_torch

skip_module_without_torch()

from harness.problems.cases import CASES, LONG_CASES, make_inputs  # noqa: E402
from torch_ref import reference as ref  # noqa: E402
from torch_ref import row_blocks  # noqa: E402
from torch_ref.config import CSAConfig  # noqa: E402

# Float64 against float64: measured at most 1.6e-15 (relative to each quantity's largest |value|)
# over these cases and modes; 1e-12 leaves room for another BLAS's summation order.
CLOSE64 = 1e-12


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-300))


@pytest.mark.parametrize("name,block_rows", [("tiny", 1), ("packed", 5), ("ragged", 5), ("window_wide", 7),
                                             ("yarn_tail", 5), ("all_invalid", 3), ("no_blocks", 5)])
def test_row_blocks_match_the_unblocked_reference(name, block_rows):
    case = CASES[name]
    inputs, params = make_inputs(case)
    cfg = CSAConfig.from_dict(case.config_dict())
    full = ref.indexer_forward(params, inputs, cfg, "float64")
    blocks = list(row_blocks.forward_blocks(params, inputs, cfg, "float64", block_rows))
    assert [b[0].start for b in blocks] == list(range(0, case.seq_len, block_rows))
    scores = np.concatenate([s.numpy() for _, s, _ in blocks], axis=1)
    picks = np.concatenate([t.numpy() for _, _, t in blocks], axis=1)
    f = full["index_scores"].numpy()
    assert np.array_equal(np.isfinite(scores), np.isfinite(f))
    assert _rel(np.where(np.isfinite(f), scores, 0), np.where(np.isfinite(f), f, 0)) <= CLOSE64
    assert _rel(row_blocks.keys(params, inputs, cfg, "float64"), full["compressed_keys"]) <= CLOSE64
    # the same picked scores (ReLU-zero rows tie exactly: which zero is picked is arbitrary)
    ft = full["topk_indices"].numpy()
    picked = lambda t: np.sort(np.where(t >= 0, np.take_along_axis(f, np.maximum(t, 0), -1), -7.0), -1)  # noqa: E731
    assert picks.shape == ft.shape and np.array_equal(picked(picks), picked(ft))
    for sparse, selection in ((False, None), (True, ft)):
        c = CSAConfig.from_dict({**case.config_dict(), "sparse_loss": sparse})
        loss, grads, _ = ref.indexer_loss_and_grads(params, inputs, c, "float64", selection=selection)
        loss_b, grads_b = row_blocks.loss_and_grads(params, inputs, c, "float64", selection, block_rows)
        assert _rel(loss_b, loss) <= CLOSE64
        for n in grads:
            assert _rel(grads_b[n], grads[n]) <= CLOSE64, n


def test_row_blocks_refuse_a_quantized_problem():
    case = CASES["quant_v32"]
    inputs, params = make_inputs(case)
    with pytest.raises(ValueError, match="index_quant"):
        next(row_blocks.forward_blocks(params, inputs, CSAConfig.from_dict(case.config_dict()), "float64"))


def test_long_cases_plant_what_they_say():
    """The long cases' hazards, as numbers (SPEC section 11)."""
    from harness.problems.cases import layout
    from harness.problems.matrix import LONG_QUERY_BLOCKS

    deep, ties = LONG_CASES["long_deep_documents"], LONG_CASES["long_ties_k2048"]
    for case in (deep, ties):
        assert case.seq_len >= 131072 and case.config["compress_ratio"] == 4
        assert case.batch * case.seq_len * case.num_blocks > 2 ** 31
        assert case.config["index_n_heads"] >= 2 and case.config["num_query_heads"] >= 2
    assert deep.config["index_topk"] == 512 and ties.config["index_topk"] == 2048
    r = LONG_QUERY_BLOCKS["long_deep_documents"]
    starts = np.cumsum((0,) + deep.documents[0][:-1])
    assert deep.seq_len % r and 100003 in starts and starts[-1] >= deep.seq_len - deep.seq_len % r
    assert deep.documents[0][-1] // 4 < deep.config["index_topk"]
    pos, _ = layout(deep)
    assert pos.min() > 2 ** 16 > deep.config["rope_scaling"]["original_max_position"] - 1
    labels = ties.tied_blocks[0]
    last = labels[-ties.documents[0][-1] // 4:]
    assert len(last) > ties.config["index_topk"] and len(set(last)) < len(last) // 4
