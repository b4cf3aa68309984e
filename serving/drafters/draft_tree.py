"""Token trees a learned drafter proposes, and how a tree's verify outcome reads as acceptance trials.

A learned drafter runs its chain greedily (each position continues from the previous position's
most likely token) and reads its distribution at every position anyway, so the runner-up tokens
of each position are free candidates: ``best_first_tree`` hangs the ``m`` most likely tokens of
each drafted position under the chain's previous node (Medusa / EAGLE-2 style siblings along the
greedy path) and orders the nodes best-first by path probability, so that any prefix of them is a
subtree and the engine's width step can cut the tree to the nodes that pay.

Measured on held-out greedy answers of SmolLM2-135M (the pre-trained selfspec drafter, teacher
forced): its most likely token is the target's 0.20-0.28 of the time, one of its top 3 0.34-0.46.
"""

from __future__ import annotations


def best_first_tree(level_q: list, level_ids: list) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
    """``level_q``, ``level_ids``: [B][d][m] nested lists, the top-m probabilities and token ids of
    each of the d drafted positions, most likely first; position j > 0 was drafted after position
    j - 1's most likely token. Returns (tokens, confidence, parents), each [B][d * m], in
    best-first order: node (j, s) is token ``level_ids[b][j][s]``, its parent is node (j - 1, 0)
    (-1, the row's last committed token, for j = 0), its confidence ``level_q[b][j][s]`` (the
    drafter's probability given its parent), and nodes are sorted by path probability, parents
    first on ties. Plain Python: a few dozen values, where numpy's calls cost ~30 us each hot and
    several times that right after a target forward."""
    tokens, confidence, parents = [], [], []
    for q_row, id_row in zip(level_q, level_ids):
        m = len(q_row[0]) if q_row else 0
        nodes = []  # (-path probability, flat index j * m + s, j, s)
        prefix = 1.0
        for j, q_level in enumerate(q_row):
            for s, q in enumerate(q_level):
                nodes.append((-prefix * min(max(q, 0.0), 1.0), j * m + s, j, s))
            prefix *= min(max(q_level[0], 0.0), 1.0)
        nodes.sort()
        position = {flat: i for i, (_, flat, _, _) in enumerate(nodes)}
        tokens.append([int(id_row[j][s]) for _, _, j, s in nodes])
        confidence.append([float(q_row[j][s]) for _, _, j, s in nodes])
        parents.append([position[(j - 1) * m] if j else -1 for _, _, j, _ in nodes])
    return tokens, confidence, parents


def tree_trial(tokens: list[int], parents: list[int] | None, accepted_ids: list[int]) -> tuple[int, int]:
    """(tried, accepted) of one verify step as acceptance trials: the drafted tokens the target
    accepted (``accepted_ids`` holds them and then the bonus token), and the levels it was asked
    about (one more where the last accepted node had drafted children, all of them refused).
    ``parents`` None: a chain, whose every drafted token was a trial until the first refusal."""
    accepted_drafts = accepted_ids[:-1]
    if parents is None:
        accepted = min(len(accepted_drafts), len(tokens))
        return min(accepted + 1, len(tokens)), accepted
    node, accepted = -1, 0
    for token in accepted_drafts:
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token), None)
        if child is None:
            break
        node, accepted = child, accepted + 1
    has_child = any(p == node for p in parents)
    return accepted + int(has_child), accepted
