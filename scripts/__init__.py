"""Scripts of the repository: ``gpu-check.sh``, ``gpu-suites.sh`` and the harnesses they run."""
