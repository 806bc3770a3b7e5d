"""``opd_harness.lazy.lazy_import``: a module stand-in that imports the module on first attribute read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from opd_harness.lazy import lazy_import


def test_the_module_is_imported_at_the_first_attribute_read_and_serves_every_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "lazy_probe_module.py").write_text("VALUE = 3\nCALLS = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_probe_module", raising=False)
    stand_in = lazy_import("lazy_probe_module")
    assert "lazy_probe_module" not in sys.modules
    try:
        assert stand_in.VALUE == 3
        assert stand_in.CALLS is sys.modules["lazy_probe_module"].CALLS
        with pytest.raises(AttributeError):
            _ = stand_in.MISSING
    finally:
        sys.modules.pop("lazy_probe_module", None)


def test_an_imported_module_is_returned_as_itself():
    import json

    assert lazy_import("json") is json
