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



def test_inductors_own_autotune_switch_is_honoured_for_fp32_steps():
    """`TORCHINDUCTOR_MAX_AUTOTUNE=0` (torch's variable) builds fp32 steps without autotuning, unset they autotune;
    half precision always autotunes (its row invariance needs the GEMM templates). In a new process: the suite's
    own compiles run without autotuning (tests/conftest.py)."""
    import subprocess
    import sys

    code = ("import importlib, os; from hf_bpd.runtime import compiled, inlining; from torch._inductor import config\n"
            "os.environ.pop('TORCHINDUCTOR_MAX_AUTOTUNE', None); seen = [importlib.reload(inlining).INDUCTOR_OPTIONS]\n"
            "os.environ['TORCHINDUCTOR_MAX_AUTOTUNE'] = '0'; seen.append(importlib.reload(inlining).INDUCTOR_OPTIONS)\n"
            "compiled.INDUCTOR_OPTIONS = seen[-1]\n"
            "with compiled._Patches(ordered=True): ordered = config.max_autotune\n"
            "print(*[s['max_autotune'] for s in seen], ordered)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False", "True"]
