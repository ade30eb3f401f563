from fleetrl.gateway.groups import assemble_group, drop_uniform_rewards
from fleetrl.rollout import RolloutSample


def s(reward, versions=None, mask=(0, 1, 1)):
    return RolloutSample([1, 2, 3], [0.0, -0.1, -0.2], list(mask), reward, versions=versions)


def test_drops_none_errors_and_invalid_and_counts_them():
    results = [s(1.0), None, ValueError("boom"), s(0.0, mask=(0, 0, 0)), "text", s(0.5)]
    g = assemble_group(3, 1, results)
    assert g.accepted and len(g.group.samples) == 2
    assert g.dropped == {"none": 1, "error": 1, "invalid": 2}


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
