"""SWE-bench on offline per-instance Docker images (data, images, grading); see :mod:`tasks.swebench.task`."""
