"""megatronish.testing.cli: an entry point run in the test process ends as the program would."""

import sys

import pytest

from megatronish.testing.cli import assert_one_line, run_main


def test_an_exception_the_entry_point_lets_out_is_exit_1_with_its_traceback(capfd):
    def main(argv):
        raise KeyError("unreadable")

    code, out, err = run_main(main, [], capfd)
    assert code == 1 and out == ""
    assert "Traceback" in err and "KeyError: 'unreadable'" in err
    with pytest.raises(AssertionError):  # a CLI test's one-line check refuses it
        assert_one_line(code, err, 2, "unreadable")


def test_a_returned_code_and_a_sys_exit_are_the_exit_code(capfd):
    def refuses(argv):
        print(f"--input {argv[0]}: no such file", file=sys.stderr)
        sys.exit(2)

    assert run_main(lambda argv: 3, ["x"], capfd)[0] == 3
    code, out, err = run_main(refuses, ["x.jsonl"], capfd)
    assert out == ""
    assert_one_line(code, err, 2, "--input x.jsonl: no such file")
