"""Test-only reward that always fails, the way a mistyped ``reward.kwargs`` key would."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    raise TypeError(f"compute_score() got an unexpected keyword argument {sorted(kwargs)}")
