"""scripts/exp_decode_attention.py at small sizes: the three attention paths agree within the
script's derived bound, each is timed, and bad counts are refused."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import exp_decode_attention  # noqa: E402


def test_the_paths_agree_and_are_timed(capsys):
    results = exp_decode_attention.main(["--rows", "3", "--keys", "5", "17", "--calls", "2", "--repeats", "1"])
    assert list(results) == [5, 17]
    for best in results.values():
        assert set(best) == {"sdpa_bool", "sdpa_float", "manual"} and all(0 < us < 1e6 for us in best.values())
    assert "17 keys: sdpa_bool" in capsys.readouterr().out


def test_a_path_that_disagrees_is_caught(monkeypatch):
    real = exp_decode_attention.attention_paths

    def off(*args, **kw):
        paths, values = real(*args, **kw)
        right = paths["manual"]
        paths["manual"] = lambda: right() + 1e-3
        return paths, values
    monkeypatch.setattr(exp_decode_attention, "attention_paths", off)
    with pytest.raises(AssertionError, match="manual differs from sdpa_bool"):
        exp_decode_attention.main(["--rows", "2", "--keys", "8", "--calls", "1", "--repeats", "1"])


def test_bad_counts_are_refused():
    for args in (["--heads", "8", "--kv-heads", "3"], ["--keys", "0"], ["--rows", "0"]):
        with pytest.raises(SystemExit):
            exp_decode_attention.main(args)
