"""KenLM for the n-gram rescorer: where it is installed, its compiled p-best fast path, and building models.

`build_ngram` tokenises text with the base tokenizer, writes one line of token ids per document (each id a word) and
runs KenLM's `lmplz` and `build_binary`. KenLM lives in `$HF_BPD_CACHE/kenlm` (default `~/.cache/hf_bpd/kenlm`):
`bash install.sh` builds `lmplz` and `build_binary` from the kenlm sdist there, plus the static libraries that
`csrc/ngram_pbest.cpp` (the compiled p-best search of `hf_bpd.rescorers.ngram`) links against;
`$HF_BPD_KENLM_BIN` points at another directory of KenLM binaries.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import BPDConfigError, BPDError
from ..hub.locate import cache_dir

SETUP_HINT = "run `bash install.sh` in the hf_bpd repository"
BUILD_HINT = "build one with hf_bpd.build_ngram(...) or `python training/build_ngram.py`"
_SOURCE = Path(__file__).parent / "csrc" / "ngram_pbest.cpp"
# -ffp-contract=off: no fused multiply-add, so scores match the Python path to the last bit.
_CXXFLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fvisibility=hidden", "-DNDEBUG",
             "-DKENLM_MAX_ORDER=6"]
_LIBS = ["-lkenlm", "-lkenlm_util", "-lz", "-lbz2", "-llzma", "-pthread", "-Wl,--exclude-libs,ALL"]


class NgramError(BPDError):
    """An n-gram model is missing or corrupt, or KenLM failed."""


class KenLMNotFoundError(NgramError):
    """KenLM's programs or libraries are not installed."""


# ----------------------------------------------------------------------------------------------------------------
# KenLM installation


def kenlm_dir() -> Path:
    """Where `install.sh` builds KenLM: `src/` (the sdist), `build/bin/`, `build/lib/`, and `lib/` (ours)."""
    return cache_dir() / "kenlm"


def kenlm_binary(name: str) -> Path:
    """Path of a KenLM program (`lmplz`, `build_binary`): `$HF_BPD_KENLM_BIN`, else the cache, else `PATH`."""
    override = os.environ.get("HF_BPD_KENLM_BIN")
    if override:
        found = Path(override) / name
        if found.is_file() and os.access(found, os.X_OK):
            return found
        raise KenLMNotFoundError(f"KenLM's {name} is not in HF_BPD_KENLM_BIN={override}: point it at KenLM's "
                                 f"bin directory, or unset it and {SETUP_HINT}")
    built = kenlm_dir() / "build" / "bin" / name
    if built.is_file() and os.access(built, os.X_OK):
        return built
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    raise KenLMNotFoundError(f"KenLM's {name} is not installed (looked in {built.parent} and PATH): {SETUP_HINT}")


def fast_path_file() -> Path:
    """The compiled rescorer for this version of `csrc/ngram_pbest.cpp` (its hash is in the file name)."""
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_CXXFLAGS + _LIBS).encode()).hexdigest()[:16]
    return kenlm_dir() / "lib" / f"libhf_bpd_ngram-{digest}.so"


def build_fast_path(force: bool = False) -> Path:
    """Compile `csrc/ngram_pbest.cpp` against KenLM's sources and static libraries (built by `install.sh`)."""
    target = fast_path_file()
    if target.exists() and not force:
        return target
    src, libs = kenlm_dir() / "src", kenlm_dir() / "build" / "lib"
    if not (src / "lm" / "model.hh").exists() or not (libs / "libkenlm.a").exists():
        raise KenLMNotFoundError(f"KenLM's sources and static libraries are not in {kenlm_dir()}: {SETUP_HINT}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    command = [os.environ.get("CXX", "g++"), *_CXXFLAGS, f"-I{src}", str(_SOURCE), "-o", str(partial), f"-L{libs}",
               *_LIBS]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or ["?"]
        raise NgramError(f"compiling {_SOURCE.name} failed: {errors[0].strip()}")
    os.replace(partial, target)
    return target


_library = None



def load_fast_path():
    """The compiled rescorer as a `ctypes.CDLL`, or `None` if it is not built (see `build_fast_path`)."""
    global _library
    if _library is None:
        path = fast_path_file()
        if not path.exists():
            return None
        from ..hub.locate import trust_problem

        if trust_problem(path) is not None:  # native code only from this user's own cache
            return None
        lib = ctypes.CDLL(str(path))
        ptr, cint = ctypes.c_void_p, ctypes.c_int
        lib.bpd_ngram_load.argtypes = [ctypes.c_char_p, ctypes.c_char_p, cint]
        lib.bpd_ngram_load.restype = ptr
        lib.bpd_ngram_free.argtypes = [ptr]
        lib.bpd_ngram_free.restype = None
        lib.bpd_ngram_order.argtypes = [ptr]
        lib.bpd_ngram_order.restype = cint
        lib.bpd_ngram_pbest.argtypes = [ptr, ptr, cint, ptr, ptr, ptr, cint, cint, cint, cint, ptr, ptr,
                                        ctypes.c_char_p, cint]
        lib.bpd_ngram_pbest.restype = cint
        _library = lib
    return _library

def _one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 200 else text[:197] + "..."

def _load_python_model(path: Path):
    import kenlm

    config = kenlm.Config()
    config.show_progress = False
    try:
        return kenlm.Model(str(path), config)
    except Exception as err:  # noqa: BLE001 - KenLM raises OSError/RuntimeError/... with multi-line messages
        raise NgramError(f"{path} is not a KenLM model ({_one_line(err)}): {BUILD_HINT}") from None

# ----------------------------------------------------------------------------------------------------------------
# Building a model


def _run(command: list, what: str) -> None:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True)
    if done.returncode != 0:
        if "--discount_fallback" in done.stderr:
            raise NgramError(f"{what} could not estimate Kneser-Ney discounts (a tiny or artificial corpus): pass "
                             "discount_fallback=True (--discount-fallback)")
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()] or [f"exit {done.returncode}"]
        reason = next((line for line in reversed(lines) if "rror" in line or "xception" in line), lines[-1])
        raise NgramError(f"{what} failed: {_one_line(Exception(reason))}")


def _text_batches(source, json_field: str, batch_size: int):
    """An iterator over batches of text lines from text/JSON(L) files (read with `datasets`) or a `Dataset` column.

    Checks the files now, not when iterated."""
    import datasets

    if isinstance(source, (datasets.Dataset, datasets.IterableDataset)):
        dataset = source
    else:
        files = [str(f) for f in ([source] if isinstance(source, (str, os.PathLike)) else source)]
        for f in files:
            if not Path(f).is_file():
                raise NgramError(f"no text file {f}: pass existing .txt/.txt.gz/.json/.jsonl files")
        stem = [f[:-3] if f.endswith((".gz", ".xz")) else f[:-4] if f.endswith(".bz2") else f for f in files]
        kind = "json" if all(s.endswith((".json", ".jsonl")) for s in stem) else "text"
        dataset = datasets.load_dataset(kind, data_files=files, split="train", streaming=True)
        if kind == "text":
            json_field = "text"

    def batches():
        for batch in dataset.iter(batch_size=batch_size):
            if json_field not in batch:
                raise NgramError(f"the data has no field {json_field!r} (fields: {', '.join(batch)}): pass "
                                 "json_field=")
            yield batch[json_field]

    return batches()


def write_token_ids(text_files_or_dataset, tokenizer, output_path, json_field: str = "text",
                    max_lines: int | None = None, strip_wiki_markup: bool = False, batch_size: int = 1000,
                    progress: bool = True) -> tuple[int, int]:
    """Tokenise text (see `build_ngram`) into `output_path`: a line of space-separated token ids per non-empty line.

    Returns `(lines, tokens)` written.
    """
    from tqdm.auto import tqdm

    lines = tokens = 0
    batches = _text_batches(text_files_or_dataset, json_field, batch_size)
    with open(output_path, "w") as out, tqdm(desc="tokenising", unit=" lines", disable=not progress) as bar:
        for batch in batches:
            batch = [t.strip() for t in batch if t and t.strip()]
            if strip_wiki_markup:
                batch = [t for t in batch if not (t.startswith("<doc ") or t == "</doc>")]
            if max_lines is not None:
                batch = batch[: max_lines - lines]
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"] if batch else []:
                out.write(" ".join(map(str, ids)) + "\n")
                tokens += len(ids)
            lines += len(batch)
            bar.update(len(batch))
            if max_lines is not None and lines >= max_lines:
                break
    return lines, tokens


def _check_build_options(order, binary_type, quantize) -> tuple[Path, Path]:
    """Validate `build_ngram`'s options; returns the paths of `lmplz` and `build_binary`."""
    if isinstance(order, bool) or not isinstance(order, int) or not 2 <= order <= 5:
        raise BPDConfigError(f"order must be an integer in [2, 5], got {order!r}")
    if binary_type not in ("trie", "probing"):
        raise BPDConfigError(f"binary_type must be 'trie' or 'probing', got {binary_type!r}")
    if quantize is not None and (binary_type != "trie" or not 2 <= quantize <= 25):
        raise BPDConfigError(f"quantize must be a bit count in [2, 25] with binary_type='trie', got {quantize!r}")
    return kenlm_binary("lmplz"), kenlm_binary("build_binary")


def build_ngram_from_ids(token_file, output_path, order: int = 4, prune=None, memory: str = "1G",
                         discount_fallback: bool = False, binary_type: str = "trie",
                         quantize: int | None = None) -> Path:
    """`lmplz` + `build_binary` on a file of token-id lines (as `write_token_ids` writes); see `build_ngram`."""
    lmplz, build_binary = _check_build_options(order, binary_type, quantize)
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hf_bpd_ngram_", dir=output_path.parent) as tmp:
        arpa, partial = Path(tmp) / "model.arpa", Path(tmp) / "model.bin"
        command = [lmplz, "-o", order, "-S", memory, "-T", f"{tmp}/", "--text", token_file, "--arpa", arpa]
        if prune:
            command += ["--prune", *(prune.split() if isinstance(prune, str) else prune)]
        if discount_fallback:
            command.append("--discount_fallback")
        _run(command, "lmplz")
        with arpa.open() as f:
            arpa_header = [next(f) for _ in range(order + 3)]
        command = [build_binary, "-S", memory, "-T", f"{tmp}/"]
        if quantize is not None:
            command += ["-q", quantize, "-b", quantize, "-a", 22]
        _run([*command, binary_type, arpa, partial], "build_binary")
        os.replace(partial, output_path)
    info_path(output_path).unlink(missing_ok=True)
    write_info(output_path, order=order, ngram_counts=_arpa_counts(arpa_header), binary_type=binary_type,
               quantize=quantize, prune=prune, sha256=file_sha256(output_path))
    return output_path


def file_sha256(path) -> str:
    """Hex sha256 of a file (read in 16 MiB chunks): recorded when an n-gram is built or bundled, checked on load."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _arpa_counts(header: list[str]) -> list[int]:
    """N-gram counts per order from an ARPA file's `\\data\\` section (`ngram 1=...` lines)."""
    return [int(line.split("=")[1]) for line in header if line.startswith("ngram ")]


def info_path(model_path) -> Path:
    """The JSON next to a model that `build_ngram` writes: order, n-gram counts per order, lines, tokens."""
    return Path(f"{model_path}.json")


def write_info(model_path, **info) -> None:
    path = info_path(model_path)
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **info}, indent=1) + "\n")


def build_ngram(text_files_or_dataset, tokenizer, output_path, order: int = 4, prune=None, memory: str = "1G",
                discount_fallback: bool = False, binary_type: str = "trie", quantize: int | None = None,
                json_field: str = "text", max_lines: int | None = None, strip_wiki_markup: bool = False,
                progress: bool = True) -> Path:
    """Train a KenLM n-gram over the base tokenizer's token ids and write it as a KenLM binary.

    Args:
        text_files_or_dataset: text files (one document or paragraph per line; `.gz` fine), JSON/JSONL files (the
            `json_field` of each record), or a `datasets.Dataset` with a `json_field` column.
        tokenizer: the base model's tokenizer (special tokens are not added).
        output_path: the `.bin` to write.
        order: n-gram order, 2-5.
        prune: `lmplz --prune` count thresholds per order, e.g. `[0, 0, 1]` (None: no pruning).
        memory: `lmplz -S` (and `build_binary -S`), e.g. `"1G"` or `"20%"`; lmplz's own default takes 80 % of RAM.
        discount_fallback: `lmplz --discount_fallback`, needed for tiny or artificial corpora.
        binary_type: `"trie"` (small) or `"probing"` (fastest, larger).
        quantize: with a trie, quantise probabilities and backoffs to this many bits (`-q Q -b Q -a 22`).
        max_lines: stop after this many non-empty lines.
        strip_wiki_markup: drop WikiExtractor's `<doc ...>` / `</doc>` lines.
    Returns:
        `output_path`. Beside it, `<output_path>.json` records the order, the n-gram counts per order, the lines
        and tokens read, the tokenizer's size (`vocab_size`, checked against the base a rescorer serves) and the
        binary's `sha256` (checked whenever the model is loaded, so a truncated or garbled file is an error, not a
        crash inside KenLM).
    """
    _check_build_options(order, binary_type, quantize)  # fail before tokenising, not after
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hf_bpd_ngram_", dir=output_path.parent) as tmp:
        corpus = Path(tmp) / "tokens.txt"
        lines, tokens = write_token_ids(text_files_or_dataset, tokenizer, corpus, json_field, max_lines,
                                        strip_wiki_markup, progress=progress)
        if tokens == 0:
            raise NgramError("no text to train the n-gram on: the input is empty")
        build_ngram_from_ids(corpus, output_path, order, prune, memory, discount_fallback, binary_type, quantize)
    write_info(output_path, lines=lines, tokens=tokens, tokenizer=getattr(tokenizer, "name_or_path", None),
               vocab_size=len(tokenizer))
    return output_path


# ----------------------------------------------------------------------------------------------------------------
# Command line: `hf-bpd build-ngram` (add_parser) and training/build_ngram.py (cli_build_ngram)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="base model (alias, directory, Hub id) or heads checkpoint whose tokenizer to use")
    parser.add_argument("--text", nargs="+", required=True, metavar="FILE",
                        help="text files (.txt, .txt.gz: a line per document) or JSON/JSONL files")
    parser.add_argument("--json-field", default="text", help="field of each JSON record holding the text")
    parser.add_argument("--order", type=int, default=4, help="n-gram order (2-5)")
    parser.add_argument("--prune", type=int, nargs="+", default=None, metavar="N",
                        help="lmplz --prune count thresholds per order, e.g. 0 0 1 (default: no pruning)")
    parser.add_argument("--memory", default="1G", help="lmplz -S memory, e.g. 1G or 20%%")
    parser.add_argument("--max-lines", type=int, default=None, help="use only the first N non-empty lines (default: all)")
    parser.add_argument("--wikipedia", action="store_true", help="drop WikiExtractor <doc ...>/</doc> lines")
    parser.add_argument("--discount-fallback", action="store_true", help="lmplz --discount_fallback (tiny corpora)")
    parser.add_argument("--binary-type", default="trie", choices=["trie", "probing"],
                        help="KenLM binary layout: trie (small) or probing (fastest, larger)")
    parser.add_argument("--quantize", type=int, default=None, metavar="BITS", help="trie quantisation, e.g. 8 (default: none)")
    parser.add_argument("--output", required=True, metavar="FILE.bin", help="the KenLM binary to write")


def cmd_build_ngram(args: argparse.Namespace) -> int:
    from ..hub.base_models import load_tokenizer

    _check_build_options(args.order, args.binary_type, args.quantize)  # fail before loading a tokenizer
    for f in args.text:
        if not Path(f).is_file():
            raise NgramError(f"no text file {f}: pass existing .txt/.txt.gz/.json/.jsonl files with --text")
    if args.max_lines is not None and args.max_lines < 1:
        raise BPDConfigError(f"--max-lines must be >= 1, got {args.max_lines}")
    if Path(args.output).is_dir():
        raise BPDConfigError(f"--output {args.output} is a directory: pass a file name such as lm.bin")

    path = build_ngram(args.text, load_tokenizer(args.model), args.output, order=args.order, prune=args.prune,
                       memory=args.memory, discount_fallback=args.discount_fallback, binary_type=args.binary_type,
                       quantize=args.quantize, json_field=args.json_field, max_lines=args.max_lines,
                       strip_wiki_markup=args.wikipedia)
    info = json.loads(info_path(path).read_text())
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): {info['tokens']:,} tokens, "
          f"{sum(info['ngram_counts']):,} n-grams (per order: {info['ngram_counts']})", file=sys.stderr)
    return 0


def add_parser(subparsers, **kwargs) -> argparse.ArgumentParser:
    """Add `build-ngram` to an `argparse` subparsers object (as `hf-bpd` does; `kwargs` go to `add_parser`)."""
    parser = subparsers.add_parser("build-ngram", help="train a KenLM n-gram over the base tokenizer's token ids",
                                   description=build_ngram.__doc__.splitlines()[0], **kwargs)
    add_arguments(parser)
    parser.set_defaults(func=cmd_build_ngram)
    return parser


def cli_build_ngram(argv: list[str] | None = None) -> int:
    """`python training/build_ngram.py ...`: one-line errors, exit status 2."""
    parser = argparse.ArgumentParser(prog="build_ngram", description=build_ngram.__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_build_ngram(args)
    except (BPDError, OSError) as err:
        print(f"build_ngram: error: {_one_line(err)}", file=sys.stderr)
        return 2
