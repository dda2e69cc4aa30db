"""hf_bpd's environment variables (`hf_bpd.environment`): at most four, each in one documented table, and
`HF_BPD_OFF` naming the machine-specific paths to turn off."""

import re
import warnings
from pathlib import Path

import pytest

from hf_bpd import environment

ROOT = Path(__file__).resolve().parents[1]


def test_the_library_reads_at_most_four_variables_all_documented():
    names = {m for path in (ROOT / "hf_bpd").rglob("*") if path.suffix in (".py", ".cpp", ".h")
             for m in re.findall(r"HF_BPD_[A-Z0-9_]+", path.read_text())}
    assert len(names) <= 4, sorted(names)
    table = (ROOT / "docs" / "reliability.md").read_text()
    for name in names:
        assert f"| `{name}` |" in environment.__doc__ and f"| `{name}` |" in table, name
    for path in environment.PATHS:
        assert f"`{path}`" in table, path


def test_off_reads_a_comma_separated_list_and_warns_once_about_an_unknown_name(monkeypatch):
    monkeypatch.setattr(environment, "_WARNED", set())
    monkeypatch.setenv("HF_BPD_OFF", " amx , artifacts,,turbo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert environment.off("amx") and environment.off("artifacts") and not environment.off("kernels")
    assert len([w for w in caught if "'turbo'" in str(w.message)]) == 1
    monkeypatch.setenv("HF_BPD_OFF", "")
    assert not any(environment.off(path) for path in environment.PATHS)
    with pytest.raises(KeyError, match="no machine-specific path 'amx-tiles'"):
        environment.off("amx-tiles")
