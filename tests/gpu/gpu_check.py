"""`make gpu-check`: what CPU tests cannot show, checked on ONE GPU in a few minutes.

    python3 tests/gpu/gpu_check.py                 # on a CUDA machine (exits 0 without one)
    python3 tests/gpu/gpu_check.py --cpu-dry-run   # same code paths, tiny shapes, gloo, on CPU

One numbered line per check (PASS / FAIL and the measured numbers), then a summary; the whole
log also goes to $OUT/gpu_check.log when OUT is set. Each check runs in its own try block, so
one failure does not hide the others. Exit status 1 when any check failed.

It uses the stable lower-level APIs (parallel.model / convert / optim / checkpoint / reshard and
the rollout engines) directly; only check 4 goes through the CLI. A single process builds a
world of one itself (`parallel.mesh.init_parallel`: NCCL on CUDA, gloo on CPU).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from tests.gpu.checks_attention import check_attention_backends, check_first_offload  # noqa: E402
from tests.gpu.checks_engine import check_engine_sync, check_memory_phases  # noqa: E402
from tests.gpu.checks_hybrid import check_hybrid_layers  # noqa: E402
from tests.gpu.checks_model import check_actor, check_parity  # noqa: E402
from tests.gpu.checks_moe import check_moe_routing_replay  # noqa: E402
from tests.gpu.checks_perf import check_cli_train_resume, check_throughput  # noqa: E402
from tests.gpu.checks_vision import check_vision_language  # noqa: E402
from tests.gpu.common import Context  # noqa: E402

CHECKS = [
    ("Megatron bf16 vs HF logits; HF -> Megatron -> HF round trip", check_parity),
    ("actor: distributed-optimizer steps, checkpoint resume, model-only resume", check_actor),
    ("weight sync into the rollout engine: log-prob agreement and GB/s", check_engine_sync),
    ("rlcli train recipes/quickstart.yaml in bf16, then automatic resume", check_cli_train_resume),
    ("actor throughput and MFU (Qwen2-0.5B / 1.5B shapes)", check_throughput),
    ("memory per phase over three RL cycles (no growth)", check_memory_phases),
    (
        "attention local / sdpa / sdpa + packing: MFU, peak memory, packed kernel",
        check_attention_backends,
    ),
    ("first offload at the pinned-copy floor (buffers reserved at build)", check_first_offload),
    (
        "MoE routing: bf16 engine vs trainer experts, log-prob gap without / with replay (R3, R2)",
        check_moe_routing_replay,
    ),
    (
        "hybrid layers (Qwen3.5 Gated DeltaNet + gated attention): fp32 / bf16 logits vs HF, grads",
        check_hybrid_layers,
    ),
    (
        "vision-language (Qwen2.5-VL): fp32 / bf16 logits vs HF with images, grads, HF engine",
        check_vision_language,
    ),
]


CHECK_TIMEOUT_S = 200  # one check; the whole run must stay under 8 minutes on one GPU


class CheckTimeout(Exception):
    pass


def _on_alarm(signum, frame) -> None:
    raise CheckTimeout(f"the check ran over {CHECK_TIMEOUT_S} s and was stopped")


class Log:
    """Prints and keeps every line, for $OUT/gpu_check.log."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def write(self, out_dir: str | None) -> None:
        if out_dir:
            Path(out_dir, "gpu_check.log").write_text("\n".join(self.lines) + "\n")


def _compact_traceback(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)[-4:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))
    return f"{type(error).__name__}: {str(error)[:600]} [at {where}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU (gloo)")
    parser.add_argument("--only", default="", help="comma-separated check numbers, e.g. 1,3")
    parser.add_argument(
        "--engine",
        choices=("auto", "vllm", "hf"),
        default="auto",
        help="rollout engine for checks 3, 4, 6 (auto: vllm where installed, else hf)",
    )
    parser.add_argument("--work-dir", default="", help="scratch folder (default: a temp dir)")
    args = parser.parse_args()
    log = Log()
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        log("gpu-check: no GPU (torch.cuda.is_available() is False): nothing checked.")
        log.write(os.environ.get("OUT"))
        return 0

    started = time.perf_counter()
    ctx = Context.create(
        cpu_dry_run=args.cpu_dry_run, work_dir=args.work_dir or None, log=log, engine=args.engine
    )
    log(ctx.describe())
    only = {int(n) for n in args.only.split(",") if n.strip()}
    results: list[tuple[int, str, bool]] = []
    for number, (name, check) in enumerate(CHECKS, start=1):
        if only and number not in only:
            continue
        t0 = time.perf_counter()
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(CHECK_TIMEOUT_S)
        try:
            ok, detail = check(ctx)
        except Exception as error:  # noqa: BLE001 - report and go on to the next check
            ok, detail = False, _compact_traceback(error)
        finally:
            signal.alarm(0)
            ctx.release_memory()
        status = "PASS" if ok else "FAIL"
        log(f"{number}. {status} {name} ({time.perf_counter() - t0:.1f} s): {detail}")
        results.append((number, name, ok))
        log.write(os.environ.get("OUT"))
    failed = [number for number, _, ok in results if not ok]
    log(
        f"summary: {len(results) - len(failed)}/{len(results)} checks passed"
        + (f", failed: {', '.join(map(str, failed))}" if failed else "")
        + f"; {time.perf_counter() - started:.0f} s in all"
    )
    log.write(os.environ.get("OUT"))
    ctx.close()
    return 1 if failed else 0


if __name__ == "__main__":  # the guard matters: dist_checkpointing's writer spawns a child
    sys.exit(main())
