"""verify.py: hand-written greedy cases, the exact analytic sampling rule, and sampling transforms."""

import pytest
import torch

from inference.engine.verify import (
    acceptance_probability,
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
