"""Code benchmarks graded in a sandbox: HumanEval+ and MBPP+ (:mod:`tasks.code.evalplus`) and LiveCodeBench
(:mod:`tasks.code.livecodebench`). Model-written code never runs in the harness process."""
