"""Usage errors of every command (an option out of range, not a number, unknown): exit status
2 and one line on stderr naming the option, never a traceback or a screen of usage text."""

import pytest

from levanter_core.cli import main


@pytest.mark.parametrize(
    "argv, option",
    [
        (["sample", "some-model", "--max-seqs", "0"], "--max-seqs"),
        (["sample", "some-model", "-n", "abc"], "-n"),
        (["sample", "some-model", "--max-seq-len", "1"], "--max-seq-len"),
        (["eval", "some-model", "--batch-size", "0"], "--batch-size"),
        (["eval", "some-model", "--max-batches", "-3"], "--max-batches"),
        (["import-hf", "a", "b", "--seq-len", "0"], "--seq-len"),
        (["import-hf", "a", "b", "--seq-len", "many"], "--seq-len"),
        (["export-hf", "a", "b", "--no-such-flag"], "--no-such-flag"),
        (["plugins", "--jsn"], "--jsn"),
        (["configs", "extra-argument"], "extra-argument"),
        (["no-such-command"], "no-such-command"),
    ],
)
def test_usage_errors_exit_2_with_one_line(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and option in err, err
    assert "Traceback" not in err
