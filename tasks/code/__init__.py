"""Code benchmarks graded in a sandbox: HumanEval+ and MBPP+ (:mod:`opd_harness.tasks.code.evalplus`) and LiveCodeBench
(:mod:`opd_harness.tasks.code.livecodebench`). Model-written code never runs in the harness process."""
