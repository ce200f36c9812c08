"""`make benchmark` (`python -m benchmarks`): what rlcli costs, next to what a user would write instead
and next to the physical floor, on whatever hardware is present.

    __main__.py   the command line (quick set by default; --full, --smoke, --section, --output-dir)
    run.py        orchestration: one fresh process per section, results -> JSON / Markdown / PNG
    plan.py       what a run will do and about how long, said before it starts
    lifetime.py   no process outlives the benchmark (process groups, parent-death signals)
    sections.py   the sections (device, rollout, sync, train, grpo), runnable as a child process
    grpo.py       the grpo section: a short real trainer run, then plain_loop.py on its model
    sync_section.py the sync section: sync_bench.py per model size and layout, in its own process
    plain_loop.py the simplest GRPO loop a user could write (HF generate + AdamW)
    workload.py   the fixed workloads (smoke / cpu / gpu) and the random HF models they use
    hardware.py   device name, peak FLOP/s table, measured matmul FLOP/s, load average
    memory.py     peak memory of one phase (RSS high-water mark on CPU, CUDA allocator on GPU)
    report.py     Markdown table and matplotlib chart from the result JSON
    sync_bench.py weight sync: bucketed resharding vs naive per-tensor path vs memcpy floor
"""
