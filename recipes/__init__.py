"""The paper recipes of `harness reproduce`: one YAML file per paper, registered as entry points
(``opd_harness.recipes``); each entry point is the path of its file. The format is described in
``harness/reproduce.py``."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
F_OPD = HERE / "f-opd.yaml"
SOD = HERE / "sod.yaml"
SAF_OPD = HERE / "saf-opd.yaml"
AP_OPD = HERE / "ap-opd.yaml"
