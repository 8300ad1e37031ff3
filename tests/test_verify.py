"""verify.py: hand-written greedy cases, the exact analytic sampling rule, and sampling transforms."""

import pytest
import torch

from inference.engine.verify import (
    acceptance_probability,
    block_verify,
    block_weights,
    greedy_verify,
    residual_distribution,
    sample_verify,
    sampling_probs,
)


def _logits_for(tokens, vocab=10):
    """[1, len, V] logits whose argmax at each position is the given token."""
    logits = torch.zeros(1, len(tokens), vocab)
    logits[0, torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_all_none_partial():
    drafts = torch.tensor([[3, 4, 5]])
    accepted, nxt = greedy_verify(drafts, _logits_for([3, 4, 5, 6]))
    assert accepted.tolist() == [3] and nxt.tolist() == [6]  # all accepted + bonus
    accepted, nxt = greedy_verify(drafts, _logits_for([7, 4, 5, 6]))
    assert accepted.tolist() == [0] and nxt.tolist() == [7]  # none: correction token
    accepted, nxt = greedy_verify(drafts, _logits_for([3, 4, 9, 6]))
    assert accepted.tolist() == [2] and nxt.tolist() == [9]  # partial
    accepted, nxt = greedy_verify(drafts, _logits_for([3, 4, 5, 6]), num_valid=torch.tensor([1]))
    assert accepted.tolist() == [1] and nxt.tolist() == [4]  # a short proposal stops at num_valid


def test_greedy_batch_rows_independent():
    drafts = torch.tensor([[3, 4], [3, 4]])
    logits = torch.cat([_logits_for([3, 4, 8]), _logits_for([3, 1, 8])])
    accepted, nxt = greedy_verify(drafts, logits)
    assert accepted.tolist() == [2, 1] and nxt.tolist() == [8, 1]


def _emitted_distribution(p, q):
    """Exact distribution of the emitted token at one position for a draft drawn from q."""
    vocab = p.shape[-1]
    total = torch.zeros(vocab, dtype=torch.float64)
    for x in range(vocab):
        if q[x] == 0:
            continue
        token = torch.tensor(x)
        accept = acceptance_probability(p, q, token)
        total[x] += q[x] * accept
        total += q[x] * (1 - accept) * residual_distribution(p, q, token)
    return total


def test_sampling_rule_is_exact_for_random_p_q():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        p = torch.softmax(torch.randn(9, generator=gen, dtype=torch.float64) * 2, -1)
        q = torch.softmax(torch.randn(9, generator=gen, dtype=torch.float64) * 2, -1)
        q[torch.randint(0, 9, (2,), generator=gen)] = 0  # drafts that never propose some tokens
        q = q / q.sum()
        assert torch.allclose(_emitted_distribution(p, q), p, atol=1e-6)


def test_sampling_rule_is_exact_for_one_hot_drafts():
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        p = torch.softmax(torch.randn(9, generator=gen, dtype=torch.float64) * 2, -1)
        x = int(torch.randint(0, 9, (1,), generator=gen))
        token = torch.tensor(x)
        accept = acceptance_probability(p, None, token)
        emitted = (1 - accept) * residual_distribution(p, None, token)
        emitted[x] += accept
        assert torch.allclose(accept, p[x])
        assert torch.allclose(emitted, p, atol=1e-6)
        # the one-hot path equals passing q as an explicit one-hot distribution
        q = torch.nn.functional.one_hot(token, 9).double()
        assert torch.allclose(residual_distribution(p, q, token), residual_distribution(p, None, token))


def test_sample_verify_chain_frequencies_match_analytic():
    """Monte Carlo over many rows at once: the first emitted token of a 1-draft chain follows p."""
    vocab, rows = 5, 60000
    p = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    q = torch.tensor([0.3, 0.1, 0.4, 0.1, 0.1])
    gen = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(q.expand(rows, vocab), 1, replacement=True, generator=gen)
    target = torch.stack([p, torch.full((vocab,), 1.0 / vocab)], 0).expand(rows, 2, vocab)
    accepted, nxt = sample_verify(drafts, q.expand(rows, 1, vocab), target, generator=gen)
    first = torch.where(accepted == 1, drafts[:, 0], nxt)
    freq = torch.bincount(first, minlength=vocab).float() / rows
    assert torch.allclose(freq, p, atol=0.01)


def test_sampling_probs_transforms():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert sampling_probs(logits, 0.0).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert torch.allclose(sampling_probs(logits, 1.0), torch.softmax(logits, -1))
    assert torch.allclose(sampling_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    top2 = sampling_probs(logits, 1.0, top_k=2)
    assert (top2[0, 2:] == 0).all() and torch.isclose(top2.sum(), torch.tensor(1.0))
    probs = torch.softmax(logits, -1)[0]  # [0.61, 0.22, 0.14, 0.03]
    top_p = sampling_probs(logits, 1.0, top_p=0.7)  # needs the two most likely tokens to reach 0.7
    assert (top_p[0, 2:] == 0).all() and torch.allclose(top_p[0, :2], probs[:2] / probs[:2].sum())
    with pytest.raises(ValueError, match="temperature"):
        sampling_probs(logits, -0.1)


def test_sample_verify_short_proposal_gets_a_bonus_not_a_residual():
    # Row proposes 1 of 2 drafts; p makes the valid draft certain, so the next token comes from p at position 1.
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    accepted, nxt = sample_verify(torch.tensor([[1, 0]]), None, p, num_valid=torch.tensor([1]))
    assert accepted.tolist() == [1] and nxt.tolist() == [2]


# ---- block verification: the exact law of what a round emits, enumerated over every draft --------------------------
def _trees(vocab: int, depth: int, seed: int, one_hot_drafts: bool = False):
    """Random conditional laws for every prefix: target p(.|prefix) up to `depth` tokens, draft q(.|prefix) below
    it (one-hot at a random token when one_hot_drafts: an argmax drafter)."""
    import itertools

    gen = torch.Generator().manual_seed(seed)
    p, q = {}, {}
    for length in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=length):
            p[prefix] = torch.softmax(1.5 * torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
            if length < depth:
                q[prefix] = (torch.nn.functional.one_hot(torch.randint(0, vocab, (), generator=gen), vocab).double()
                             if one_hot_drafts else
                             torch.softmax(1.5 * torch.randn(vocab, generator=gen, dtype=torch.float64), -1))
    return p, q


def _round_law(p, q, vocab: int, depth: int, limit: int):
    """{emitted tokens: probability} of one block-verified round of `depth` drafts drawn from q (the row's last
    draft: limit), and the expected number of drafts kept; sequences of q-probability 0 are skipped."""
    import itertools

    drafts = list(itertools.product(range(vocab), repeat=depth))
    tokens = torch.tensor(drafts)
    weight = torch.tensor([float(torch.prod(torch.stack([q[d[:i]][d[i]] for i in range(depth)]))) for d in drafts],
                          dtype=torch.float64)
    target = torch.stack([torch.stack([p[d[:i]] for i in range(depth + 1)]) for d in drafts])
    draft_probs = torch.stack([torch.stack([q[d[:i]] for i in range(depth)]) for d in drafts])
    h, laws = block_weights(tokens, draft_probs, target, torch.full((len(drafts),), limit))
    law, kept = {}, 0.0
    for b, d in enumerate(drafts):
        if weight[b] == 0:
            continue
        for t in range(depth + 1):
            p_tau = h[b, t - 1] if t else torch.tensor(1.0, dtype=torch.float64)  # tau = t: test t passes (t > 0)
            p_tau = p_tau * torch.prod(1 - h[b, t:])  # and every later test fails
            kept += float(weight[b] * p_tau) * t
            for y in range(vocab):
                key = d[:t] + (y,)
                law[key] = law.get(key, 0.0) + float(weight[b] * p_tau * laws[b, t, y])
    return law, kept


@pytest.mark.parametrize("one_hot_drafts", [False, True])
@pytest.mark.parametrize("limit", [3, 2])
def test_block_verification_emits_the_targets_law_exactly(one_hot_drafts, limit):
    """The round's emitted prefix, continued by the target, has the target's law over every sequence of depth + 1
    tokens; and it keeps at least as many drafts in expectation as token-wise verification."""
    import itertools

    vocab, depth = 3, 3
    for seed in range(4):
        p, q = _trees(vocab, depth, seed, one_hot_drafts)
        law, kept = _round_law(p, q, vocab, depth, limit)
        for sequence in itertools.product(range(vocab), repeat=depth + 1):
            want = float(torch.prod(torch.stack([p[sequence[:i]][sequence[i]] for i in range(depth + 1)])))
            got = sum(mass * float(torch.prod(torch.stack([p[sequence[:i]][sequence[i]] for i in range(len(prefix),
                                                                                                  depth + 1)] or
                                                          [torch.tensor(1.0, dtype=torch.float64)])))
                      for prefix, mass in law.items() if sequence[:len(prefix)] == prefix)
            assert abs(got - want) < 1e-12, (seed, sequence, got, want)
        token_wise = sum(float(torch.prod(torch.stack([torch.minimum(p[d[:i]][d[i]], q[d[:i]][d[i]])
                                                       for i in range(j)])))
                         for j in range(1, limit + 1) for d in itertools.product(range(vocab), repeat=j))
        assert kept >= token_wise - 1e-12, (seed, kept, token_wise)
        if one_hot_drafts:  # argmax drafts: the same expected drafts kept either way (only sampled drafts gain)
            assert abs(kept - token_wise) < 1e-12, (seed, kept, token_wise)


def test_block_verify_draws_its_tests_and_law():
    """Monte Carlo of block_verify against block_weights: the kept count's law and the first emitted token's."""
    vocab, depth, rows = 3, 2, 40000
    p, q = _trees(vocab, depth, seed=7)
    gen = torch.Generator().manual_seed(0)
    first = torch.multinomial(q[()].expand(rows, vocab), 1, replacement=True, generator=gen)[:, 0]
    second = torch.stack([torch.multinomial(q[(int(x),)], 1, generator=gen)[0] for x in first[:2000]])
    tokens = torch.stack([first[:2000], second], dim=1)
    target = torch.stack([torch.stack([p[()], p[(int(a),)], p[(int(a), int(b))]]) for a, b in tokens.tolist()])
    draft_probs = torch.stack([torch.stack([q[()], q[(int(a),)]]) for a, _ in tokens.tolist()])
    h, _ = block_weights(tokens, draft_probs, target)
    expected = (h[:, 1] + h[:, 0] * (1 - h[:, 1]) * 1).mean()  # P(tau >= 1)
    reps = 20
    kept = torch.stack([block_verify(tokens, draft_probs, target, generator=gen)[0] for _ in range(reps)])
    assert abs(float((kept >= 1).double().mean()) - float(expected)) < 0.02


def test_block_verify_of_no_drafts_emits_from_p():
    """A width-0 round (adaptive k) verifies the last token alone: nothing kept, the token drawn from p."""
    p = torch.tensor([[[0.0, 1.0, 0.0]]])
    accepted, nxt = block_verify(torch.zeros(1, 0, dtype=torch.long), None, p)
    assert accepted.tolist() == [0] and nxt.tolist() == [1]
