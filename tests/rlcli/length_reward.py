"""A user reward function loaded by file path in the end-to-end tests (verl's signature).

Scores the number of digits in the response, so even a random model gets rewards that vary
within a group and every algorithm has a non-zero learning signal."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(ch.isdigit() for ch in solution_str)
    return {"score": digits / 10.0, "acc": float(str(ground_truth) in solution_str)}
