"""The compiled step's C++ compiler (`hf_bpd.runtime.inlining`): GCC with raised inlining limits, so inductor's
GEMM micro-kernels of 5..8 rows keep their accumulators in registers. Same results, bit for bit."""

import contextlib
import os
import shlex
import subprocess
import sys

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor import cpp_builder

from hf_bpd.runtime import compiled as compiled_step, inlining

pytestmark = pytest.mark.autotune  # compiled as users compile (see tests/conftest.py)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path / "cache"))
    inlining.wrapper_in.cache_clear()
    yield tmp_path
    inlining.wrapper_in.cache_clear()


def gcc_here() -> bool:
    try:
        return cpp_builder._is_gcc(cpp_builder.get_cpp_compiler())
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(not gcc_here(), reason="inductor's compiler here is not GCC")
def test_the_wrapper_runs_gcc_with_the_inlining_flags(fresh):
    wrapper = inlining.inlining_compiler()
    assert wrapper is not None and wrapper.startswith(str(fresh / "cache" / "toolchain"))
    assert os.access(wrapper, os.X_OK) and "g++" in os.path.basename(wrapper)  # inductor still sees GCC
    text = open(wrapper).read()
    assert all(flag in text for flag in inlining.INLINE_FLAGS)
    assert "Free Software Foundation" in subprocess.run([wrapper, "--version"], capture_output=True,
                                                         text=True).stdout
    assert inlining.compiler_options() == {"cpp.cxx": (wrapper,)}
    for source, inlined in (("k.kernel.cpp", True), ("c.main.cpp", True), ("m.wrapper.cpp", False)):
        # `-###`: the driver prints the commands it would run (our flags included) and runs none
        shown = subprocess.run([wrapper, "-###", "-c", str(fresh / source), "-o", str(fresh / "out.o")],
                               capture_output=True, text=True).stderr
        assert ("max-inline-insns-single=2000" in shown) == inlined, (source, shown[-500:])
    os.remove(wrapper)  # a cleaned cache: written again, not a failing compile
    assert inlining.compiler_options() == {"cpp.cxx": (wrapper,)} and os.path.isfile(wrapper)


@pytest.mark.skipif(not gcc_here(), reason="inductor's compiler here is not GCC")
def test_the_wrapper_follows_the_cache_in_use(fresh, monkeypatch):
    """A process that used another cache for a while (`$HF_BPD_CACHE` set for one run, as tests do) goes back to the
    wrapper of the cache in use: its path is in inductor's cache keys, and native code runs from that cache only."""
    first = inlining.compiler_options()["cpp.cxx"][0]
    monkeypatch.setenv("HF_BPD_CACHE", str(fresh / "other"))
    assert inlining.compiler_options()["cpp.cxx"][0].startswith(str(fresh / "other" / "toolchain"))
    monkeypatch.setenv("HF_BPD_CACHE", str(fresh / "cache"))
    assert inlining.compiler_options()["cpp.cxx"][0] == first


def test_no_gcc_or_no_cache_keeps_the_default_compiler(fresh, monkeypatch):
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: "clang++")
    assert inlining.inlining_compiler() is None and inlining.compiler_options() == {}
    inlining.wrapper_in.cache_clear()
    monkeypatch.undo()
    blocked = fresh / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("HF_BPD_CACHE", str(blocked))  # the toolchain folder cannot be created
    assert inlining.inlining_compiler() is None and inlining.compiler_options() == {}


KERNEL = """
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(const float* in_ptr0, float* out_ptr0) {
    for (int i = 0; i < 64; i += 8) (at::vec::Vectorized<float>::loadu(in_ptr0 + i).exp()).store(out_ptr0 + i);
}
#include <torch/csrc/inductor/cpp_prefix.h>
"""


def text_section(library) -> bytes:
    """The machine code of a built library (its `.text`), without the debug records that name its folder."""
    out = library.with_suffix(".text")
    subprocess.run(["objcopy", "-O", "binary", "--only-section=.text", str(library), str(out)], check=True)
    return out.read_bytes()


@pytest.mark.skipif(not gcc_here(), reason="inductor's compiler here is not GCC")
def test_kernels_compile_from_a_precompiled_header_to_the_same_code(fresh):
    """inductor's own kernel command through the wrapper: the first compile with a flag set marks it, the second
    precompiles torch's inductor header and uses it (`-H` shows `!`), and every build's machine code equals plain
    GCC's; the header's second `#include` (kernel files include it once per kernel) still compiles."""
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    wrapper = inlining.inlining_compiler()
    options = CppTorchDeviceOptions(vec_isa=pick_vec_isa(), device_type="cpu")
    codes, shown = [], []
    for i, compiler in enumerate(["g++", wrapper, wrapper, wrapper]):
        folder = fresh / f"build{i}"
        folder.mkdir()
        source = folder / "k.main.cpp"
        source.write_text(KERNEL)
        command = CppBuilder(name="k", sources=str(source), BuildOption=options, output_dir=str(folder))
        args = shlex.split(command.get_command_line())[1:]
        if compiler == "g++":  # plain GCC with the flags the wrapper adds, to compare like with like
            args += list(inlining.INLINE_FLAGS)
        done = subprocess.run([compiler, *args, "-H"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        codes.append(text_section(folder / "k.so"))
        shown.append(".gch" in done.stderr.split("\n", 1)[0])
    headers = list((fresh / "cache" / "toolchain" / inlining.PCH_FOLDER).rglob("cpp_prefix.h.gch"))
    assert len(headers) == 1 and shown == [False, False, True, True], shown
    assert codes[0] == codes[1] == codes[2] == codes[3]


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(64, 192, bias=False)
        self.down = torch.nn.Linear(192, 64, bias=False)
        self.out = torch.nn.Linear(64, 480, bias=False)

    def forward(self, x):
        return self.out(x + self.down(torch.relu(self.up(x))))


@pytest.mark.skipif(not gcc_here(), reason="inductor's compiler here is not GCC")
@pytest.mark.parametrize("rows", [5, 8])
def test_inlined_gemm_templates_give_bit_identical_results(fresh, one_thread, rows):
    """The same frozen, autotuned CPU GEMM templates built by plain GCC and by the wrapper: equal outputs, bit for
    bit (and equal to the eager module within rounding)."""
    module = _Stack().eval()
    x = torch.randn(1, rows, 64, generator=torch.Generator().manual_seed(rows))
    outs = []
    for extra in ({}, inlining.compiler_options()):
        torch._dynamo.reset()
        compiled = torch.compile(module, dynamic=False)
        with torch.no_grad(), inductor_config.patch({**compiled_step.INDUCTOR_OPTIONS, **extra}):
            outs.append(compiled(x))
    torch._dynamo.reset()
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[1], module(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8])
def test_prefetching_gemm_templates_give_bit_identical_results(fresh, one_thread, rows):
    """`hf_bpd.runtime.prefetch`: the frozen CPU GEMM template compiled with and without the weight prefetches —
    the prefetch is in the generated kernel, and the outputs are equal bit for bit."""
    from torch._inductor.utils import run_and_get_code

    from hf_bpd.runtime import prefetch

    module = _Stack().eval()
    x = torch.randn(1, rows, 64, generator=torch.Generator().manual_seed(rows))
    outs, codes = [], []
    for prefetching in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(module, dynamic=False)
        with torch.no_grad(), inductor_config.patch(compiled_step.INDUCTOR_OPTIONS), contextlib.ExitStack() as stack:
            if prefetching:
                assert stack.enter_context(prefetch.prefetching_gemm_template())
            out, code = run_and_get_code(compiled, x)
        outs.append(out)
        codes.append("\n".join(code))
    torch._dynamo.reset()
    assert "__builtin_prefetch(B + (k + 32)" in codes[1] and "__builtin_prefetch" not in codes[0]
    assert "gemm" in codes[1]  # the GEMM template ran (max_autotune chose it), not only a library call
    assert torch.equal(outs[0], outs[1])


def test_prefetching_is_off_with_zero_or_an_unknown_template(monkeypatch):
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec

    from hf_bpd.runtime import prefetch

    original = CppMicroGemmFP32Vec.TEMPLATE_KERNEL
    monkeypatch.setenv("HF_BPD_OFF", "prefetch")
    with prefetch.prefetching_gemm_template() as on:
        assert not on and CppMicroGemmFP32Vec.TEMPLATE_KERNEL is original
    monkeypatch.setenv("HF_BPD_OFF", "")
    with prefetch.prefetching_gemm_template() as on:
        assert on and f"(k + {prefetch.PREFETCH_ROWS})" in CppMicroGemmFP32Vec.TEMPLATE_KERNEL
    assert CppMicroGemmFP32Vec.TEMPLATE_KERNEL is original
    monkeypatch.setattr(CppMicroGemmFP32Vec, "TEMPLATE_KERNEL", "another torch's template")
    with prefetch.prefetching_gemm_template() as on:
        assert not on and CppMicroGemmFP32Vec.TEMPLATE_KERNEL == "another torch's template"


def test_prefetching_applies_in_a_process_that_has_not_loaded_inductor():
    """`hf-bpd compile` and the background builder enter `prefetching_gemm_template()` in a new process, before
    anything loaded inductor: the prefetch line must be in the template there too (importing the micro-kernel's
    module first is a circular import inside torch, which turned the patch off for every artifact's build)."""
    script = ("import sys, torch\n"
              "assert 'torch._inductor.codegen.cpp_micro_gemm' not in sys.modules\n"
              "from hf_bpd.runtime.prefetch import prefetching_gemm_template\n"
              "with prefetching_gemm_template() as on:\n"
              "    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec\n"
              "    print(on, '__builtin_prefetch' in CppMicroGemmFP32Vec.TEMPLATE_KERNEL)\n")
    env = {**os.environ, "HF_BPD_OFF": ""}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"], done.stdout + done.stderr[-2000:]
