"""Benchmark tasks: data loading with schema checks, prompts, environments and graders.

Concrete tasks live in sub-modules and register in ``opd_harness.registry.TASKS``; the shared base
classes are in :mod:`opd_harness.task`.
"""
