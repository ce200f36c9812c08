"""The torchrun helper's failure report: a worker's failing assertion, with its values, comes
first in the pytest report instead of being buried in (or cut from) the output's tail."""

from __future__ import annotations

from tests.parallel.dist_utils import first_traceback

OUTPUT = """[rlcli] building actor
Traceback (most recent call last):
  File "worker.py", line 30, in <module>
    main()
  File "worker.py", line 21, in main
    assert row["grad_diff"] < 1e-6, (mode, row)
AssertionError: ('token-mean', {'grad_diff': 0.25})
E1201 19:40:01 torch/distributed/elastic/multiprocessing/api.py: failed (exitcode: 1)
Traceback (most recent call last):
  File "torch/distributed/run.py", line 9, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_the_first_worker_traceback_is_picked_with_its_values():
    error = first_traceback(OUTPUT)
    assert error.splitlines()[0] == "Traceback (most recent call last):"
    assert error.splitlines()[-1] == "AssertionError: ('token-mean', {'grad_diff': 0.25})"
    assert "ChildFailedError" not in error


def test_no_traceback_gives_none():
    assert first_traceback("all fine\n") is None
