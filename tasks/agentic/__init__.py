"""The task kit for agentic benchmarks: environments and bases a benchmark module builds on.

``shell_env`` (a shell agent in a sandbox session, one command per turn, with turn/time/output budgets and its
metrics), ``shell_task`` (a sandboxed task whose episodes are shell-agent episodes, graded by a check run in the
episode's session), ``tool_env`` and ``tool_formats`` (a code-interpreter tool and its call formats), ``sandboxed``
(a task owning one sandbox it opens lazily). Benchmark specifics (prompts, outcomes, grading) stay in the benchmark.
"""
