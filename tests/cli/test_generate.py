"""``colibri generate MODEL_DIR --budget ...``: streams what the resident model generates."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from colibri.__main__ import main  # noqa: E402

PROMPT = "hello world"


def _reference(folder, model, new_tokens, batch=1):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoded = tokenizer([PROMPT] * batch, return_tensors="pt")
    out = model.generate(**encoded, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def test_generate_streams_the_resident_models_text(checkpoint, capsys):
    folder, model = checkpoint
    code = main(["generate", str(folder), "--budget", "48KiB", "--prompt", PROMPT,
                 "--max-new-tokens", "8", "--page-size-kb", "4"])  # fmt: skip
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, captured.err
    lines = out.splitlines()
    assert lines[0].startswith(str(folder)) and "2 MoE layers x 8 experts" in lines[0]
    assert lines[1] == _reference(folder, model, 8)
    assert re.search(r"prefill 11 tokens in [\d.]+ s \([\d.]+ tok/s\); decode 7 tokens", out)
    assert re.search(r"hit rate [\d.]+%, [\d.]+ MiB read per decoded token", out)
    assert re.search(r"prediction \(gate\) recall [\d.]+%", out)
    assert re.search(
        r"peak RSS [\d.]+ [MG]iB against a budget of [\d.]+ MiB for experts \+ [\d.]+ MiB of "
        r"resident weights \(RssAnon [\d.]+ [MG]iB, RssFile [\d.]+ [MG]iB now\)",
        out,
    )


def test_generate_options(checkpoint, capsys):
    folder, model = checkpoint
    from colibri import Partition

    partition = folder.parent / "groups.json"
    if not partition.exists():
        Partition.contiguous(8, 2).save(partition)
    code = main(["generate", str(folder), "--budget", "65536", "--prompt", PROMPT,
                 "--max-new-tokens", "4", "--batch-size", "3", "--no-read-ahead",
                 "--policy", "fifo", "--threads", "1", "--page-size-kb", "4", "--no-stream",
                 "--partition", str(partition), "--topk-groups", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "decode 9 tokens" in out  # 3 sequences x 3 tokens after the first
    assert "recall n/a (read-ahead off)" in out and "0 experts read ahead" in out
    assert "(fifo, 4 KiB pages)" in out


def test_generate_refuses_a_broken_checkpoint(checkpoint, tmp_path, capsys):
    import shutil

    folder, _ = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    config = json.loads((broken / "config.json").read_text())
    config["hidden_size"] = 40
    (broken / "config.json").write_text(json.dumps(config))
    assert main(["generate", str(broken), "--budget", "1MiB", "--prompt", PROMPT]) == 2
    err = capsys.readouterr().err
    assert err.startswith("colibri: error: ") and "config.json" in err and "fix:" in err
    assert main(["generate", str(folder), "--budget", "lots"]) == 2
    assert "budget must be a positive size" in capsys.readouterr().err


def test_generate_as_a_program(checkpoint):
    """The installed entry point, in a fresh process."""
    folder, model = checkpoint
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, "-m", "colibri", "generate", str(folder), "--budget", "64KiB",
         "--prompt", PROMPT, "--max-new-tokens", "5", "--page-size-kb", "4"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1] == _reference(folder, model, 5)


TEXT = ("Grüße aus Köln! 東京は晴れ、気温は25°C. naïve café — ¿qué tal? 🙂🚀 Ελληνικά, "
        "русский текст, emoji 👩‍💻 and plain ASCII words.")  # fmt: skip


def _tokenizer(kind: str):
    """A byte-level BPE (characters split over tokens), a Metaspace one (sentencepiece's
    leading spaces) or a character-level one, trained here on :data:`TEXT`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "characters":
        vocab = {c: i for i, c in enumerate(["<unk>", *sorted(set(TEXT))])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        tok.decoder = decoders.Fuse()
    else:
        tok = Tokenizer(models.BPE(unk_token=None if kind == "bytes" else "<unk>"))
        if kind == "bytes":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            alphabet = pre_tokenizers.ByteLevel.alphabet()
        else:
            tok.pre_tokenizer = pre_tokenizers.Metaspace()
            tok.decoder = decoders.Metaspace()
            alphabet = []
        trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet,
                                      special_tokens=["<unk>"])  # fmt: skip
        tok.train_from_iterator([TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)  # fmt: skip


@pytest.mark.parametrize("kind", ["bytes", "metaspace", "characters"])
def test_streamed_text_is_the_whole_texts_decoding(kind, capsys):
    """The streamer's pieces add up to the decoding of all the new tokens at once: of the
    text's own tokens, and of random ones (characters cut between tokens, bytes that make no
    character); decoding a few tokens at a time, not the text again for every token."""
    import random
    import types

    from colibri.cli.generate import _Streamer

    tokenizer = _tokenizer(kind)
    decoded = []
    decode = tokenizer.decode

    def counting(ids, **kwargs):
        decoded.append(len(ids))
        return decode(ids, **kwargs)

    tokenizer.decode = counting
    paging = types.SimpleNamespace(stats=types.SimpleNamespace(bytes_read=0))
    rng = random.Random(0)
    own = tokenizer.encode(TEXT, add_special_tokens=False)
    cases = [own] + [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
                     for _ in range(100)]  # fmt: skip
    for i, ids in enumerate(cases):
        streamer = _Streamer(tokenizer, True, paging)
        decoded.clear()
        for t in [0, *ids]:  # the prompt first, as transformers hands it
            streamer.put(torch.tensor([t]))
        streamer.end()
        assert capsys.readouterr().out == decode(ids, skip_special_tokens=True) + "\n", (kind, ids)
        if i == 0:  # the text's own tokens: every window a few tokens long
            assert sum(decoded) <= 8 * len(ids) and max(decoded) <= 16, decoded
