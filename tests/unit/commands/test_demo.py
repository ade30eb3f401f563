from fleetrl.commands.demo import run


def test_demo_policy_learns_with_stale_samples():
    rewards = run(steps=30, loss="grpo", offpolicy=1, seed=0)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # Random guessing of 16 tokens scores ~1/16; the demo must clearly learn the target.
    assert first < 0.2
    assert last > first + 0.3


def test_demo_runs_on_policy_with_every_loss():
    for loss in ("ppo", "dapo", "cispo", "gspo", "reinforce", "importance_sampling", "dro"):
        rewards = run(steps=3, loss=loss, offpolicy=0, seed=1)
        assert len(rewards) == 3
