"""Unit tests of specdec.sampling on hand-built logits and distributions."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from specdec.sampling import (
    SamplingParams,
    SparseDist,
    Stream,
    VerifyOutcome,
    accept_greedy,
    accept_sampled,
    argmax_tokens,
    densify,
    draw_draft,
    logits_to_probs,
    prob_of,
    random_seed,
    sample,
    sample_dense,
    sample_token,
    score_drafts,
    top_indices,
    truncate,
    uniform,
    uniforms,
    validate_sparse,
)
from specdec.sampling.rng import keyed_uniform, seed_key

LAST_U = 1.0 - 2.0**-53  # the largest uniform the rng can return


pytestmark = pytest.mark.usefixtures("one_thread")


def probs_of(values: list[float]) -> torch.Tensor:
    """Logits [1, V] whose softmax is `values` (normalized)."""
    return torch.tensor(values, dtype=torch.float64).log()[None].float()


def expect_probs(actual: torch.Tensor, expected: list[float]) -> None:
    want = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), want / want.sum(), atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- params


def test_params_defaults_are_valid_and_not_greedy():
    params = SamplingParams().validate()
    assert not params.greedy
    assert SamplingParams(temperature=0.0).validate().greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=-0.5), "temperature"),
        # below ~2.9e-39 a GPU's division gave NaN rows (INTERNAL); 1e-39 is greedy in all but name
        (dict(temperature=1e-39), "0 \\(greedy\\) or at least 1e-06"),
        (dict(temperature=5e-7), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=-0.1), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_params_validate_rejects_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs).validate()


def test_params_from_wire_reads_zero_top_p_as_unset():
    assert SamplingParams.from_wire(0.7, 0, 0.0) == SamplingParams(0.7, 0, 1.0)
    assert SamplingParams.from_wire(0.0, 0, 0.0).greedy  # an empty message is greedy
    assert SamplingParams.from_wire(1.0, 40, 0.9) == SamplingParams(1.0, 40, 0.9)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_wire(1.0, 0, 1.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_wire(-1.0, 0, 0.0)


# ---------------------------------------------------------------- transform


def test_argmax_tokens_known_rows_and_lowest_index_on_ties():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 3.0, 3.0, 1.0], [-5, -5, -4, -4.0]])
    assert argmax_tokens(logits).tolist() == [1, 0, 2]


def test_temperature_scales_log_probs():
    probs = logits_to_probs(probs_of([0.5, 0.3, 0.2]), SamplingParams(temperature=2.0))
    expect_probs(probs[0], [0.5**0.5, 0.3**0.5, 0.2**0.5])
    probs = logits_to_probs(probs_of([0.5, 0.3, 0.2]), SamplingParams(temperature=0.5))
    expect_probs(probs[0], [0.25, 0.09, 0.04])


def test_top_k_keeps_k_tokens_ties_to_lowest_id():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0]])
    probs = logits_to_probs(logits, SamplingParams(top_k=2))
    expect_probs(probs[0], [0, math.e**4, 0, math.e**3])
    tied = logits_to_probs(torch.tensor([[1.0, 3.0, 3.0, 3.0]]), SamplingParams(top_k=2))
    expect_probs(tied[0], [0, 1, 1, 0])


def test_top_k_at_or_above_vocab_is_a_no_op():
    logits = torch.randn(3, 6)
    for top_k in (6, 7, 1000):
        torch.testing.assert_close(
            logits_to_probs(logits, SamplingParams(top_k=top_k)), torch.softmax(logits, -1)
        )


def test_top_k_one_is_the_greedy_token():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 1.0, 5.0, 5.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.8, top_k=1))
    assert probs.argmax(-1).tolist() == argmax_tokens(logits).tolist() == [1, 0]
    assert probs.max(-1).values.tolist() == [1.0, 1.0]


def test_top_p_keeps_smallest_prefix_reaching_the_mass():
    logits = probs_of([0.05, 0.5, 0.15, 0.3])
    expect_probs(logits_to_probs(logits, SamplingParams(top_p=0.75))[0], [0, 0.5, 0, 0.3])
    expect_probs(logits_to_probs(logits, SamplingParams(top_p=0.85))[0], [0, 0.5, 0.15, 0.3])


def test_top_p_is_measured_after_top_k():
    # After top-k=3 the mass is [.4, .3, .2]/.9: the first two hold .778 >= .75,
    # so the third is cut (measured on the uncut p, the first two hold only .7).
    logits = probs_of([0.4, 0.3, 0.2, 0.1])
    probs = logits_to_probs(logits, SamplingParams(top_k=3, top_p=0.75))
    expect_probs(probs[0], [0.4, 0.3, 0, 0])
    expect_probs(logits_to_probs(logits, SamplingParams(top_p=0.75))[0], [0.4, 0.3, 0.2, 0])


def test_top_p_one_keeps_even_negligible_tokens():
    logits = torch.tensor([[0.0, -30.0, -60.0, 5.0]])
    probs = logits_to_probs(logits, SamplingParams(top_p=1.0))[0]
    assert bool((probs > 0).all())
    torch.testing.assert_close(probs, torch.softmax(logits[0], -1))


def test_tiny_top_p_keeps_exactly_the_top_token():
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    probs = logits_to_probs(logits, SamplingParams(top_p=1e-9))
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_top_p_ties_at_the_cut_go_to_the_lowest_id():
    logits = probs_of([0.2, 0.4, 0.2, 0.2])
    probs = logits_to_probs(logits, SamplingParams(top_p=0.55))
    expect_probs(probs[0], [1, 2, 0, 0])


def test_transform_rows_are_independent_and_dtype_agnostic():
    logits = torch.randn(5, 11) * 3
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.8)
    together = logits_to_probs(logits.bfloat16(), params)
    assert together.dtype == torch.float32
    for i in range(5):
        assert torch.equal(together[i], logits_to_probs(logits[i : i + 1].bfloat16(), params)[0])
    torch.testing.assert_close(together.sum(-1), torch.ones(5))


def test_tiny_temperature_and_minus_inf_logits_stay_finite():
    logits = torch.tensor([[1.0, 1.5, float("-inf"), 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1e-6))
    assert probs.tolist() == [[0, 1, 0, 0]]
    # Logits this large overflow once divided by the temperature, unless the top is shifted to 0 first.
    large = torch.tensor([[1e33, 3e33, float("-inf"), -2e33]])
    probs = logits_to_probs(large, SamplingParams(temperature=1e-6))
    assert probs.tolist() == [[0, 1, 0, 0]]
    probs = logits_to_probs(logits, SamplingParams(top_k=3, top_p=0.99))
    assert bool(torch.isfinite(probs).all()) and probs[0, 2] == 0


def test_greedy_params_give_one_hot_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0], [2.0, 1.0, 0.0]])
    assert logits_to_probs(logits, SamplingParams(temperature=0)).tolist() == [
        [0, 1, 0],
        [1, 0, 0],
    ]


def test_rows_draw_only_entries_of_mass_and_say_which_rows_have_none():
    """`pick_rows`, the batched inverse-CDF draw: rows with zeros inside and
    at the end, the last uniform the rng gives, and rows without finite mass."""
    from specdec.sampling.sparse import pick_rows

    rows = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.25, 0.0, 0.75, 0.0, 0.0], [0.0] * 5,
                         [0.5, float("inf"), 0.0, 0.0, 0.0], [0.5, float("nan"), 0.0, 0.0, 0.0]])
    for us, want in (([0.0] * 5, [1, 0]), ([LAST_U] * 5, [3, 2]), ([0.5] * 5, [3, 2]), ([0.49] * 5, [1, 2])):
        picked, ok = pick_rows(rows, us)
        assert picked[:2].tolist() == want and ok.tolist() == [1, 1, 0, 0, 0]
    gen = torch.Generator().manual_seed(3)
    sparse_rows = torch.rand(64, 40, generator=gen) * (torch.rand(64, 40, generator=gen) < 0.3)
    sparse_rows[:, 0] = 0.0  # never the first entry either
    picked, ok = pick_rows(sparse_rows, [i / 64 for i in range(63)] + [LAST_U])
    has_mass = sparse_rows.sum(-1) > 0
    assert ok.bool().tolist() == has_mass.tolist()
    assert all(sparse_rows[r, picked[r]] > 0 for r in range(64) if has_mass[r])


def test_top_indices_orders_like_a_stable_descending_sort():
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(-3, 4, (20, 9), generator=gen).float() / 2  # many ties
    values[0, :3] = torch.tensor([-0.0, 0.0, -0.0])
    expected = values.sort(dim=-1, descending=True, stable=True).indices
    assert torch.equal(top_indices(values, 9), expected)
    assert torch.equal(top_indices(values, 4), expected[:, :4])


def test_top_indices_of_probabilities_skips_the_sign_work_and_orders_alike():
    """`nonnegative=True` (a softmax's output): the same indices as the
    general path and as a stable descending sort, ties and zeros included."""
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randint(-4, 3, (30, 40), generator=gen).float() * 7, dim=-1)
    probs[::3, 5:20] = 0.0  # masked ids: exact zeros, tied
    expected = probs.sort(dim=-1, descending=True, stable=True).indices
    for n in (1, 7, 40):
        assert torch.equal(top_indices(probs, n, nonnegative=True), expected[:, :n])
        assert torch.equal(top_indices(probs, n, nonnegative=True), top_indices(probs, n))


# ---------------------------------------------------------------- rng


def test_rng_pins_its_values():
    # Part of the reproducibility contract: seeded requests must replay forever.
    assert uniform(0, 0, Stream.DRAFT) == 0.945108730485872
    assert uniform(2**64 - 1, 2**62 - 1, Stream.BONUS) == 0.12434974065731486


def test_rng_is_deterministic_and_distinct_across_keys():
    keys = [(s, p, st) for s in (0, 1, 2, 2**63, 2**64 - 1) for p in range(40) for st in Stream]
    values = [uniform(*key) for key in keys]
    assert values == [uniform(*key) for key in keys]
    assert len(set(values)) == len(keys)
    assert all(0.0 <= v < 1.0 for v in values)


def test_uniforms_matches_uniform():
    positions = [0, 5, 17, 2**40]
    assert uniforms(9, positions, Stream.ACCEPT) == [
        uniform(9, p, Stream.ACCEPT) for p in positions
    ]
    assert uniforms(9, [], Stream.ACCEPT) == []
    key = seed_key(9)
    for stream in Stream:
        assert [keyed_uniform(key, p, stream) for p in positions] == uniforms(9, positions, stream)


@pytest.mark.parametrize("bad_seed", [-1, 2**64])
def test_rng_rejects_seeds_outside_uint64(bad_seed):
    with pytest.raises(ValueError, match="seed"):
        uniform(bad_seed, 0, Stream.DRAFT)


def test_rng_is_uniform_over_positions_and_over_seeds():
    n = 20_000
    over_positions = uniforms(123, range(n), Stream.RECOVERY)
    over_seeds = [uniform(seed, 7, Stream.DRAFT) for seed in range(n)]
    for draws in (over_positions, over_seeds):
        assert stats.kstest(draws, "uniform").pvalue > 1e-3
    # Streams at the same position must be uncorrelated.
    accept = uniforms(123, range(n), Stream.ACCEPT)
    assert abs(stats.pearsonr(over_positions, accept).statistic) < 0.03


def test_rng_has_53_bit_resolution():
    draws = uniforms(5, range(2000), Stream.BONUS)
    assert all((v * 2**53).is_integer() for v in draws)
    assert any(not (v * 2**32).is_integer() for v in draws)


def test_random_seed_is_uint64_and_varies():
    seeds = {random_seed() for _ in range(20)}
    assert len(seeds) > 1 and all(0 <= s < 2**64 for s in seeds)


# ---------------------------------------------------------------- sparse


def test_truncate_keeps_top_tokens_and_sums_to_one_in_float32():
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        row = torch.softmax(torch.randn(1000, generator=gen) * 3, -1)
        dist = truncate(row, 20)
        assert dist.token_ids.tolist() == row.argsort(descending=True)[:20].tolist()
        assert dist.probs.dtype == torch.float32
        # As the docstring promises: within half a float32 step of the largest entry, where
        # the rounding left over is folded (2^-25 held without that correction too).
        top = dist.probs[0]
        half_step = (torch.nextafter(top, torch.tensor(2.0)) - top).double().item() / 2
        assert abs(dist.probs.double().sum().item() - 1.0) <= half_step
        want = row[dist.token_ids].double() / row[dist.token_ids].double().sum()
        torch.testing.assert_close(dist.probs.double(), want, rtol=1e-6, atol=0)


def test_truncate_keeps_fewer_when_fewer_have_mass_and_cuts_ties_by_id():
    row = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])
    assert truncate(row, 10).token_ids.tolist() == [1, 3, 4]
    assert truncate(row, 2).token_ids.tolist() == [1, 3]
    assert truncate(row, 2).probs.tolist() == pytest.approx([2 / 3, 1 / 3])
    single = truncate(row, 1)
    assert single.token_ids.tolist() == [1] and single.probs.tolist() == [1.0]


@pytest.mark.parametrize(
    ("ids", "probs", "message"),
    [
        ([1, 2], [1.0], "2 token ids but 1 probabilities"),
        ([], [], "empty"),
        ([1, 1], [0.5, 0.5], "duplicate"),
        ([1, 10], [0.5, 0.5], "outside"),
        ([-1, 2], [0.5, 0.5], "outside"),
        ([1, 2], [1.5, -0.5], "negative"),
        ([1, 2], [float("nan"), 0.5], "NaN"),
        ([1, 2], [0.5, 0.4], "sums to 0.9"),
    ],
)
def test_validate_sparse_rejects_each_malformed_case(ids, probs, message):
    with pytest.raises(ValueError, match=message):
        validate_sparse(ids, probs, vocab_size=10)


def test_validate_sparse_accepts_and_builds_and_checks_the_drafted_token():
    dist = validate_sparse([3, 7], [0.25, 0.75], vocab_size=10, drafted_id=7)
    assert isinstance(dist, SparseDist) and dist.to_lists() == ([3, 7], [0.25, 0.75])
    validate_sparse([3, 7], [0.25, 0.7502], vocab_size=10)  # within tolerance
    with pytest.raises(ValueError, match="drafted token 5"):
        validate_sparse([3, 7], [0.25, 0.75], vocab_size=10, drafted_id=5)
    with pytest.raises(ValueError, match="drafted token 3"):
        validate_sparse([3, 7], [0.0, 1.0], vocab_size=10, drafted_id=3)


def test_validate_sparse_builds_the_exact_float32_values_and_refuses_bad_ids():
    probs = [0.1, 0.2, 0.7000001]  # not float32 values: rounded as the tensor path rounds them
    dist = validate_sparse([5, 6, 9], probs, vocab_size=10)
    assert torch.equal(dist.probs, torch.tensor(probs, dtype=torch.float32))
    assert dist.token_ids.dtype == torch.int64 and dist.token_ids.tolist() == [5, 6, 9]
    with pytest.raises(ValueError, match="token id 10 outside"):
        validate_sparse([5, 10], [0.5, 0.5], vocab_size=10)
    with pytest.raises(ValueError, match="token id -1 outside"):
        validate_sparse([-1, 4], [0.5, 0.5], vocab_size=10)
    with pytest.raises(ValueError, match="negative"):
        validate_sparse([1, 2], [1.5, -0.5], vocab_size=10)


def test_prob_of_equals_the_sparse_dist_it_stands_for():
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        ids = torch.randperm(500, generator=gen)[:n].tolist()
        dist = truncate(torch.rand(500, generator=gen) ** 4, n)
        ids, probs = dist.to_lists()
        for x in (ids[0], ids[-1], 501):
            assert prob_of(ids, probs, x) == pytest.approx(dist.prob(x), rel=1e-15, abs=0)


def test_sparse_dist_prob_densify_and_wire_round_trip():
    dist = SparseDist.from_lists([4, 1], [0.6, 0.4])
    assert dist.prob(4) == pytest.approx(0.6) and dist.prob(2) == 0.0
    assert densify(dist, 6, "cpu").tolist() == pytest.approx([0, 0.4, 0, 0, 0.6, 0])
    ids, probs = dist.to_lists()
    assert torch.equal(SparseDist.from_lists(ids, probs).probs, dist.probs)
    off = SparseDist.from_lists([0, 1], [0.3, 0.6])  # sums to .9: normalized on use
    assert off.prob(1) == pytest.approx(2 / 3)
    assert densify(off, 2, "cpu").tolist() == pytest.approx([1 / 3, 2 / 3])


EDGE_US = [0.0, 2.0**-53, 0.25, 0.5, 0.75, 0.9999, LAST_U]


@pytest.mark.parametrize(
    "row",
    [
        [0.0, 0.5, 0.0, 0.5, 0.0],
        [0.0, 0.0, 1.0, 0.0, 0.0],
        [0.25, 0.25, 0.25, 0.25, 0.0],
        [0.0, 0.1, 0.2, 0.3, 0.4 - 2.0**-30],  # sums to slightly under 1
        [1e-30, 0.0, 0.0, 0.0, 1e-30],
    ],
)
def test_sampling_never_returns_a_zero_probability_token(row):
    dense = torch.tensor(row)
    support = [i for i, p in enumerate(row) if p > 0]
    nonzero = [(i, p) for i, p in enumerate(row) if p > 0]
    dist = SparseDist.from_lists([i for i, _ in nonzero][::-1], [p for _, p in nonzero][::-1])
    for u in EDGE_US + uniforms(0, range(200), Stream.DRAFT):
        assert sample_dense(dense, u) in support
        assert sample(dist, u) in support
    assert sample_dense(dense, 0.0) == support[0]
    assert sample_dense(dense, LAST_U) == support[-1]


def test_sample_dense_is_an_inverse_cdf():
    row = torch.tensor([0.5, 0.25, 0.0, 0.25])
    assert [sample_dense(row, u) for u in (0.0, 0.49, 0.5, 0.74, 0.75, LAST_U)] == [
        0,
        0,
        1,
        1,
        3,
        3,
    ]


def test_sample_of_sparse_follows_entry_order():
    dist = SparseDist.from_lists([9, 2], [0.75, 0.25])
    assert [sample(dist, u) for u in (0.0, 0.74, 0.75, LAST_U)] == [9, 9, 2, 2]


# ---------------------------------------------------------------- greedy rounds


def test_accept_greedy_all_accepted_emits_the_bonus():
    result = accept_greedy([5, 6, 7], [5, 6, 7, 8])
    assert (result.num_accepted, result.emitted_ids) == (3, [5, 6, 7, 8])


def test_accept_greedy_first_mismatch_emits_the_target_argmax():
    result = accept_greedy([5, 6, 7], [5, 9, 7, 8])
    assert (result.num_accepted, result.emitted_ids) == (1, [5, 9])
    result = accept_greedy([1, 6], [5, 6, 0])
    assert (result.num_accepted, result.emitted_ids) == (0, [5])
    assert accept_greedy([], [4]).emitted_ids == [4]


def test_greedy_round_from_hand_built_logits():
    vocab = 6
    argmax = [3, 1, 4, 0]  # target's greedy choice at each of k + 1 = 4 positions
    logits = torch.full((4, vocab), -1.0)
    logits[torch.arange(4), torch.tensor(argmax)] = 2.0
    outcome = score_drafts(logits, [3, 1, 5], [], SamplingParams(0.0), seed=0, first_position=9)
    assert outcome.argmax_ids == argmax and outcome.bonus_id == 0
    assert accept_greedy([3, 1, 5], outcome.argmax_ids).emitted_ids == [3, 1, 4]
    assert accept_greedy([3, 1, 4], outcome.argmax_ids).emitted_ids == [3, 1, 4, 0]


# ---------------------------------------------------------------- sampled rounds


def test_score_drafts_returns_p_of_x_and_recoveries_from_the_residual():
    p = [0.5, 0.3, 0.2, 0.0]
    logits = probs_of(p).repeat(3, 1)  # [k + 1, V] with k = 2
    q1 = SparseDist.from_lists([0, 1], [0.6, 0.4])  # max(0, p - q1) = {2: .2}
    q2 = SparseDist.from_lists([0, 1, 2], [0.5, 0.3, 0.2])  # ~= p: residual ~empty
    for seed in range(30):
        outcome = score_drafts(logits, [0, 2], [q1, q2], SamplingParams(), seed, 4)
        assert outcome.target_probs == pytest.approx([0.5, 0.2])
        assert outcome.recovery_ids[0] == 2  # the only token with p > q
        assert outcome.recovery_ids[1] in (0, 1, 2)  # fallback: drawn from p
        assert outcome.bonus_id in (0, 1, 2)
        assert outcome.argmax_ids == []


def test_k_zero_verify_equals_a_plain_decode_step():
    logits = torch.randn(1, 50) * 2
    params = SamplingParams(temperature=0.9, top_k=20)
    probs = logits_to_probs(logits, params)[0]
    for seed in range(20):
        outcome = score_drafts(logits, [], [], params, seed, first_position=33)
        assert outcome.bonus_id == sample_token(probs, seed, 33)
        result = accept_sampled([], [], outcome, seed, 33)
        assert (result.num_accepted, result.emitted_ids) == (0, [outcome.bonus_id])


def test_accept_sampled_always_accepts_when_p_covers_q_and_never_when_p_is_zero():
    sure = VerifyOutcome(target_probs=[0.5, 0.9], recovery_ids=[7, 8], bonus_id=9)
    never = VerifyOutcome(target_probs=[0.0, 0.9], recovery_ids=[7, 8], bonus_id=9)
    for seed in range(50):
        assert accept_sampled([1, 2], [0.5, 0.3], sure, seed, 0).emitted_ids == [1, 2, 9]
        assert accept_sampled([1, 2], [0.5, 0.3], never, seed, 0).emitted_ids == [7]


def test_accept_sampled_refuses_a_round_whose_parts_disagree_in_length_or_a_q_of_zero():
    outcome = VerifyOutcome(target_probs=[0.5, 0.9], recovery_ids=[7, 8], bonus_id=9)
    with pytest.raises(ValueError, match="2 drafts"):
        accept_sampled([1, 2], [0.5], outcome, 0, 0)
    with pytest.raises(ValueError, match="3 drafts"):
        accept_sampled([1, 2, 3], [0.5, 0.3, 0.2], outcome, 0, 0)
    with pytest.raises(ValueError, match="q\\(x\\) = 0.0"):
        accept_sampled([1, 2], [0.0, 0.3], outcome, 0, 0)
    with pytest.raises(ValueError, match="2 accept uniforms"):
        accept_sampled([1, 2], [0.5, 0.3], outcome, 0, 0, accept_uniforms=[0.1])


def test_draw_draft_uses_its_own_stream():
    q = SparseDist.from_lists([3, 5, 8], [0.2, 0.5, 0.3])
    for seed in range(20):
        u = uniform(seed, 12, Stream.DRAFT)
        assert draw_draft(q, seed, 12) == sample(q, u)


def test_own_invariants_are_asserted():
    logits = torch.zeros(3, 4)
    q = SparseDist.from_lists([0], [1.0])
    with pytest.raises(AssertionError):
        score_drafts(logits, [0], [q], SamplingParams(), 0, 0)  # k + 1 != 3 rows
    with pytest.raises(AssertionError):
        score_drafts(logits, [0, 0], [q], SamplingParams(), 0, 0)  # one q missing
    with pytest.raises(AssertionError):
        accept_greedy([1, 2], [1, 2])


def test_the_target_scores_drafts_with_p_normalized_as_target_only_decoding_draws_it():
    """A float32 softmax over Qwen's 152064 ids sums to 1 only within ~2e-5;
    target-only decoding draws from p / sum(p), so the round's accept test
    (p(x) / q(x)) and residual use that p too: with the raw p the round's law
    differed from the target's by a total variation of ~8e-6, every round."""
    from specdec.sampling.sparse import truncate

    torch.manual_seed(0)
    vocab = 152064
    params = SamplingParams(0.7)
    logits = torch.randn(3, vocab) * 3
    p = logits_to_probs(logits, params).double()
    assert abs(p[0].sum().item() - 1) > 1e-6  # what the raw softmax gives
    normalized = p / p.sum(dim=-1, keepdim=True)
    drafts = [int(p[0].argmax()), int(p[1].argmax())]
    q = [truncate(logits_to_probs(logits[i:i + 1] + 0.1 * torch.randn(1, vocab), params)[0], 32) for i in range(2)]
    outcome = score_drafts(logits, drafts, q, params, seed=5, first_position=10)
    for i, x in enumerate(drafts):
        assert outcome.target_probs[i] == pytest.approx(normalized[i, x].item(), rel=1e-6)
        assert outcome.target_probs[i] != pytest.approx(p[i, x].item(), rel=1e-6)
