"""Packaged bases split over numbered part packages (`hf_bpd.hub.gguf_parts`): joined in order, checked against the
pinned size and sha256, refused with one line naming the install command. The parts here are small fabricated
packages on `sys.path`, laid out as the real ones are (`<module>/data/partNN.bin`)."""

import hashlib
import importlib
import sys

import pytest

from hf_bpd import BaseModelError
from hf_bpd.cli import main
from hf_bpd.hub import base_models, gguf_parts
from hf_bpd.hub.locate import PACKAGED_ALIASES


def _packages(root, chunks, prefix="tinyparts_part"):
    for number, chunk in enumerate(chunks, start=1):
        data = root / f"{prefix}{number}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        (data / f"part{number:02d}.bin").write_bytes(chunk)
    return tuple(f"{prefix}{number}" for number in range(1, len(chunks) + 1))


@pytest.fixture
def parts(tmp_path, monkeypatch):
    chunks = [bytes(range(256)) * 40, b"GGUF middle" * 1000, b"tail"]
    root = tmp_path / "site"
    modules = _packages(root, chunks)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    joined = b"".join(chunks)
    return modules, joined, tmp_path


def test_parts_join_in_order_and_a_good_join_is_kept(parts):
    modules, joined, tmp = parts
    spec = gguf_parts.GGUFParts(modules, len(joined), hashlib.sha256(joined).hexdigest())
    target = spec.join(tmp / "cache" / "tiny.gguf", "tiny")
    assert target.read_bytes() == joined
    assert not list(target.parent.glob("*.partial"))
    mtime = target.stat().st_mtime_ns
    assert spec.join(target, "tiny") == target and target.stat().st_mtime_ns == mtime  # checked, not joined again


def test_a_wrong_sha256_is_refused_in_one_line_and_leaves_no_file(parts):
    modules, joined, tmp = parts
    spec = gguf_parts.GGUFParts(modules, len(joined), "0" * 64)
    with pytest.raises(BaseModelError) as err:
        spec.join(tmp / "cache" / "tiny.gguf", "tiny")
    message = str(err.value)
    assert "\n" not in message and "not the pinned 0000000000000000" in message
    assert message.endswith("reinstall it with `hf-bpd install-base tiny --force`")
    assert not list((tmp / "cache").iterdir())  # neither the target nor a partial file


def test_a_joined_file_changed_later_is_joined_again(parts):
    modules, joined, tmp = parts
    spec = gguf_parts.GGUFParts(modules, len(joined), hashlib.sha256(joined).hexdigest())
    target = spec.join(tmp / "cache" / "tiny.gguf", "tiny")
    target.write_bytes(joined[:-1] + b"X")  # same size, other bytes
    assert spec.join(target, "tiny").read_bytes() == joined


def test_a_missing_part_names_the_install_command(parts):
    modules, joined, tmp = parts
    spec = gguf_parts.GGUFParts(modules + ("tinyparts_part_absent",), len(joined), hashlib.sha256(joined).hexdigest())
    with pytest.raises(BaseModelError, match=r"part 4 of 4 \(tinyparts_part_absent\) is not installed: run "
                                             r"`hf-bpd install-base tiny`$"):
        spec.join(tmp / "cache" / "tiny.gguf", "tiny")


def test_a_packaged_base_in_parts_finds_its_parts_through_the_cache(parts, monkeypatch):
    modules, joined, tmp = parts
    monkeypatch.setenv("HF_BPD_CACHE", str(tmp / "hf_bpd_cache"))
    model = base_models._in_parts("tiny-in-parts", "org/tiny", "tinyparts-part", len(modules), len(joined),
                                  hashlib.sha256(joined).hexdigest())
    assert model.modules == modules
    assert model.gguf() == tmp / "hf_bpd_cache" / "gguf" / "tiny-in-parts.gguf"
    assert model.gguf().read_bytes() == joined


def test_every_packaged_base_is_pinned_with_wheel_hashes():
    for alias in PACKAGED_ALIASES:
        model = base_models.PACKAGED_MODELS[alias]
        lines = [line for line in gguf_parts.requirements_file(alias).read_text().splitlines()
                 if line and not line.startswith("#")]
        pinned = {line.split("==")[0] for line in lines}
        assert pinned == set(model.packages), alias
        assert all(" --hash=sha256:" in line and len(line.split("sha256:")[1]) == 64 for line in lines)
    qwen = base_models.PACKAGED_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert qwen.parts.size == 1_117_320_768 and len(qwen.modules) == 22
    assert qwen.pip_command() == "hf-bpd install-base qwen2.5-coder-1.5b-instruct"


def test_install_base_refuses_an_unknown_alias_before_pip(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["install-base", "qwen-7b"])
    assert exit_.value.code == 2 and "invalid choice: 'qwen-7b'" in capsys.readouterr().err
    assert "tinyparts_part1" not in sys.modules  # nothing was imported from the parts


def test_a_second_process_waits_for_a_conversion_under_way_and_finds_it_done(tmp_path):
    """Converting a packaged base takes its target's lock: a converter that finds the lock held waits, then finds the
    model complete (config.json, written last by the rename) and converts nothing."""
    import fcntl
    import os
    import threading

    class NeverConverted:  # reading its GGUF would mean converting a second time
        def gguf(self):
            raise AssertionError("converted although another process had finished")

    target = tmp_path / "models" / "tiny-alias"
    target.parent.mkdir()
    with open(target.parent / ".tiny-alias.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the first converter at work
        errors = []
        waiter = threading.Thread(target=lambda: errors.append(
            _run(base_models._convert_packaged, NeverConverted(), target)))
        waiter.start()
        waiter.join(timeout=1.5)
        assert waiter.is_alive()  # waiting on the lock
        target.mkdir()
        (target / "config.json").write_text("{}")
    waiter.join(timeout=10)
    assert not waiter.is_alive() and errors == [None]
    assert os.listdir(target) == ["config.json"]


def _run(function, *args):
    try:
        function(*args)
    except Exception as err:  # noqa: BLE001 - reported to the test thread
        return err
    return None
