import subprocess
import sys


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "hf_bpd.cli", *args], capture_output=True, text=True, timeout=600)


def test_generate_with_packaged_base():
    result = run_cli("generate", "--model", "smollm2-135m-instruct", "--chat", "--prompt",
                     "What is the capital of France?", "--max-new-tokens", "12", "--compare")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "new tokens: 8 " in result.stdout  # "The capital of France is Paris." then EOS
    assert "identical output: True" in result.stdout


def test_generate_bad_model_is_one_line_error(tmp_path):
    result = run_cli("generate", "--model", str(tmp_path / "missing"), "--max-new-tokens", "2")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("hf-bpd: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
