"""Draft trees (inference/engine/tree/draft.py), tree verification (inference/engine/tree/verify.py) and the tree engine
(inference/engine/tree/rounds.py), for every drafter kind of the contract test.

Naive references: DDTree against brute-force enumeration of every prefix; EAGLE-3's branch expansion against its own
chain proposal and against each branch expanded alone; the sibling-by-sibling sampling rule against the target's
law by exact enumeration (analytic) and the sampler against that law (chi-square); the engine against plain greedy
output (exact) and the target's law at T = 1 (chi-square); a drafter committed after a non-top-1 branch against the
same drafter committed after the same tokens verified as a plain chain.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import joint_counts
from test_contract import FACTORIES, NUM_DRAFTS, SAMPLING, build, exact_joint, tiny_target

from drafters.base import DraftContext
from inference.engine.api import speculative_generate, tree_speculative_generate
from inference.engine.tree.draft import DraftTree, chain_tree, ddtree, dynamic_tree
from inference.engine.tree.rounds import grow_tree
from inference.engine.tree.target import tree_extend
from inference.engine.tree.verify import greedy_tree_verify, sample_tree_verify

KINDS = sorted(FACTORIES)
PARENTS = [-1, 0, 0, 1, 1, 2]  # root; two children; node 1 has two children, node 2 one
TOKENS = [0, 1, 2, 0, 2, 2]


def hand_tree(batch: int = 1) -> DraftTree:
    parents = torch.tensor(PARENTS)
    depth = torch.tensor([0, 1, 1, 2, 2, 2])
    return DraftTree(torch.tensor(TOKENS).repeat(batch, 1), parents.repeat(batch, 1), depth.repeat(batch, 1),
                     torch.ones(batch, len(PARENTS), dtype=torch.bool))


def children_of(tree: DraftTree, row: int = 0) -> dict[int, list[int]]:
    return {node: kids for node, kids in enumerate(tree.children(row))}


# ---- the tree ------------------------------------------------------------------------------------------------------
def test_ancestor_mask_sees_root_ancestors_and_self_only():
    mask = hand_tree().ancestor_mask()[0]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for node, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5]]):
        expected[node, ancestors] = True
    assert torch.equal(mask, expected)


def test_chain_tree_marks_drafts_past_num_valid_invalid():
    tree = chain_tree(torch.tensor([9, 8]), torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([3, 1]))
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] * 2 and tree.depth.tolist() == [[0, 1, 2, 3]] * 2
    assert tree.valid.tolist() == [[True] * 4, [True, True, False, False]]


@pytest.mark.parametrize("budget", [1, 2, 5, 9])
def test_ddtree_takes_the_most_probable_prefixes(budget):
    """Brute force: every prefix of length 1..L over V tokens scored by prod_d q_d; the tree must hold the budget - 1
    best (distinct scores, so the set is unique), be prefix-closed and list parents before children."""
    torch.manual_seed(0)
    depth_limit, vocab = 3, 4
    log_probs = torch.log_softmax(torch.randn(2, depth_limit, vocab) * 2, dim=-1)
    tree = ddtree(torch.tensor([7, 8]), log_probs, budget)
    assert tree.tokens.shape == (2, budget) and bool(tree.valid.all())
    for row in range(2):
        scores = {prefix: sum(float(log_probs[row, d, t]) for d, t in enumerate(prefix))
                  for length in range(1, depth_limit + 1) for prefix in itertools.product(range(vocab), repeat=length)}
        best = sorted(scores, key=scores.get, reverse=True)[: budget - 1]
        prefixes = []
        for node in range(1, budget):
            parent = int(tree.parents[row, node])
            assert parent < node
            prefixes.append((prefixes[parent - 1] if parent > 0 else ()) + (int(tree.tokens[row, node]),))
            assert int(tree.depth[row, node]) == len(prefixes[-1])
        assert set(prefixes) == set(best)


def test_budget_below_one_is_refused_naming_the_field():
    target = tiny_target()
    drafter = build("eagle3", target)
    for budget in (0, -3):
        with pytest.raises(ValueError, match="tree_budget"):
            tree_speculative_generate(target, drafter, [[5, 6, 7]], tree_budget=budget, max_new_tokens=4)


# ---- EAGLE-3 branch expansion (Drafter.expand_tree) -----------------------------------------------------------------
def begun(kind: str, target, prompts: torch.Tensor, mask: torch.Tensor, sampling: bool = False):
    drafter = build(kind, target, sampling=sampling)
    logits, served = target.prefill(prompts, mask, drafter.feature_request())
    next_tokens = logits[:, -1].argmax(-1)
    drafter.begin(DraftContext(prompts, mask.bool(), (mask.cumsum(-1) - 1).clamp(min=0), next_tokens=next_tokens,
                               **served.context()))
    return drafter, next_tokens


PROMPTS = torch.tensor([[0, 0, 5, 17, 33, 9, 120], [41, 7, 5, 17, 120, 41, 7]])
PROMPT_MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])


def test_eagle3_expansion_follows_its_chain_and_keeps_branches_apart():
    """Expanding the top-1 chain gives the chain proposal's distributions; a second branch expanded beside it gives
    what it gives when expanded alone (the ancestor mask keeps siblings apart), with left padding in row 0."""
    target = tiny_target()
    drafter, root = begun("eagle3", target, PROMPTS, PROMPT_MASK)
    chain = drafter.propose(3)
    no_parent = torch.full((2, 1), -1)
    first = drafter.expand_tree(root[:, None], no_parent)[:, 0]
    torch.testing.assert_close(first, chain.log_probs[:, 0])
    second_best = first.topk(2).indices[:, 1]
    both = drafter.expand_tree(torch.stack([chain.tokens[:, 0], second_best], 1), torch.zeros(2, 2, dtype=torch.long))
    torch.testing.assert_close(both[:, 0], chain.log_probs[:, 1])
    deeper = drafter.expand_tree(chain.tokens[:, 1:2], torch.ones(2, 1, dtype=torch.long))  # child of node 1
    torch.testing.assert_close(deeper[:, 0], chain.log_probs[:, 2])
    drafter.expand_tree(root[:, None], no_parent)  # a new round: the previous nodes are dropped
    alone = drafter.expand_tree(second_best[:, None], torch.zeros(2, 1, dtype=torch.long))
    torch.testing.assert_close(alone[:, 0], both[:, 1])


def test_dynamic_tree_of_width_one_is_the_chain_and_wider_trees_are_prefix_closed():
    target = tiny_target()
    drafter, root = begun("eagle3", target, PROMPTS, PROMPT_MASK)
    chain = drafter.propose(4)
    narrow = dynamic_tree(drafter, root, budget=5, top_k=1)
    assert torch.equal(narrow.tokens[:, 1:], chain.tokens) and narrow.parents[0].tolist() == [-1, 0, 1, 2, 3]
    wide = dynamic_tree(drafter, root, budget=9, top_k=3)
    assert wide.tokens.shape == (2, 9)
    for row in range(2):
        for node in range(1, 9):
            parent = int(wide.parents[row, node])
            assert 0 <= parent < node and int(wide.depth[row, node]) == int(wide.depth[row, parent]) + 1
        assert len(set(zip(wide.parents[row].tolist(), wide.tokens[row].tolist()))) == 9  # no repeated sibling
    assert int(wide.depth.max()) > 1 and len(children_of(wide)[0]) > 1  # both deeper and wider than one chain


# ---- verification (pure) --------------------------------------------------------------------------------------------
def one_hot_logits(argmax_per_node: list[int], vocab: int = 3) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor([argmax_per_node]), vocab).float()


@pytest.mark.parametrize("argmax,path,next_token", [
    ([2, 0, 1, 1, 1, 1], [0, 2], 1),      # root's argmax 2 -> node 2 (not the first child); node 2's argmax 1 is absent
    ([1, 2, 0, 0, 0, 0], [0, 1, 4], 0),   # a full depth-2 path, then the bonus after node 4
    ([0, 0, 0, 0, 0, 0], [0], 0),         # nothing matches: the correction at the root
])
def test_greedy_tree_verify_follows_the_target_argmax(argmax, path, next_token):
    got_path, num_accepted, next_tokens = greedy_tree_verify(hand_tree(), one_hot_logits(argmax))
    assert got_path[0, : len(path)].tolist() == path and int(num_accepted[0]) == len(path) - 1
    assert int(next_tokens[0]) == next_token


def target_law(vocab: int, seed: int) -> dict[tuple[int, ...], torch.Tensor]:
    """A target as conditional laws P(. | prefix) [V] for the prefixes of length <= 2 (seeded, uneven)."""
    generator = torch.Generator().manual_seed(seed)
    law = {}
    for length in range(3):
        for prefix in itertools.product(range(vocab), repeat=length):
            weights = torch.rand(vocab, generator=generator, dtype=torch.float64) ** 3 + 0.01
            law[prefix] = weights / weights.sum()
    return law


def node_prefixes(tree: DraftTree) -> list[tuple[int, ...]]:
    """The tokens after the root on the path to each node (the root's own prefix is empty)."""
    prefixes: list[tuple[int, ...]] = []
    for node in range(tree.num_nodes):
        parent = int(tree.parents[0, node])
        prefixes.append(() if parent < 0 else prefixes[parent] + (int(tree.tokens[0, node]),))
    return prefixes


def round_law(tree: DraftTree, probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Exact law of one round's emitted tokens (accepted path + correction/bonus) under the sibling rule, by
    enumerating every branch of the walk with its probability."""
    kids, law = tree.children(0), {}

    def walk(node: int, emitted: tuple[int, ...], mass: float) -> None:
        residual, reach = probs[0, node].clone(), 1.0
        for child in kids[node]:
            token = int(tree.tokens[0, child])
            accept = float(residual[token])
            walk(child, emitted + (token,), mass * reach * accept)
            reach *= 1.0 - accept
            residual[token] = 0.0
            residual = residual / residual.sum() if float(residual.sum()) > 0 else residual
        for token in range(probs.shape[-1]):
            law[emitted + (token,)] = law.get(emitted + (token,), 0.0) + mass * reach * float(residual[token])

    walk(0, (), 1.0)
    return law


def test_tree_sampling_law_is_the_targets_analytically_and_by_chi_square():
    """Target probabilities at each node are the target's conditional law given the node's path. The first three
    tokens emitted (one round, continued by the target itself when the round emits fewer) must follow the target's
    joint law exactly; 4000 sampled rounds must follow the enumerated round law."""
    vocab = 3
    law = target_law(vocab, seed=3)
    tree = hand_tree()
    probs = torch.stack([law[prefix] for prefix in node_prefixes(tree)])[None]  # [1, N, V]
    emitted = round_law(tree, probs)
    assert math.isclose(sum(emitted.values()), 1.0, rel_tol=1e-12)
    joint = torch.zeros([vocab] * 3, dtype=torch.float64)
    for tokens, mass in emitted.items():
        for tail in itertools.product(range(vocab), repeat=3 - len(tokens)):
            sequence, weight = tokens + tail, mass
            for index in range(len(tokens), 3):
                weight *= float(law[sequence[:index]][sequence[index]])
            joint[sequence] += weight
    exact = torch.zeros_like(joint)
    for sequence in itertools.product(range(vocab), repeat=3):
        exact[sequence] = law[()][sequence[0]] * law[sequence[:1]][sequence[1]] * law[sequence[:2]][sequence[2]]
    torch.testing.assert_close(joint, exact, rtol=1e-12, atol=1e-12)

    rows = 4000
    path, num_accepted, next_tokens = sample_tree_verify(hand_tree(rows), probs.expand(rows, -1, -1).float(),
                                                         torch.Generator().manual_seed(0))
    outcomes = sorted(emitted)
    counts = torch.zeros(len(outcomes), dtype=torch.float64)
    for row in range(rows):
        nodes = path[row, 1 : int(num_accepted[row]) + 1].tolist()
        counts[outcomes.index(tuple(TOKENS[n] for n in nodes) + (int(next_tokens[row]),))] += 1
    expected = torch.tensor([emitted[o] for o in outcomes], dtype=torch.float64) * rows
    assert_chi_square(counts, expected)


def assert_chi_square(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Pearson chi-square within about 4 sigma of its law; cells expecting < 5 are pooled."""
    keep = expected >= 5
    chi2 = (((counts - expected) ** 2) / expected)[keep].sum()
    chi2 += (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(float(expected[~keep].sum()), 1e-9)
    dof = int(keep.sum())
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (float(chi2), dof)


# ---- the engine, every drafter kind ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8]], [[5, 6, 7, 8, 9, 10], [40, 41], [100, 3, 77]]])
def test_tree_greedy_output_equals_plain_greedy(kind, prompts):
    target = tiny_target()
    drafter = build(kind, target)
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=20)
    tree = tree_speculative_generate(target, drafter, prompts, tree_budget=NUM_DRAFTS + 3, max_new_tokens=20)
    assert tree.tokens == plain.tokens
    assert all(len(a) == len(p) for a, p in zip(tree.accept_lengths, tree.proposed))


@pytest.mark.parametrize("kind", ["eagle3", "dspark", "medusa"])
def test_tree_sampling_law_through_the_engine(kind):
    """T = 1, trees of 5 nodes: the first three emitted tokens follow the target's joint law (chi-square). One kind
    per builder: EAGLE-2 dynamic trees, DDTree over sampled block marginals (DSpark's q at T), DDTree over exact
    marginals (Medusa); the per-row walk makes this the slowest test, so not every kind."""
    vocab, rows = 6, 2000
    target = tiny_target(vocab_size=vocab)
    drafter = build(kind, target, sampling=kind in SAMPLING)
    prompt = [1, 4, 2, 5, 3]
    out = tree_speculative_generate(target, drafter, [prompt] * rows, tree_budget=5, max_new_tokens=3,
                                    temperature=1.0, seed=0, eos_token_ids=[])
    counts = joint_counts(out.tokens, vocab)
    assert_chi_square(counts, exact_joint(target.model, prompt, vocab) * rows)
    assert sum(map(sum, out.accept_lengths)) > 0 or kind == "ngram"  # the tree took part


@pytest.mark.parametrize("kind", KINDS)
def test_commit_after_a_non_first_branch_equals_a_chain_commit(kind):
    """Accept a path through the root's second child (when the drafter's tree has one): the drafter's next proposal
    equals that of a twin that verified the same tokens as a plain chain. Lossless output cannot catch a commit that
    kept the drafter's own top-1 branch; this does."""
    trees, chains = tiny_target(), tiny_target()
    drafter, root = begun(kind, trees, PROMPTS, PROMPT_MASK)
    twin, _ = begun(kind, chains, PROMPTS, PROMPT_MASK)
    request = drafter.feature_request()
    tree = grow_tree(drafter, root, 6, top_k=2)
    path = deepest_path_avoiding_first_child(tree)
    mark = trees.mark()
    logits, served = tree_extend(trees, tree, request)
    keep = (path >= 0).sum(-1)
    trees.keep_path(mark, path, keep)
    block = tree.tokens.gather(1, path.clamp(min=0))
    next_tokens = logits[torch.arange(2)[:, None], path.clamp(min=0)].argmax(-1).gather(1, (keep - 1)[:, None])[:, 0]
    valid = path >= 0
    positions = (PROMPT_MASK.sum(-1)[:, None] + torch.arange(path.shape[1])).long()
    features = served.along(path)
    if request.kv_layers:  # as the engine serves them: read after compaction
        features = features.with_kv(trees.kv_view(request.kv_layers))
    drafter.commit(keep - 1, DraftContext(block, valid, positions, next_tokens=next_tokens, **features.context()))
    limit = twin.max_draft_tokens()
    twin.propose(tree.num_nodes - 1 if limit is None else min(tree.num_nodes - 1, limit))  # a chain round: propose,
    _, chain_served = chains.extend(block, request, valid=valid)  # verify the block plainly, commit
    twin.commit(keep - 1, DraftContext(block, valid, positions, next_tokens=next_tokens, **chain_served.context()))
    ours, theirs = drafter.propose(NUM_DRAFTS), twin.propose(NUM_DRAFTS)
    assert torch.equal(ours.tokens, theirs.tokens)
    if ours.log_probs is not None:
        torch.testing.assert_close(ours.log_probs, theirs.log_probs)


def deepest_path_avoiding_first_child(tree: DraftTree) -> torch.Tensor:
    """Per row, the deepest root-to-node path whose first step is not node 1 when the root has another child (the
    chain trees of drafters without marginals have none), padded with -1."""
    paths = []
    for row in range(tree.tokens.shape[0]):
        kids = tree.children(row)
        avoid = 1 if len(kids[0]) > 1 else None
        best: list[int] = [0]
        for node in range(1, tree.num_nodes):
            nodes = [node]
            while nodes[-1] != 0:
                nodes.append(int(tree.parents[row, nodes[-1]]))
            nodes = nodes[::-1]
            if nodes[1] != avoid and len(nodes) > len(best):
                best = nodes
        paths.append(best)
    width = max(map(len, paths))
    return torch.tensor([p + [-1] * (width - len(p)) for p in paths])
