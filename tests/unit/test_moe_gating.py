"""The MoE gate against DeepSpeed's own top1gating / top2gating / topkgating (deepspeed/moe/sharded_moe.py) on the
same logits: capacity, combine weights, dispatch mask, expert counts and the load-balancing loss agree exactly, with
token dropping on and off, and with random token selection / second-expert sampling fed the same draws. Then the
draws' own properties, and the sparse dispatch / combine against DeepSpeed's dense einsums."""

import pytest
import torch
from deepspeed.moe import sharded_moe
from deepspeed.utils import groups as ds_groups

from megatron.core.moe import draws, gating
from megatron.core.moe.dispatch import combine, dispatch, route_slots

S, E = 40, 4


def _logits(seed: int = 0, skew: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, E, generator=g)
    logits[:, 0] += skew  # expert 0 over-subscribed: capacity drops tokens at factor 1
    return logits


def _dense(r: gating.Routing) -> torch.Tensor:
    """Our routes as DeepSpeed's combine_weights [S, E, C]."""
    out = torch.zeros(S, E, r.capacity)
    for route in range(r.experts.shape[0]):
        s = torch.nonzero(r.experts[route] >= 0).flatten()
        out[s, r.experts[route, s], r.locations[route, s]] += r.weights[route, s]
    return out


def _same(ours: gating.Routing, theirs) -> None:
    l_aux, combine_weights, dispatch_mask, counts = theirs
    assert ours.capacity == combine_weights.shape[2]
    assert torch.equal(_dense(ours), combine_weights)
    assert torch.equal(_dense(ours).bool(), dispatch_mask)
    assert torch.equal(ours.counts, counts)
    assert torch.equal(ours.l_aux, l_aux)


@pytest.fixture(autouse=True)
def _no_mpu(monkeypatch):
    """DeepSpeed's no-drop path pads to the TP size of a registered mpu; these calls have none."""
    monkeypatch.setattr(ds_groups, "mpu", None)


@pytest.mark.parametrize("factor, min_capacity, drop", [(1.0, 4, True), (0.5, 0, True), (2.0, 4, True),
                                                        (1.0, 4, False)])
def test_top1_matches_deepspeed(factor, min_capacity, drop):
    logits = _logits()
    ours = gating.top1(logits, factor, min_capacity, drop, rts=None)
    _same(ours, sharded_moe.top1gating(logits.clone(), factor, min_capacity, drop_tokens=drop, use_rts=False))
    if drop and factor <= 1.0:
        assert (ours.experts < 0).any()  # the case really drops tokens


@pytest.mark.parametrize("factor, min_capacity, drop", [(1.0, 4, True), (0.5, 0, True), (1.0, 4, False)])
def test_top2_matches_deepspeed(factor, min_capacity, drop):
    logits = _logits(1)
    ours = gating.top2(logits, factor, min_capacity, drop, gumbel=None)
    _same(ours, sharded_moe.top2gating(logits.clone(), factor, min_capacity, drop_tokens=drop,
                                       top2_2nd_expert_sampling=False))


@pytest.mark.parametrize("k, factor, drop", [(3, 1.0, True), (3, 0.5, True), (4, 1.0, False)])
def test_topk_beyond_two_matches_deepspeed(k, factor, drop):
    logits = _logits(5)
    ours = gating.topk(logits, k, factor, 4, drop)
    _same(ours, sharded_moe.topkgating(logits.clone(), k, factor, 4, drop_tokens=drop))


def test_random_token_selection_matches_deepspeed_given_the_same_draws(monkeypatch):
    """DeepSpeed draws one U(0, 1) per (token, expert); only the token's chosen expert's counts, so a per-token
    draw broadcast over the experts is the same rule."""
    logits = _logits(2)
    u = draws.rts_uniform(draws.token_keys(torch.arange(4), S // 4, seed=7).reshape(-1), layer=3)  # [S]
    monkeypatch.setitem(sharded_moe.exp_selection_uniform_map, logits.device,
                        lambda shape: u.unsqueeze(1).expand(shape))
    ours = gating.top1(logits, 1.0, 4, True, rts=u)
    _same(ours, sharded_moe.top1gating(logits.clone(), 1.0, 4, drop_tokens=True, use_rts=True))
    plain = gating.top1(logits, 1.0, 4, True, rts=None)
    assert not torch.equal(ours.experts, plain.experts)  # the draws decide which tokens an expert keeps


def test_second_expert_sampling_matches_deepspeed_given_the_same_noise(monkeypatch):
    logits = _logits(3)
    noise = draws.gumbel(draws.token_keys(torch.arange(4), S // 4, seed=7).reshape(-1), layer=1, num_experts=E)
    monkeypatch.setitem(sharded_moe.gumbel_map, logits.device, lambda shape: noise)
    ours = gating.top2(logits, 1.0, 4, True, gumbel=noise)
    _same(ours, sharded_moe.top2gating(logits.clone(), 1.0, 4, drop_tokens=True, top2_2nd_expert_sampling=True))
    assert not torch.equal(ours.experts[1], gating.top2(logits, 1.0, 4, True).experts[1])


def test_draws_follow_the_token_not_the_batch():
    """A token's draws depend on (seed, layer, sample index, position) only: the same sample in another micro-batch,
    at another place in it, draws the same numbers; other samples, layers and seeds draw others."""
    both = draws.token_keys(torch.tensor([5, 9]), 16, seed=1)  # [s, b]
    alone = draws.token_keys(torch.tensor([9]), 16, seed=1)
    assert torch.equal(both[:, 1], alone[:, 0])
    u = draws.rts_uniform(both.reshape(-1), layer=2)
    assert torch.equal(draws.rts_uniform(alone.reshape(-1), layer=2), u.view(16, 2)[:, 1])
    assert not torch.equal(u, draws.rts_uniform(both.reshape(-1), layer=3))
    assert not torch.equal(both, draws.token_keys(torch.tensor([5, 9]), 16, seed=2))
    many = draws.rts_uniform(draws.token_keys(torch.arange(512), 64, seed=1).reshape(-1), layer=0)
    assert 0.0 < many.min() and many.max() < 1.0 and abs(many.mean().item() - 0.5) < 0.01
    g = draws.gumbel(draws.token_keys(torch.arange(256), 64, seed=1).reshape(-1), layer=0, num_experts=8)
    assert torch.isfinite(g).all() and abs(g.mean().item() - 0.5772) < 0.02  # Gumbel(0, 1)'s mean: Euler's gamma


def test_sparse_dispatch_and_combine_match_the_dense_einsums():
    """DeepSpeed's dense form: dispatch = einsum('sec,sm->ecm'), combine = einsum('sec,ecm->sm'); ours gathers."""
    logits = _logits(4)
    r = gating.top2(logits, 1.0, 4, True)
    weights = _dense(r)
    x = torch.randn(S, 8, generator=torch.Generator().manual_seed(5))
    slots = route_slots(r, E, r.capacity)
    buf = dispatch(x, slots, E, r.capacity)
    assert torch.equal(buf, torch.einsum("sec,sm->ecm", weights.bool().float(), x))
    y = torch.randn(E, r.capacity, 8, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(combine(y, slots, r.weights), torch.einsum("sec,ecm->sm", weights, y),
                               rtol=1e-6, atol=1e-6)
    padded = dispatch(x, route_slots(r, E, r.capacity + 2), E, r.capacity + 2)  # a buffer padded for TP
    assert torch.equal(padded[:, :r.capacity], buf) and not padded[:, r.capacity:].any()
