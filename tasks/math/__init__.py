"""Real math benchmarks (MATH500, AIME, AMC23, OlympiadBench, Minerva, GSM8K) and the DAPO-Math training prompts.

Loaded from local files or the Hugging Face hub, validated row by row and graded with math-verify;
see :mod:`opd_harness.tasks.math.benchmarks`.
"""
