"""Every error of the user's making is one line, ``colibri: error: ...``, and exit status 2;
Ctrl-C is 130. Never a traceback, a crash inside torch or an error from deep in a model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from colibri.cli import generate, main  # noqa: E402


def _one_line(err: str, *parts: str) -> str:
    assert err.startswith("colibri: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "usage:" not in err
    for part in parts:
        assert part in err, err
    return err


def _program(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "colibri", *argv], capture_output=True,
                          text=True, env=env, timeout=timeout)  # fmt: skip


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--page-size-kb", "3"], "argument --page-size-kb: page_size_kb must be >= 4 (got 3)"),
        (["--page-size-kb", "48"], "page_size_kb must be a power of two"),
        (["--threads", "0"], "argument --threads: the thread count must be >= 1 (got 0)"),
        (["--threads", "2147483648"], "the thread count must be at most"),
        (["--threads", "two"], "argument --threads: must be an integer (got 'two')"),
        (["--partition", "no-such.json"], "argument --partition: no-such.json: the partition"),
        (["--prompt", ""], "argument --prompt: the prompt is empty"),
        (["--budget", "lots"], "argument --budget: budget must be a positive size"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens"),
        (["--policy", "best"], "argument --policy: invalid choice: 'best'"),
    ],
)
def test_bad_arguments(checkpoint, capsys, argv, says):
    folder, _ = checkpoint
    assert main(["generate", str(folder), "--budget", "1MiB", *argv]) == 2
    _one_line(capsys.readouterr().err, says)


def test_a_thousand_threads_are_refused_before_torch_sees_them(checkpoint):
    """``torch.set_num_threads(3000)`` is a SIGSEGV: the count is refused first."""
    folder, _ = checkpoint
    result = _program("generate", str(folder), "--budget", "1MiB", "--threads", "3000")
    assert result.returncode == 2, result
    _one_line(result.stderr, "the thread count must be at most", "CPUs (got 3000)")


def test_a_directory_without_a_tokenizer(checkpoint, tmp_path, capsys):
    """Before: transformers built a tokenizer with no vocabulary, the prompt became no token
    and attention failed on a reshape. Now: refused before the weights are read."""
    folder, _ = checkpoint
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    assert main(["generate", str(bare), "--budget", "1MiB", "--page-size-kb", "4"]) == 2
    _one_line(capsys.readouterr().err, f"{bare}: no tokenizer files", "tokenizer.save_pretrained")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_tokenizer_file_that_is_a_fifo(checkpoint, tmp_path):
    """A FIFO named tokenizer.json would block the read forever: refused by its type."""
    folder, _ = checkpoint
    odd = tmp_path / "odd"
    shutil.copytree(folder, odd)
    os.remove(odd / "tokenizer.json")
    os.mkfifo(odd / "tokenizer.json")
    result = _program("generate", str(odd), "--budget", "1MiB", "--page-size-kb", "4", timeout=60)
    assert result.returncode == 2, result
    _one_line(result.stderr, f"{odd / 'tokenizer.json'}: a tokenizer file is a FIFO (named pipe)")


def test_a_prompt_of_no_tokens():
    """A prompt the tokenizer turns into nothing is refused before the model sees it."""

    def tokenizer(texts, return_tensors):
        return {"input_ids": torch.zeros((len(texts), 0), dtype=torch.long)}

    model = SimpleNamespace(colibri=None)
    args = SimpleNamespace(prompt="\u200b", batch_size=1)
    with pytest.raises(ValueError, match="is no token for this tokenizer"):
        generate.generate(model, tokenizer, args)


def test_a_broken_checkpoint_and_a_missing_directory(checkpoint, tmp_path, capsys):
    folder, _ = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    os.remove(broken / "model-00003-of-00009.safetensors")
    assert main(["generate", str(broken), "--budget", "1MiB", "--page-size-kb", "4"]) == 2
    _one_line(capsys.readouterr().err, "model-00003-of-00009.safetensors")
    assert main(["generate", str(tmp_path / "nowhere"), "--budget", "1MiB"]) == 2
    _one_line(capsys.readouterr().err, "nowhere: not a checkpoint directory")


def test_a_missing_extra(checkpoint, capsys, monkeypatch):
    folder, _ = checkpoint
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate: ImportError
    assert main(["generate", str(folder), "--budget", "1MiB"]) == 2
    _one_line(capsys.readouterr().err, "needs torch, transformers and accelerate",
              "pip install 'colibri-moe[cli]' torch")  # fmt: skip


def test_ctrl_c_is_130_and_closes_the_pager(checkpoint, capsys, monkeypatch):
    folder, _ = checkpoint
    seen = []

    def interrupted(model, tokenizer, args):
        seen.append(model)
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "generate", interrupted)
    assert main(["generate", str(folder), "--budget", "1MiB", "--page-size-kb", "4"]) == 130
    assert capsys.readouterr().err == "colibri: interrupted\n"
    assert seen[0].colibri.closed


def test_io_and_trusted_code_reach_the_loaders(checkpoint, capsys, monkeypatch):
    """``--io`` goes to from_pretrained(io=...) (absent: the loader's default); the tokenizer
    is loaded with trust_remote_code=False."""
    from transformers import AutoTokenizer

    import colibri.integrations.transformers as integration

    folder, _ = checkpoint
    calls = {}
    real_model, real_tokenizer = integration.from_pretrained, AutoTokenizer.from_pretrained

    def model(path, **kwargs):
        calls["model"] = dict(kwargs)
        kwargs.pop("io", None)  # this tree's from_pretrained may not take it yet
        return real_model(path, **kwargs)

    def tokenizer(path, **kwargs):
        calls["tokenizer"] = kwargs
        return real_tokenizer(path, **kwargs)

    monkeypatch.setattr(integration, "from_pretrained", model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tokenizer)
    base = ["generate", str(folder), "--budget", "1MiB", "--page-size-kb", "4",
            "--max-new-tokens", "1", "--no-stream"]  # fmt: skip
    for io in ("read", "mmap"):
        assert main([*base, "--io", io]) == 0, capsys.readouterr().err
        assert calls["model"]["io"] == io
        assert calls["tokenizer"] == {"trust_remote_code": False}
    assert main(base) == 0
    assert "io" not in calls["model"]
    assert main([*base, "--io", "mapped"]) == 2
    _one_line(capsys.readouterr().err, "argument --io: invalid choice: 'mapped'")
