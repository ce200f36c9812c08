"""Test-only reward: every response scores 1.0. With ``algorithm.epsilon=0`` every GRPO group
then has advantage 0 / 0 = NaN, a reliable way to inject a non-finite loss."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
