import pytest

from fleetrl.gateway.assembly import assemble_group
from fleetrl.gateway.dynamic_filter import PromptGroup, drop_uniform_rewards
from fleetrl.rollout import RolloutReturnTypeError, RolloutRun, RolloutSample, RolloutSegment


def s(reward, versions=None, mask=(0, 1, 1)):
    return RolloutSample([1, 2, 3], [0.0, -0.1, -0.2], list(mask), reward, versions=versions)


def test_drops_none_errors_and_invalid_and_counts_them():
    results = [s(1.0), None, ValueError("boom"), s(0.0, mask=(0, 0, 0)), s(0.5)]
    g = assemble_group(3, 1, results)
    assert g.accepted and len(g.group.samples) == 2
    assert g.dropped == {"none": 1, "error": 1, "invalid": 1}


def test_an_unknown_return_type_stops_with_the_type_named():
    with pytest.raises(RolloutReturnTypeError, match=r"returned builtins\.dict; it must return a RolloutSample"):
        assemble_group(3, 1, [s(1.0), {"tokens": [1, 2]}])


def test_a_rollout_run_becomes_its_samples_and_a_bad_segment_is_dropped_as_invalid():
    run = RolloutRun([RolloutSegment([1, 2], [0.0, -0.1], [0, 1]), RolloutSegment([7, 8], [0.0, -0.3], [0, 1])], 0.5)
    g = assemble_group(3, 1, [run, s(1.0), RolloutRun([], 1.0)])
    assert [x.tokens for x in g.group.samples] == [[1, 2], [7, 8], [1, 2, 3]]
    assert g.group.rewards == [0.5, 0.5, 1.0] and g.dropped == {"invalid": 1}
    assert [x.member for x in g.group.samples] == [0, 0, None]  # one trajectory: one member, one advantage
    alone = assemble_group(3, 1, [run, None])  # two samples, but of one trajectory: no relative signal
    assert not alone.accepted and alone.reason == "only 2 valid samples from 1 trajectories (need 2)"


def test_the_dynamic_filter_gets_a_prompt_group_and_a_bare_list_filter_still_works():
    seen: list[PromptGroup] = []

    def cookbook_filter(pg: PromptGroup) -> bool:
        seen.append(pg)
        return len(set(pg.rewards)) > 1

    g = assemble_group(4, 0, [s(1.0), s(0.0)], dynamic_filter=cookbook_filter, row={"q": "2+2"})
    assert g.accepted and seen[0].rewards == [1.0, 0.0] and seen[0].row == {"q": "2+2"} and seen[0].row_id == 4
    assert len(seen[0].samples) == 2
    legacy = lambda samples: len({x.reward for x in samples}) > 1  # noqa: E731 (a filter over a bare list)
    assert not assemble_group(0, 0, [s(1.0), s(1.0)], dynamic_filter=legacy).accepted


def test_too_few_samples_and_dynamic_filter_reject():
    assert assemble_group(0, 0, [s(1.0), None]).reason == "only 1 valid samples (need 2)"
    g = assemble_group(0, 0, [s(1.0), s(1.0)], dynamic_filter=drop_uniform_rewards)
    assert not g.accepted and g.reason == "dynamic filter"
    assert assemble_group(0, 0, [s(1.0), s(0.0)], dynamic_filter=drop_uniform_rewards).accepted


def test_min_version_uses_generated_tokens_only():
    g = assemble_group(0, 5, [s(1.0, versions=[0, 4, 5]), s(0.0, versions=[0, 5, 5])])
    assert g.min_version == 4  # the prompt token's version 0 does not count
    assert assemble_group(0, 5, [s(1.0), s(0.0)]).min_version == 5


def test_samples_longer_than_max_seq_len_are_dropped_and_counted():
    long = RolloutSample([1, 2, 3, 4, 5], [0.0, -0.1, -0.2, -0.3, -0.4], [0, 1, 1, 1, 1], 1.0)
    g = assemble_group(0, 0, [s(1.0), s(0.0), long], max_seq_len=4)
    assert len(g.group.samples) == 2 and g.dropped == {"too_long": 1}


def test_token_ids_beyond_the_vocabulary_are_dropped_naming_the_bound():
    # Today a token id >= the model's vocabulary passes validation and kills the trainer's step ("index out of
    # range" in the embedding); the gateway knows the vocabulary and drops such a sample.
    bad = RolloutSample([1, 100512, 3], [0.0, -0.5, -0.5], [0, 1, 1], 1.0)
    out = assemble_group(7, 0, [s(1.0), s(0.0), bad], vocab_size=1000)
    assert out.accepted and len(out.group.samples) == 2 and out.dropped == {"invalid": 1}
    (why,) = out.group.dropped
    assert why.field_name == "tokens" and "100512 at 1 is >= the model's vocabulary size 1000" in why.message
    assert len(assemble_group(7, 0, [s(1.0), s(0.0), bad]).group.samples) == 3  # no bound known: not checked
