"""tools/predict_experts.py's scores, on hand-made decode steps and predictors."""
import numpy as np

import predict_experts  # tools/predict_experts.py (conftest puts tools/ on the path)


def _step(layers: dict[int, tuple[int, list[int], float]]) -> dict:
    """{layer: (token id, routed experts, residual value)} -> a recorded step: residuals [1, 2] filled
    with the value, so a predictor can read which one it was given."""
    return {l: (np.array([tok]), np.array([sel]), np.full((1, 2), x)) for l, (tok, sel, x) in layers.items()}


def test_scores_each_predictor_against_what_was_routed():
    """Two layers, one sequence of two decode steps. The first step has no previous token: only the
    second layer's predictor is scored there."""
    seqs = [[_step({0: (5, [1, 2], 10.0), 1: (5, [3, 4], 11.0)}),
             _step({0: (6, [2, 7], 20.0), 1: (6, [3, 9], 21.0)})]]

    def named(layer, x):
        v = float(x[0, 0])
        if layer == 1:  # from layer 0's residual: right on 3 both times, wrong on 8 the second time
            return {3, 4} if v == 10.0 else {3, 8}
        # layer 0: the last residual (11.0), the embedding (6.0), the embedding + the previous attention
        # output (6 + (10 - 5) = 11.0 as well, so it names what the last residual names)
        return {11.0: {7, 1}, 6.0: {2, 5}}[v]

    t = predict_experts.score(seqs, named, lambda ids: np.full((1, 2), float(ids[0])))
    one = t["layer 1: layer 0's residual"]
    assert (one.right, one.wrong, one.routed, one.tokens) == (3, 1, 4, 2)
    last = t["layer 0: last residual"]
    assert (last.right, last.wrong, last.routed, last.tokens) == (1, 1, 2, 1)  # 7 right, 1 wrong
    emb = t["layer 0: embedding"]
    assert (emb.right, emb.wrong) == (1, 1)  # 2 right, 5 wrong
    prev = t["layer 0: previous token"]
    assert (prev.right, prev.wrong) == (1, 1)  # {1, 2}: 2 right, 1 wrong
    # new experts: routed now and not by the previous token ({7}); picks the previous token made are dropped
    new_last = t["layer 0, new: last residual"]
    assert (new_last.right, new_last.wrong, new_last.routed) == (1, 0, 1)  # {7}
    new_emb = t["layer 0, new: embedding"]
    assert (new_emb.right, new_emb.wrong, new_emb.routed) == (0, 1, 1)  # {5}
    assert t["layer 0, new: embedding + last attention"].right == 1
    assert "layer 0, new: previous token" not in t
