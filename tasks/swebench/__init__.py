"""SWE-bench on offline per-instance Docker images (data, images, grading); see :mod:`opd_harness.tasks.swebench.task`."""
