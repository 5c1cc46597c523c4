"""trellis.CRF against torch-struct's LinearChainCRF (0.5): log-partition, tag and transition marginals, and the
argmax, on sequences of different lengths. torch-struct takes edge potentials phi(n, z_{n+1}, z_n) of size
(batch, N-1, C, C): the CRF's start, emission, transition and end scores are folded into them."""
import pytest
import torch
import torch_struct

import trellis
from conftest import prefix_mask

LENGTHS = [6, 2, 4, 6, 3]
SEQ_LENGTH, NUM_TAGS = 6, 5


def edge_potentials(crf: trellis.CRF, emissions: torch.Tensor, lengths) -> torch.Tensor:
    """(batch, T-1, C, C) with [b, n, j, i] the score of tag i at n followed by tag j at n+1 (batch-major emissions)."""
    edges = (crf.transitions.t()[None, None] + emissions[:, 1:, :, None]).contiguous()  # torch-struct views it
    edges[:, 0] += (crf.start_transitions + emissions[:, 0])[:, None, :]
    for b, n in enumerate(lengths):
        edges[b, n - 2] += crf.end_transitions[:, None]
    return edges


def setup(device, dtype=torch.float64):
    crf = trellis.CRF(NUM_TAGS, batch_first=True).to(device, dtype)
    with torch.no_grad():
        for p in crf.parameters():
            p.normal_(0, 1.0)
    emissions = torch.randn(len(LENGTHS), SEQ_LENGTH, NUM_TAGS, dtype=dtype, device=device) * 2
    mask = prefix_mask(LENGTHS, SEQ_LENGTH, True, device=device)
    lengths = torch.tensor(LENGTHS, device=device)
    dist = torch_struct.LinearChainCRF(edge_potentials(crf, emissions, LENGTHS), lengths=lengths)
    return crf, emissions, mask, dist


def test_partition(device):
    crf, emissions, mask, dist = setup(device)
    torch.testing.assert_close(crf.log_partition(emissions, mask), dist.partition, rtol=1e-10, atol=1e-10)


def test_partition_and_likelihood_agree(device):
    """log p(tags) = score(tags) - log Z: torch-struct's log_prob of the tags' parts against forward()."""
    crf, emissions, mask, dist = setup(device)
    tags = torch.randint(0, NUM_TAGS, (len(LENGTHS), SEQ_LENGTH), device=device)
    parts = torch_struct.LinearChainCRF.struct.to_parts(tags.cpu(), NUM_TAGS, lengths=torch.tensor(LENGTHS))
    expected = dist.log_prob(parts.to(device, emissions.dtype))
    torch.testing.assert_close(crf(emissions, tags, mask, reduction="none"), expected, rtol=1e-10, atol=1e-10)


def test_marginals(device):
    crf, emissions, mask, dist = setup(device)
    edge_marginals = dist.marginals  # [b, n, j, i] = P(z_n = i, z_{n+1} = j)
    unary, pairwise = crf.marginals(emissions, mask, edges=True)
    torch.testing.assert_close(pairwise, edge_marginals.transpose(-1, -2), rtol=1e-8, atol=1e-10)
    expected_unary = torch.zeros_like(unary)
    for b, n in enumerate(LENGTHS):
        expected_unary[b, : n - 1] = edge_marginals[b, : n - 1].sum(-2)
        expected_unary[b, n - 1] = edge_marginals[b, n - 2].sum(-1)
    torch.testing.assert_close(unary, expected_unary, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(crf.marginals(emissions, mask), unary)


def test_argmax(device):
    crf, emissions, mask, dist = setup(device)
    best, _ = torch_struct.LinearChainCRF.struct.from_parts(dist.argmax)
    paths = crf.decode(emissions, mask)
    assert paths == [best[b, :n].tolist() for b, n in enumerate(LENGTHS)]
    as_tensor = crf.decode(emissions, mask, as_tensor=True)
    torch.testing.assert_close(as_tensor, torch.where(mask.bool(), best.to(device), -1))


@pytest.mark.parametrize("batch_first", [False, True])
def test_marginals_layout_follows_batch_first(batch_first):
    crf, emissions, mask, dist = setup("cpu")
    crf.batch_first = batch_first
    if not batch_first:
        emissions, mask = emissions.transpose(0, 1), mask.t()
    unary, pairwise = crf.marginals(emissions, mask, edges=True)
    assert unary.shape == emissions.shape
    expected_pairwise = dist.marginals.transpose(-1, -2)
    torch.testing.assert_close(pairwise if batch_first else pairwise.transpose(0, 1), expected_pairwise,
                               rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_kbest_against_kmax(device, k):
    crf, emissions, mask, dist = setup(device)
    expected_scores = dist.kmax(k).t()  # (batch, k), best first
    expected_paths = [torch_struct.LinearChainCRF.struct.from_parts(parts)[0] for parts in dist.topk(k)]
    paths, scores = crf.kbest(emissions, k, mask, as_tensor=True)
    assert paths.shape == (len(LENGTHS), k, SEQ_LENGTH)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-10, atol=1e-10)
    as_lists = crf.kbest(emissions, k, mask)
    for b, n in enumerate(LENGTHS):
        assert [path for path, _ in as_lists[b]] == [expected_paths[i][b, :n].tolist() for i in range(k)]
        assert [score for _, score in as_lists[b]] == pytest.approx(expected_scores[b].tolist(), rel=1e-10)
        assert (paths[b, :, n:] == -1).all()
