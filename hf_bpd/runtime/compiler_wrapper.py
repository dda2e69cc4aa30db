"""The body of the compiler wrapper script `hf_bpd.runtime.inlining` writes into the cache in use
(`$HF_BPD_CACHE/toolchain/hf_bpd-g++`); it runs as its own program (`python -I -S`, standard library only), so this
module imports nothing from hf_bpd and does nothing on import.

For each compile inductor runs, the wrapper:
- adds `INLINE_FLAGS` (GCC's raised inlining limits) to every source except an AOTInductor runner (`*.wrapper.cpp`);
- serves the source's first include, when it is one of torch's inductor headers (`cpp_prefix.h` for kernels,
  `aoti_include/cpu.h` for runners), from a precompiled header: parsing torch's headers is most of a small kernel's
  compile (a kernel 4.0 -> 1.1 s, a runner 11.1 -> 7.8 s; the objects are byte-identical). A header is precompiled
  with exactly the compile's own flags (less its files and link options), once per distinct flag set, on the second
  compile that would use it (a cache that compiles once does not pay the ~9 s), and kept under the toolchain folder
  for this compiler, torch and CPU (`main`'s `pch_root`). GCC checks every precompiled header against the compile
  and silently parses the real header when it does not match, so a stale or foreign file costs time, never a
  different result.
"""

import hashlib
import os
import re
import subprocess
import sys

SOURCE_SUFFIXES = (".cpp", ".cc", ".cxx")
OTHER_INPUTS = (".o", ".so", ".a", ".S", ".s", ".c")
FIRST_INCLUDE = re.compile(r"\s*#include\s*<(torch/csrc/inductor/[\w/.]+\.h)>")


def first_header(source: str) -> str | None:
    """The header `source` includes before any other code, when it is one of torch's inductor headers."""
    try:
        with open(source, encoding="utf-8", errors="replace") as f:
            head = f.read(4096)
    except OSError:
        return None
    for line in head.splitlines():
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        match = FIRST_INCLUDE.match(line)
        return match.group(1) if match else None
    return None


def header_flags(args: list[str]) -> list[str]:
    """The compile's flags that shape a precompiled header: `args` less its inputs, its output and link options."""
    flags, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "-o":
            skip = True
        elif arg in ("-c", "-shared") or arg.startswith(("-l", "-L", "-Wl,")):
            continue  # link options
        elif not arg.startswith("-") and arg.endswith(SOURCE_SUFFIXES + OTHER_INPUTS):
            continue  # an input file
        else:
            flags.append(arg)
    return flags


def include_folders(flags: list[str]) -> list[str]:
    """The `-I` folders of `flags`, in order (`-Ifolder` or `-I folder`)."""
    folders = []
    for i, flag in enumerate(flags):
        if flag.startswith("-I"):
            folder = flag[2:] or (flags[i + 1] if i + 1 < len(flags) else "")
            if folder:
                folders.append(folder)
    return folders


def precompiled_include(compiler: str, args: list[str], pch_root: str) -> list[str]:
    """`["-I", folder]` of a valid-looking precompiled header for this compile's first include (built here when the
    same flags compile a second time), or [] to compile as usual."""
    sources = [a for a in args if a.endswith(SOURCE_SUFFIXES) and not a.startswith("-")]
    if len(sources) != 1 or "-o" not in args:
        return []
    header = first_header(sources[0])
    if header is None:
        return []
    flags = header_flags(args)
    key = hashlib.sha256("\0".join([header, *flags]).encode()).hexdigest()[:24]
    folder = os.path.join(pch_root, key)
    beside = os.path.join(folder, header)  # the real header's link, beside its precompiled form
    pch = beside + ".gch"
    if os.path.isfile(pch) and os.path.islink(beside):
        return ["-I", folder]
    seen = os.path.join(folder, "seen")
    if not os.path.exists(seen):  # the first compile with these flags: mark them, compile as usual
        os.makedirs(folder, mode=0o700, exist_ok=True)
        open(seen, "w").close()
        return []
    found = next((os.path.join(d, header) for d in include_folders(flags) if os.path.isfile(os.path.join(d, header))),
                 None)
    if found is None or os.path.exists(os.path.join(folder, "failed")):
        return []
    partial = f"{pch}.{os.getpid()}.partial"
    try:
        os.makedirs(os.path.dirname(pch), mode=0o700, exist_ok=True)
        done = subprocess.run([compiler, *flags, "-x", "c++-header", found, "-o", partial],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        if done.returncode != 0:
            open(os.path.join(folder, "failed"), "w").close()
            return []
        # GCC records the header as found beside its precompiled form: a later `#include` of it (kernel files
        # include it once per kernel, under `#pragma once`) must find the same file there
        link = f"{beside}.{os.getpid()}.partial"
        os.symlink(found, link)
        os.replace(link, beside)
        os.replace(partial, pch)
        return ["-I", folder]
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def main(argv: list[str], compiler: str, inline_flags: list[str], runner_source: str, pch_root: str):
    """Run `compiler` on `argv` with the inlining flags and a precompiled header where they apply (see above)."""
    args = list(argv)
    if not any(a.endswith(runner_source) for a in args):
        args += inline_flags
    try:
        args = precompiled_include(compiler, args, pch_root) + args
    except Exception:  # noqa: BLE001 - anything failing (a folder, the header's build): compile without it, slower
        pass
    os.execvp(compiler, [compiler, *args])


if __name__ == "__main__":
    sys.exit("run through the script hf_bpd.runtime.inlining writes, not directly")
